"""A validator's batch fetches against a liar, on real p2p daemons (loopback): the attacker cannot stall them.

Four daemons, each started by our DHT process with gossipsub: the trainer (the run key; it holds every admitted
batch and serves it by digest), an honest producer, an attacker and the validator, a real ``ValidatorNode``
wired to its topics the way ``ValidatorNode.work`` wires it, with its model check stubbed (it returns an accepting
verdict about the bytes it was handed: what is under test is where those bytes came from and how soon).

The attacker echoes every digest it hears on ``rollouts``, both as its own announcement and as a replay of the
producer's signed one from its own peer, and its batch server takes every request and never answers. It also
produces a batch of its own (admitted by the trainer) that it then refuses to serve. The trainer's side of the test
waits on each batch's verdict exactly as the trainer does (``VerdictWait`` within ``verify.verdict_wait_s``):
every batch must be judged by the validator, none left for the trainer to judge itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from intellect_node.config import NodeConfig
from intellect_node.p2p.batches import BatchServer, batch_protocol
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.gossip import LIMITS, Gossip
from intellect_node.p2p.metrics import Metrics
from intellect_node.roles.trainer_gossip import VerdictWait
from intellect_node.roles.validator_node import ValidatorNode
from intellect_protocol.envelope import Rejected, kind_of, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import (
    BatchAck,
    BatchAnnounce,
    ModelSpec,
    RolloutBatch,
    RolloutGroup,
    RunSpec,
    Verdict,
    VerifySpec,
)
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

RUN_KEY = Identity.generate()
RUN_ID = RUN_KEY.node_id
VERDICT_WAIT_S = 20.0
"""Shorter than a stalled fetch's 30 s read timeout, long enough for a loaded 2-core machine to judge three stubs."""
REPEAT_S = 0.5
"""How often the producer announces again, and the attacker echoes again (a real producer: every few seconds)."""


def _batch(producer: Identity, index: int) -> bytes:
    group = RolloutGroup(slot=0, prompt_ids=[1, 2], completions=[[3, 4]], logprobs=[[-0.5, -0.25]])
    return seal(
        producer, RolloutBatch(run_id=RUN_ID, node_id=producer.node_id, version=0, batch_index=index, groups=[group])
    )


def _announce(producer: Identity, envelope: bytes, index: int) -> bytes:
    digest = hashlib.sha256(envelope).hexdigest()
    a = BatchAnnounce(
        run_id=RUN_ID,
        node_id=producer.node_id,
        version=0,
        batch_index=index,
        batch_sha256=digest,
        size=len(envelope),
        issued=time.time(),
    )
    return seal(producer, a)


def _spy(
    log: list[tuple[bytes, str]], handler: Callable[[bytes, str], Awaitable[None]]
) -> Callable[..., Awaitable[None]]:
    async def heard(data: bytes, peer: str) -> None:
        log.append((data, peer))
        await handler(data, peer)

    return heard


class StallingServer:
    """The attacker's batch/v1 handler: takes every request and never answers, until the asker hangs up."""

    def __init__(self) -> None:
        self.asked = 0
        self.open = 0

    async def on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.asked += 1
        self.open += 1
        try:
            while await reader.read(65536):
                pass
        finally:
            self.open -= 1
            writer.close()


def test_a_validator_fetches_past_an_echoing_stalling_key(tmp_path: Path) -> None:
    asyncio.run(_echoing_stalling_key(tmp_path))


async def _echoing_stalling_key(tmp_path: Path) -> None:
    producer_key, attacker_key = Identity.generate(), Identity.generate()
    trainer = Membership(RUN_KEY, RUN_ID, Metrics())
    producer = Membership(producer_key, RUN_ID, Metrics())
    attacker = Membership(attacker_key, RUN_ID, Metrics())
    started: list[Membership] = []
    gossips: list[Gossip] = []
    servers: list[BatchServer] = []
    tasks: list[asyncio.Task[None]] = []
    node: ValidatorNode | None = None
    try:
        maddrs = await trainer.start("127.0.0.1", 0, [])
        started.append(trainer)
        for m in (producer, attacker):
            await m.start("127.0.0.1", 0, maddrs[:1])
            started.append(m)
        node = ValidatorNode(NodeConfig(data_dir=tmp_path / "v", run_id=RUN_ID, peers=maddrs[:1]))
        await node.membership.start("127.0.0.1", 0, maddrs[:1])
        started.append(node.membership)
        node.p2p = await node.membership.replicate_p2p()
        node.spec = RunSpec(
            run_id=RUN_ID,
            created=time.time(),
            seed=0,
            model=ModelSpec(),
            verify=VerifySpec(verdict_wait_s=VERDICT_WAIT_S),
        )
        judged: list[bytes] = []
        validator_id = node.identity.node_id

        async def judge(data: bytes, full: bool = False) -> Verdict:  # the model check, stubbed
            batch = open_signed(data, RolloutBatch).message
            judged.append(data)
            return Verdict(
                run_id=RUN_ID,
                node_id=batch.node_id,
                version=batch.version,
                batch_index=batch.batch_index,
                batch_sha256=hashlib.sha256(data).hexdigest(),
                ok=True,
            )

        node.judge = judge  # type: ignore[method-assign]
        p2ps = {name: await m.replicate_p2p() for name, m in (("t", trainer), ("p", producer), ("a", attacker))}
        t_gossip, p_gossip, a_gossip = (Gossip(p2ps[n], RUN_ID, Metrics()) for n in "tpa")
        node.gossip = Gossip(node.p2p, RUN_ID, node.metrics)
        gossips += [t_gossip, p_gossip, a_gossip, node.gossip]
        peer_of = {n: p.peer_id.to_base58() for n, p in p2ps.items()}

        # the batches: two honest ones, and one of the attacker's own that it will not serve
        honest = [_batch(producer_key, i) for i in range(2)]
        own = _batch(attacker_key, 0)
        digest = {e: hashlib.sha256(e).hexdigest() for e in [*honest, own]}
        for name, held in (("t", {digest[e]: e for e in [*honest, own]}), ("p", {digest[e]: e for e in honest})):
            server = BatchServer(p2ps[name], RUN_ID, held.get, Metrics())
            await server.start()
            servers.append(server)
        stalling = StallingServer()
        await p2ps["a"].add_binary_stream_handler(batch_protocol(RUN_ID), stalling.on_stream)

        # the validator, wired as ValidatorNode.work wires it, each message it hears logged on the way in
        announcements: list[tuple[bytes, str]] = []
        acks: list[tuple[bytes, str]] = []
        node.gossip.subscribe("rollouts", _spy(announcements, node._on_announce))
        node.gossip.subscribe("verdicts", _spy(acks, node._on_ack))
        tasks.append(asyncio.ensure_future(node.judge_forever()))

        # the attacker: every digest it hears is echoed as its own and replayed from its peer, again and again
        heard_by_attacker: dict[str, bytes] = {}

        async def on_rollouts(data: bytes, peer: str) -> None:
            if peer != peer_of["a"]:
                heard_by_attacker[open_signed(data, BatchAnnounce).message.batch_sha256] = data

        async def echo_forever() -> None:
            while True:
                for data in list(heard_by_attacker.values()):
                    a = open_signed(data, BatchAnnounce).message
                    mine = a.model_copy(update={"node_id": attacker_key.node_id, "issued": time.time()})
                    await a_gossip.publish("rollouts", seal(attacker_key, mine))
                    await a_gossip.publish("rollouts", data)
                await asyncio.sleep(REPEAT_S)

        a_gossip.subscribe("rollouts", on_rollouts)
        t_gossip.subscribe("rollouts", _noop)  # the trainer is on the topic too, and forwards it
        waits: dict[str, VerdictWait] = {}

        async def on_verdicts(data: bytes, peer: str) -> None:  # the trainer's _on_verdict, for one validator
            if kind_of(data, LIMITS["verdicts"]) == Verdict.KIND:
                signed = open_signed(data, Verdict)
                if signed.signer_id == validator_id and signed.message.batch_sha256 in waits:
                    waits[signed.message.batch_sha256].add(signed.signer_id, signed.message, data)

        t_gossip.subscribe("verdicts", on_verdicts)
        for g, name in (
            (node.gossip, "rollouts"),
            (node.gossip, "verdicts"),
            (a_gossip, "rollouts"),
            (t_gossip, "rollouts"),
            (t_gossip, "verdicts"),
        ):
            await asyncio.wait_for(g.subscribed[name].wait(), 60)
        tasks.append(asyncio.ensure_future(echo_forever()))

        def heard(peer: str, d: str, node_id: str | None = None) -> list[int]:
            """Where in the validator's log the announcements of ``d`` from ``peer`` (by ``node_id``) are."""
            found = [(i, open_signed(data, BatchAnnounce).message) for i, (data, p) in enumerate(announcements)]
            return [
                i
                for i, a in found
                if announcements[i][1] == peer and a.batch_sha256 == d and node_id in (None, a.node_id)
            ]

        # each batch announced by its producer until the validator heard it (and the attacker, to echo it)
        for key, envelope, index, gossip, by in (
            (producer_key, honest[0], 0, p_gossip, "p"),
            (producer_key, honest[1], 1, p_gossip, "p"),
            (attacker_key, own, 0, a_gossip, "a"),
        ):
            d = digest[envelope]

            def delivered() -> bool:
                return bool(heard(peer_of[by], d)) and (by == "a" or d in heard_by_attacker)  # noqa: B023

            while not delivered():
                await gossip.publish("rollouts", _announce(key, envelope, index))
                await _sleep_until(delivered, REPEAT_S)
        # ... and the attacker's echoes of each honest batch, both kinds, heard after its producer's last word
        for envelope in honest:
            d = digest[envelope]
            await until(
                lambda d=d: (
                    bool(heard(peer_of["a"], d, attacker_key.node_id))
                    and bool(heard(peer_of["a"], d, producer_key.node_id))
                    and max(heard(peer_of["a"], d)) > max(heard(peer_of["p"], d))
                ),
                "the attacker's echoes to reach the validator",
            )

        # the trainer acknowledges every batch, naming the validator, and waits for its verdicts as it does
        for envelope in [*honest, own]:
            batch = open_signed(envelope, RolloutBatch).message
            waits[digest[envelope]] = VerdictWait([validator_id], (batch.node_id, 0, batch.batch_index))

        def acknowledged(d: str) -> bool:
            """The validator heard the trainer's acknowledgement of ``d`` (its own verdicts share the topic)."""
            return any(
                kind_of(x, LIMITS["verdicts"]) == BatchAck.KIND and open_signed(x, BatchAck).message.batch_sha256 == d
                for x, _ in acks
            )

        def all_judged() -> bool:
            return all(w.done.is_set() for w in waits.values())

        deadline = time.monotonic() + VERDICT_WAIT_S
        while time.monotonic() < deadline and not all_judged():
            for envelope in [*honest, own]:  # acknowledged again until heard (gossip loses an early message)
                if not acknowledged(digest[envelope]):
                    batch = open_signed(envelope, RolloutBatch).message
                    ack = BatchAck(
                        run_id=RUN_ID,
                        node_id=batch.node_id,
                        version=0,
                        batch_index=batch.batch_index,
                        batch_sha256=digest[envelope],
                        judges=[validator_id],
                        issued=time.time(),
                    )
                    await t_gossip.publish("verdicts", seal(RUN_KEY, ack))
            await _sleep_until(all_judged, min(2.0, deadline - time.monotonic()))

        remote = [d for d, w in waits.items() if w.done.is_set()]
        left = 3 - len(remote)
        assert not left, f"{left} of 3 batches left for the trainer to judge itself (attacker asked {stalling.asked}x)"
        assert all(v.ok for w in waits.values() for v, _ in w.verdicts.values())
        assert sorted(judged) == sorted([*honest, own])  # every body judged, exactly the bytes acknowledged
        await until(lambda: stalling.open == 0, "the stalled requests to be given up")  # none left hanging
        fetched = node.metrics.by_label("node_validator_fetches_total")
        assert fetched.get("trainer", 0) + fetched.get("producer", 0) == 3, fetched
        announced = node.metrics.by_label("node_validator_announcements_total")
        assert announced.get("not_producer", 0) >= 2, announced  # the attacker's own claims to the honest batches
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in servers:
            await server.close()
        for g in gossips:
            await g.close()
        for m in reversed(started):
            await m.close()


async def _noop(data: bytes, peer: str) -> None:
    return None


async def _sleep_until(predicate: Callable[[], bool], seconds: float) -> None:
    """At most ``seconds``, less once ``predicate`` holds (a pacing wait between repeats, not a wait for a result)."""
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def test_a_validator_catching_up_gets_every_batch_from_a_server_that_answers_busy(tmp_path: Path) -> None:
    """Thirty acknowledged batches fetched one after another as fast as they come (a validator catching up after
    waiting for a version) from the trainer alone, whose batch server answers RATE requests a second per peer and
    drops the rest: a refused fetch is asked again after a pause, and none is left unjudged (giving up at the first
    refusal left a third of them to the trainer)."""
    asyncio.run(_busy_server(tmp_path))


async def _busy_server(tmp_path: Path) -> None:
    producer = Identity.generate()
    trainer = Membership(RUN_KEY, RUN_ID, Metrics())
    started: list[Membership] = []
    server: BatchServer | None = None
    try:
        maddrs = await trainer.start("127.0.0.1", 0, [])
        started.append(trainer)
        node = ValidatorNode(NodeConfig(data_dir=tmp_path / "v", run_id=RUN_ID, peers=maddrs[:1]))
        await node.membership.start("127.0.0.1", 0, maddrs[:1])
        started.append(node.membership)
        node.p2p = await node.membership.replicate_p2p()
        spec = VerifySpec(verdict_wait_s=VERDICT_WAIT_S)
        node.spec = RunSpec(run_id=RUN_ID, created=time.time(), seed=0, model=ModelSpec(), verify=spec)
        t_p2p = await trainer.replicate_p2p()
        envelopes = [_batch(producer, i) for i in range(30)]
        held = {hashlib.sha256(e).hexdigest(): e for e in envelopes}
        server = BatchServer(t_p2p, RUN_ID, held.get, Metrics())
        await server.start()
        acks = [
            BatchAck(
                run_id=RUN_ID,
                node_id=producer.node_id,
                version=0,
                batch_index=i,
                batch_sha256=d,
                judges=[node.identity.node_id],
                issued=time.time(),
            )
            for i, d in enumerate(held)
        ]
        bodies: list[bytes | Exception] = []
        for ack in acks:  # one after another, as judge_forever takes its jobs, as fast as the server answers
            try:
                bodies.append(await node._fetch(ack, t_p2p.peer_id.to_base58()))
            except Rejected as e:
                bodies.append(e)
        failed = [b for b in bodies if not isinstance(b, bytes)]
        assert not failed, f"{len(failed)} of 30 not fetched: {failed[:2]}"
        assert sorted(bodies) == sorted(envelopes)  # type: ignore[type-var]
        assert node.metrics.counter("node_validator_fetch_retries_total") > 0  # the server did refuse some at first
    finally:
        if server is not None:
            await server.close()
        for m in reversed(started):
            await m.close()
