"""Integration, real processes on loopback: keys that announce batches they do not hold, or that are not theirs.

A trainer that asks new identities for a proof of work, and one honest inference node. The attacker is this
process: a real DHT peer of ours (with its go-libp2p daemon), keys registered in the run, announcements on the
run's gossip topic, and a batch server that never answers. It tries to make the trainer
- fetch for keys the run does not admit, or buffer a body per key however many keys announce (a pull each), and
- sign and broadcast acknowledgements on demand, by announcing digests of other nodes' admitted batches.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import pytest
from hivemind.utils import get_dht_time

from intellect_node.launch import NodeProcess, join_argv
from intellect_node.p2p.batches import batch_protocol
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.gossip import Gossip
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.transport import MAX_READING_PER_PEER
from intellect_protocol.admission import solve_pow
from intellect_protocol.envelope import open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import BatchAck, BatchAnnounce, NodeRecord
from intellect_protocol.records import NODE_TTL_S, nodes_key
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

POW_BITS = 12


def _metric(url: str, name: str, reason: str | None = None) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if reason is None or f'="{reason}"' in line:  # reason=, or outcome= (metrics.LABEL_NAMES)
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("hostile")
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess(
            "trainer",
            ["bootstrap", "--data-dir", str(root / "t"), "--set", f"admission.pow_bits={POW_BITS}"],
            root / "logs",
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        worker = NodeProcess("inference", join_argv("inference", ready, root / "i"), root / "logs")
        nodes.append(worker)
        worker.wait_ready(timeout=120)
        yield ready
    finally:
        for node in reversed(nodes):
            node.stop()


class Attacker:
    """A DHT peer of the run with gossip, and keys it registers (with or without their proof of work)."""

    def __init__(self, ready: dict[str, Any]) -> None:
        self.ready = ready
        self.run_id = str(ready["run_id"])
        self.epoch = int(_status(ready["status_url"])["epoch"])
        self.me = Identity.generate()
        self.membership = Membership(self.me, self.run_id, Metrics())
        self.gossip: Gossip | None = None
        self.acks: list[BatchAck] = []

    async def __aenter__(self) -> Attacker:
        await self.membership.start("127.0.0.1", 0, [self.ready["p2p_maddrs"][0]])
        self.p2p = await self.membership.replicate_p2p()
        self.gossip = Gossip(self.p2p, self.run_id, Metrics())

        async def heard(data: bytes, peer: str) -> None:
            try:
                self.acks.append(open_signed(data, BatchAck).message)
            except Exception:  # a verdict, or anything else on the topic
                pass

        self.gossip.subscribe("verdicts", heard)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.gossip is not None:
            await self.gossip.close()
        await self.membership.close()

    def register(self, key: Identity, pow_bits: int) -> None:
        nonce = solve_pow(self.run_id, self.epoch, key.node_id, pow_bits) if pow_bits else 0
        record = NodeRecord(
            run_id=self.run_id, node_id=key.node_id, role="inference", updated=time.time(), pow_nonce=nonce
        )
        assert self.membership.dht is not None
        stored = self.membership.dht.store(
            nodes_key(self.run_id), seal(key, record), get_dht_time() + NODE_TTL_S, subkey=key.node_id
        )
        assert stored

    async def announce(self, key: Identity, digest: str, size: int, epoch: int) -> None:
        a = BatchAnnounce(
            run_id=self.run_id,
            epoch=epoch,
            node_id=key.node_id,
            version=0,
            batch_index=0,
            batch_sha256=digest,
            size=size,
            issued=time.time(),
        )
        assert self.gossip is not None
        await self.gossip.publish("rollouts", seal(key, a))


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/status", timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


def test_announcements_get_no_pull_before_admission_and_pulls_share_the_intake_budget(swarm: Any) -> None:
    url = swarm["status_url"]
    epoch = int(_status(url)["epoch"])

    async def scenario() -> tuple[set[str], set[str], int, float]:
        async with Attacker(swarm) as attacker:
            unproven = [Identity.generate() for _ in range(10)]
            proven = [Identity.generate() for _ in range(10)]
            for key in unproven:
                attacker.register(key, 0)
            for key in proven:
                attacker.register(key, POW_BITS)
            digests = {key.node_id: f"{i:064x}" for i, key in enumerate(unproven + proven, start=1)}
            asked: list[str] = []
            open_now, peak = [0], [0]
            release = asyncio.Event()

            async def stall(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                open_now[0] += 1
                peak[0] = max(peak[0], open_now[0])
                try:
                    length = int.from_bytes(await reader.readexactly(8), "big")
                    asked.append((await reader.readexactly(length)).decode("latin-1"))  # names the digest asked for
                    await release.wait()  # holds the trainer's fetch until its own deadline
                finally:
                    open_now[0] -= 1
                    writer.close()

            await attacker.p2p.add_binary_stream_handler(batch_protocol(attacker.run_id), stall)
            refused_pow = _metric(url, "node_gossip_rejected_total", "pow")
            full = _metric(url, "node_trainer_pulls_total", "intake_full")
            announced = [-1e9]

            async def all_heard() -> bool:
                # every key announces again every 2 s (within gossip's rate per peer) until the trainer has answered
                # each (gossip is lossy)
                if time.monotonic() - announced[0] > 2.0:
                    announced[0] = time.monotonic()
                    for key in unproven + proven:
                        await attacker.announce(key, digests[key.node_id], 16 << 20, epoch)
                heard_pow = _metric(url, "node_gossip_rejected_total", "pow") - refused_pow
                pulls = len(asked) + _metric(url, "node_trainer_pulls_total", "intake_full") - full
                return heard_pow >= len(unproven) and pulls >= len(proven)

            await until(all_heard, "the trainer to answer every announcement", 120, every=0.25)
            release.set()
            unproven_ids = {digests[k.node_id] for k in unproven}
            fetched_for = {d for d in unproven_ids if any(d in request for request in asked)}
            proven_ids = {digests[k.node_id] for k in proven}
            fetched_proven = {d for d in proven_ids if any(d in request for request in asked)}
            return fetched_for, fetched_proven, peak[0], _metric(url, "node_gossip_rejected_total", "pow") - refused_pow

    fetched_unproven, fetched_proven, peak, refused = asyncio.run(scenario())
    assert fetched_unproven == set()  # not admitted (no proof of work): nothing fetched, nothing buffered
    assert refused >= 10
    assert fetched_proven  # admitted keys' announcements are still pulled ...
    assert peak <= MAX_READING_PER_PEER  # ... within the intake budget pushes draw on, not one body per key


def test_only_a_batchs_producer_can_make_the_trainer_acknowledge_it_again(swarm: Any) -> None:
    url = swarm["status_url"]
    epoch = int(_status(url)["epoch"])

    async def scenario() -> float:
        async with Attacker(swarm) as attacker:
            key = Identity.generate()
            attacker.register(key, POW_BITS)
            await until(lambda: bool(attacker.acks), "an acknowledgement of an honest batch", 180, every=0.25)
            honest = attacker.acks[0]
            before = _metric(url, "node_gossip_rejected_total", "foreign_announcement")

            async def refused() -> bool:
                await attacker.announce(key, honest.batch_sha256, 1024, epoch)
                return _metric(url, "node_gossip_rejected_total", "foreign_announcement") > before

            # a wait on the refusal itself: before it, the trainer signed and broadcast the ack again for anyone
            await until(refused, "the trainer to refuse an announcement of another node's batch", 60, every=0.25)
            return _metric(url, "node_gossip_rejected_total", "foreign_announcement") - before

    assert asyncio.run(scenario()) >= 1


def test_a_peer_that_floods_invite_redemptions_is_held_and_cut_off(swarm: Any) -> None:
    """Each redemption costs the trainer a stream and two signature checks: past its rate a peer's requests count
    as strikes, and a peer with three is held unread and disconnected, as for unusable frames."""
    from hivemind.p2p import P2P

    from intellect_node.roles.invites import BURST, call_redeem

    async def scenario() -> list[str]:
        p2p = await P2P.create(initial_peers=swarm["p2p_maddrs"][:1], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        trainer_peer = swarm["p2p_maddrs"][0].rsplit("/p2p/", 1)[1]
        answers: list[str] = []
        try:
            for _ in range(int(BURST) + 8):
                key = Identity.generate()
                reply = await call_redeem(p2p, key, swarm["run_id"], trainer_peer, b"")
                answers.append(reply.reason or "ok")
                if "malformed frames" in reply.detail:  # held unread first, then refused: the penalty
                    answers.append("penalized")
                    break
        finally:
            await p2p.shutdown()
        return answers

    answers = asyncio.run(scenario())
    assert answers[-1] == "penalized", answers
    assert answers.count("ok") <= BURST + 1 and "rate" in answers
