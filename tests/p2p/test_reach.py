"""Dial-back reachability checks with real daemons and a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import socket

import pytest

from intellect_node.p2p.dht import Membership
from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.reach import DialBackServer, _targets, announced, ask_dialback
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
from intellect_protocol.messages import DialBack

RUN_KEY = Identity.generate()
RUN_ID = RUN_KEY.node_id


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_it_only_ever_dials_the_address_the_request_came_from() -> None:
    """A node cannot make the trainer connect to a third party: claimed addresses at other IPs are replaced by the
    observed IP (a node behind NAT claims its private address; the port is what it can tell us)."""
    ask = DialBack(run_id=RUN_ID, node_id=RUN_ID, p2p_maddrs=["/ip4/10.0.0.5/tcp/4001", "/ip4/8.8.8.8/tcp/53",
                                                             "/dns4/example.com/tcp/80"])  # fmt: skip
    assert _targets(ask, "203.0.113.7") == [("203.0.113.7", 4001), ("203.0.113.7", 53)]
    ask = DialBack(run_id=RUN_ID, node_id=RUN_ID, p2p_maddrs=[f"/ip4/1.2.3.4/tcp/{p}" for p in range(1, 9)])
    assert len(_targets(ask, "1.2.3.4")) == 4  # MAX_TARGETS connection attempts per request, at most


def test_a_node_learns_whether_it_can_be_reached_from_outside() -> None:
    asyncio.run(_dialback())


async def _dialback() -> None:
    trainer = Membership(RUN_KEY, RUN_ID, Metrics())
    joiner_key = Identity.generate()
    joiner = Membership(joiner_key, RUN_ID, Metrics())
    http = HttpServer(Metrics(), lambda: {}, [])
    server = None
    try:
        maddrs = await trainer.start("127.0.0.1", 0, [])
        server = DialBackServer(await trainer.replicate_p2p(), RUN_KEY, RUN_ID, trainer.metrics)
        await server.start()
        mine = await joiner.start("127.0.0.1", 0, maddrs[:1])
        p2p = await joiner.replicate_p2p()
        peer = maddrs[0].rsplit("/p2p/", 1)[1]
        port = await http.start("127.0.0.1", 0)

        r = await ask_dialback(p2p, joiner_key, RUN_ID, peer, mine, port)
        assert (r.observed_ip, r.p2p_ok, r.http_ok) == ("127.0.0.1", True, True)

        # nothing listens where it claims to be (a NAT without a port forward looks like this from outside)
        closed = _closed_port()
        r = await ask_dialback(p2p, joiner_key, RUN_ID, peer, [f"/ip4/127.0.0.1/tcp/{closed}"], _closed_port())
        assert (r.p2p_ok, r.http_ok) == (False, False)

        # an HTTP server that is not a node's (a plain TCP listener) does not count, nor does a non-libp2p port
        r = await ask_dialback(p2p, joiner_key, RUN_ID, peer, [f"/ip4/127.0.0.1/tcp/{port}"], closed)
        assert (r.p2p_ok, r.http_ok) == (False, False)

        # a flood of requests from one peer is cut off after the bucket's burst (not answered: the stream closes)
        with pytest.raises((ConnectionError, Rejected, asyncio.IncompleteReadError)):
            for _ in range(5):
                await ask_dialback(p2p, joiner_key, RUN_ID, peer, mine, port)
        assert trainer.metrics.counter("node_dialbacks_total", "rate") >= 1
    finally:
        await http.close()
        if server is not None:
            await server.close()
        await joiner.close()
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
