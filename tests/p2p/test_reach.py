"""Dial-back reachability checks with real daemons, real sockets and a real HTTP server on loopback, and the
dial-back endpoint's limits played against by an attacker (fresh peer ids, silent ports, a silent trainer)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import aiohttp
import pytest
from hivemind.p2p import P2P

from intellect_node.aio import within
from intellect_node.config import NodeConfig
from intellect_node.p2p import reach
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.reach import DialBackServer, _targets, announced, ask_dialback, dialback_protocol
from intellect_node.roles.volunteer import Volunteer
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
from intellect_protocol.messages import DialBack, NodeRecord, Reachability, RunSpec
from tests.helpers.net import free_port
from tests.helpers.wait import until

RUN_KEY = Identity.generate()
RUN_ID = RUN_KEY.node_id
WAIT_S = 60.0
"""Bound on every wait for something that must happen (generous: two shared cores)."""


class Silent:
    """TCP listeners that accept and never answer, as a port behind a firewall that drops nothing but answers
    nothing: each connection stays open until the prober closes it (or ``release``)."""

    def __init__(self) -> None:
        self.accepted: dict[int, int] = {}
        self.open = 0
        self.most_open = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._servers: list[asyncio.Server] = []

    async def listen(self, ip: str = "127.0.0.1") -> int:
        server = await asyncio.start_server(self._hold, ip, 0)
        self._servers.append(server)
        port = int(server.sockets[0].getsockname()[1])
        self.accepted[port] = 0
        return port

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted[writer.get_extra_info("sockname")[1]] += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        self._writers.append(writer)
        try:
            while await reader.read(4096):
                pass
        except ConnectionError:
            pass
        finally:
            self.open -= 1
            writer.close()

    def release(self) -> None:
        for w in self._writers:
            w.close()

    async def close(self) -> None:
        self.release()
        for s in self._servers:
            s.close()
            await s.wait_closed()


class Trainer:
    """A trainer's DHT peer with the dial-back server, on loopback."""

    async def start(self) -> None:
        self.membership = Membership(RUN_KEY, RUN_ID, Metrics())
        self.maddrs = await self.membership.start("127.0.0.1", 0, [])
        self.peer = self.maddrs[0].rsplit("/p2p/", 1)[1]
        self.p2p = await self.membership.replicate_p2p()
        self.server = DialBackServer(self.p2p, RUN_KEY, RUN_ID, self.membership.metrics)
        await self.server.start()

    async def peer_at(self, ip: str) -> P2P:
        """A fresh daemon (a fresh libp2p peer id, free to make) whose connections come from ``ip``."""
        return await P2P.create(initial_peers=self.maddrs[:1], host_maddrs=[f"/ip4/{ip}/tcp/0"])

    async def close(self) -> None:
        await self.server.close()
        await self.membership.close()


def test_it_only_ever_dials_the_address_the_request_came_from() -> None:
    """A node cannot make the trainer connect to a third party: claimed addresses at other IPs are replaced by the
    observed IP (a node behind NAT claims its private address; the port is what it can tell us)."""
    ask = DialBack(
        run_id=RUN_ID,
        node_id=RUN_ID,
        p2p_maddrs=["/ip4/10.0.0.5/tcp/4001", "/ip4/8.8.8.8/tcp/53", "/dns4/example.com/tcp/80"],
    )
    assert _targets(ask, "203.0.113.7") == [("203.0.113.7", 4001), ("203.0.113.7", 53)]
    ask = DialBack(run_id=RUN_ID, node_id=RUN_ID, p2p_maddrs=[f"/ip4/1.2.3.4/tcp/{p}" for p in range(1, 9)])
    assert len(_targets(ask, "1.2.3.4")) == reach.MAX_TARGETS
    ask = DialBack(run_id=RUN_ID, node_id=RUN_ID, p2p_maddrs=["/ip4/1.2.3.4/tcp/1"] * 8)
    assert _targets(ask, "1.2.3.4") == [("1.2.3.4", 1)]  # one address named eight times is tried once


@pytest.mark.integration
def test_a_node_learns_whether_it_can_be_reached_from_outside() -> None:
    asyncio.run(_dialback())


async def _dialback() -> None:
    trainer = Trainer()
    joiner_key = Identity.generate()
    joiner = Membership(joiner_key, RUN_ID, Metrics())
    http = HttpServer(Metrics(), lambda: {}, [])
    try:
        await trainer.start()
        mine = await joiner.start("127.0.0.1", 0, trainer.maddrs[:1])
        p2p = await joiner.replicate_p2p()
        port = await http.start("127.0.0.1", 0)

        r = await ask_dialback(p2p, joiner_key, RUN_ID, trainer.peer, mine, port)
        assert (r.observed_ip, r.p2p_ok, r.http_ok) == ("127.0.0.1", True, True)

        # nothing listens where it claims to be (a NAT without a port forward looks like this from outside)
        closed = free_port()
        r = await ask_dialback(p2p, joiner_key, RUN_ID, trainer.peer, [f"/ip4/127.0.0.1/tcp/{closed}"], free_port())
        assert (r.p2p_ok, r.http_ok) == (False, False)

        # an HTTP server that is not a node's (a plain TCP listener) does not count, nor does a non-libp2p port
        r = await ask_dialback(p2p, joiner_key, RUN_ID, trainer.peer, [f"/ip4/127.0.0.1/tcp/{port}"], closed)
        assert (r.p2p_ok, r.http_ok) == (False, False)
    finally:
        await http.close()
        await joiner.close()
        await trainer.close()


@pytest.mark.integration
def test_fresh_peer_ids_from_one_ip_are_refused_past_that_ips_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    """A libp2p peer id is free: the rate limit counts the IP the stream came from. One IP asking from ever new
    peer ids gets its burst answered and the rest refused at once with a signed ``rate`` answer; another IP is
    still answered; the server keeps one bucket per IP, however many peer ids asked."""
    monkeypatch.setattr(reach, "PER_IP_PER_MIN", 1e-9)  # nothing refills during the test: exactly the burst
    asyncio.run(_fresh_peer_ids())


async def _fresh_peer_ids() -> None:
    trainer = Trainer()
    try:
        await trainer.start()
        outcomes, peer_ids = [], set()
        for _ in range(int(reach.PER_IP_BURST) + 3):
            attacker = await trainer.peer_at("127.0.0.1")
            peer_ids.add(attacker.peer_id)
            try:
                await ask_dialback(attacker, Identity.generate(), RUN_ID, trainer.peer, [], 0)
                outcomes.append("answered")
            except Rejected as e:
                outcomes.append(e.reason)
            finally:
                await attacker.shutdown()
        assert len(peer_ids) == len(outcomes)
        assert outcomes == ["answered"] * int(reach.PER_IP_BURST) + ["rate"] * 3
        assert trainer.membership.metrics.counter("node_dialbacks_total", "rate") == 3

        other = await trainer.peer_at("127.0.0.2")  # the limit is that IP's, not everyone's
        try:
            r = await ask_dialback(other, Identity.generate(), RUN_ID, trainer.peer, [], 0)
            assert r.observed_ip == "127.0.0.2"
        finally:
            await other.shutdown()
        await until(lambda: trainer.server.sources()[1] == 0, "the server to finish its requests", WAIT_S)
        assert trainer.server.sources() == (2, 0)  # a bucket per IP, nothing left in flight
    finally:
        await trainer.close()


@pytest.mark.integration
def test_requests_past_the_in_flight_bounds_are_refused_not_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests held by silent ports fill an IP's share of the server (PER_IP_AT_ONCE), then all of it
    (MAX_AT_ONCE, here 3): one more request, from that IP or from a third one, is refused ``busy`` while the
    held ones are still unanswered, and once those are done nothing stays in flight."""
    monkeypatch.setattr(reach, "MAX_AT_ONCE", 3)
    # the held requests last until the test releases them, whatever the machine's load
    monkeypatch.setattr(reach, "PROBE_DEADLINE_S", WAIT_S)
    monkeypatch.setattr(reach, "REQUEST_DEADLINE_S", 3 * WAIT_S)
    monkeypatch.setattr(reach, "ASK_TIMEOUT_S", 3 * WAIT_S)
    asyncio.run(_in_flight_bounds())


async def _in_flight_bounds() -> None:
    trainer, silent = Trainer(), Silent()
    peers: list[P2P] = []
    held: list[asyncio.Future[Reachability]] = []

    async def fresh_peer(ip: str) -> P2P:
        peers.append(await trainer.peer_at(ip))
        return peers[-1]

    async def hold(peer: P2P, ip: str, port: int) -> None:
        """A request whose probe the silent listener at ``port`` holds until released."""
        before = silent.accepted[port]
        ask = ask_dialback(peer, Identity.generate(), RUN_ID, trainer.peer, [f"/ip4/{ip}/tcp/{port}"], 0)
        held.append(asyncio.ensure_future(ask))
        await until(lambda: silent.accepted[port] > before, f"the trainer to probe {ip}:{port}", WAIT_S)

    async def refused(ip: str) -> str:
        with pytest.raises(Rejected) as e:
            await ask_dialback(await fresh_peer(ip), Identity.generate(), RUN_ID, trainer.peer, [], 0)
        assert not any(t.done() for t in held)  # answered at once, while the held ones still wait
        return e.value.reason

    try:
        await trainer.start()
        one, two = await silent.listen("127.0.0.1"), await silent.listen("127.0.0.2")
        first = await fresh_peer("127.0.0.1")
        for _ in range(reach.PER_IP_AT_ONCE):
            await hold(first, "127.0.0.1", one)
        assert await refused("127.0.0.1") == "busy"  # that IP's share is full, the server is not
        await hold(await fresh_peer("127.0.0.2"), "127.0.0.2", two)
        assert await refused("127.0.0.3") == "busy"  # the server is full: a third IP is refused too
        assert trainer.membership.metrics.counter("node_dialbacks_total", "busy") == 2

        silent.release()  # the held probes end: their requests are answered (unreachable), and leave
        answers = await within(asyncio.gather(*held), WAIT_S)
        assert [(a.p2p_ok, a.http_ok) for a in answers] == [(False, False)] * 3
        await until(lambda: trainer.server.sources()[1] == 0, "the server to finish its requests", WAIT_S)
        r = await ask_dialback(peers[-1], Identity.generate(), RUN_ID, trainer.peer, [], 0)
        assert r.observed_ip == "127.0.0.3"  # the refusal cost that IP nothing
    finally:
        for t in held:
            t.cancel()
        for p in peers:
            await p.shutdown()
        await silent.close()
        await trainer.close()


@pytest.mark.integration
def test_a_request_naming_silent_ports_costs_one_deadline_not_one_each() -> None:
    """Eight claimed ports and an HTTP port that accept and never answer: the trainer tries MAX_TARGETS of the
    ports and the HTTP port all at once, under one deadline (every probe connection was open at the same time),
    and answers: unreachable."""
    asyncio.run(_silent_ports())


async def _silent_ports() -> None:
    trainer, silent = Trainer(), Silent()
    joiner = None
    try:
        await trainer.start()
        ports = [await silent.listen() for _ in range(8)]
        http_port = await silent.listen()
        joiner = await trainer.peer_at("127.0.0.1")
        claimed = [f"/ip4/127.0.0.1/tcp/{p}" for p in ports]
        r = await within(ask_dialback(joiner, Identity.generate(), RUN_ID, trainer.peer, claimed, http_port), WAIT_S)
        assert (r.p2p_ok, r.http_ok) == (False, False)
        assert [silent.accepted[p] for p in ports] == [1] * reach.MAX_TARGETS + [0] * (8 - reach.MAX_TARGETS)
        assert silent.accepted[http_port] == 1
        assert silent.most_open == reach.MAX_TARGETS + 1  # in parallel: not one silent port after another
        await until(lambda: silent.open == 0, "the trainer to close its probes", WAIT_S)
    finally:
        if joiner is not None:
            await joiner.shutdown()
        await silent.close()
        await trainer.close()


class _Joiner(Volunteer):
    async def work(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        raise AssertionError("not run here")


@pytest.mark.integration
def test_a_joiner_announces_only_what_a_dial_back_confirmed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer that never answers the dial-back, then one that refuses it: the joiner announces no address
    (no p2p addresses, no HTTP URL) and tells the volunteer which ports to open. Once a dial-back answers, it
    announces what was reached."""
    monkeypatch.setattr(reach, "ASK_TIMEOUT_S", 3.0)
    monkeypatch.setattr("intellect_node.roles.volunteer.RECHECK_S", 0.1)
    caplog.set_level(logging.WARNING, logger="intellect_node.roles.volunteer")
    asyncio.run(_joiner(tmp_path, monkeypatch, caplog))


async def _joiner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    trainer = Trainer()
    v = None
    try:
        await trainer.start()
        await trainer.server.close()

        async def silent(_: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.read()  # holds the stream until the asker gives up
            finally:
                writer.close()

        await trainer.p2p.add_binary_stream_handler(dialback_protocol(RUN_ID), silent)
        record = NodeRecord(
            run_id=RUN_ID, node_id=RUN_ID, role="trainer", p2p_maddrs=trainer.maddrs, updated=time.time()
        )
        assert await trainer.membership.publish_record(record)

        v = _Joiner(NodeConfig(data_dir=tmp_path, run_id=RUN_ID, peers=trainer.maddrs[:1]))
        v.maddrs = await v.membership.start("127.0.0.1", 0, trainer.maddrs[:1])
        port = await v.http.start("127.0.0.1", 0)
        v.maddrs, v.status_url = announced("127.0.0.1", None, v.maddrs, port)
        p2p_port = v.maddrs[0].split("/tcp/")[1].split("/")[0]
        v.p2p = await v.membership.replicate_p2p()

        await v.check_reachability()  # the trainer is silent: the ask times out
        assert (v.record().p2p_maddrs, v.record().http_url, v.reachability["checked"]) == ([], None, False)
        assert "did not answer" in v.reachability["detail"]
        warned = [r.getMessage() for r in caplog.records if "reachability not checked" in r.getMessage()]
        assert len(warned) == 1 and f"TCP ports {p2p_port} and {port}" in warned[0] and "--announce" in warned[0]

        await trainer.p2p.remove_binary_stream_handler(dialback_protocol(RUN_ID))
        with monkeypatch.context() as m:  # a trainer too busy to check
            m.setattr(reach, "MAX_AT_ONCE", 0)
            await trainer.server.start()
            await v.check_reachability()
        assert (v.record().p2p_maddrs, v.record().http_url, v.reachability["checked"]) == ([], None, False)
        assert "busy" in v.reachability["detail"]

        await within(v.recheck_reachability(), WAIT_S)  # asks again until a dial-back answers
        assert v.reachability == {"checked": True, "observed_ip": "127.0.0.1", "p2p": True, "http": True}
        assert (v.record().p2p_maddrs, v.record().http_url) == (v.maddrs, v.status_url)
    finally:
        if v is not None:
            await v.http.close()
            await v.membership.close()
        await trainer.close()


def test_what_a_node_announces() -> None:
    lo = "/ip4/127.0.0.1/tcp/4001/p2p/QmPeer"
    lan = "/ip4/192.168.1.7/tcp/4001/p2p/QmPeer"
    assert announced("127.0.0.1", None, [lo], 8000) == ([lo], "http://127.0.0.1:8000")
    # listening everywhere: the HTTP URL names an address others can use, never 0.0.0.0
    assert announced("0.0.0.0", None, [lo, lan], 8000) == ([lo, lan], "http://192.168.1.7:8000")
    # behind a router that forwards the ports: its public address first
    maddrs, url = announced("0.0.0.0", "203.0.113.9", [lan, lo], 8000)
    assert maddrs[0] == "/ip4/203.0.113.9/tcp/4001/p2p/QmPeer" and url == "http://203.0.113.9:8000"
