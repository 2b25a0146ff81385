"""The rollout transport seam (node/p2p/rollouts), shown by adding nothing but a transport: an in-memory sink and
source, registered with one line, carry a real sealed batch from the producer's calls (``offer``, ``push``) to the
trainer's door callback and the door's reply back, signed by the run key, through the same calls the roles make
(``make_sink``/``make_source`` with an ``Endpoint``, ``start``, ``Receiver``). The libp2p transport is exercised
for real by the swarm tests (tests/roles/test_swarm.py, test_gossip_swarm.py, test_hostile_announcers.py)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from functools import partial

import pytest

from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.rollouts import (
    TRANSPORTS,
    Endpoint,
    Receiver,
    RolloutSink,
    RolloutSource,
    Transport,
    make_sink,
    make_source,
)
from intellect_node.p2p.transport import Intake
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RolloutBatch, RolloutGroup, SubmitReply

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id


class Wire:
    """What the in-memory transport's ends share: the run's source, and the batches producers offered."""

    def __init__(self) -> None:
        self.sources: dict[str, MemorySource] = {}
        self.offered: dict[str, bytes] = {}


class MemorySource(RolloutSource):
    def __init__(self, wire: Wire, endpoint: Endpoint) -> None:
        self.wire, self.endpoint = wire, endpoint
        self.receiver: Receiver | None = None

    async def start(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.wire.sources[self.endpoint.run_id] = self

    async def close(self) -> None:
        self.wire.sources.pop(self.endpoint.run_id, None)

    async def _door(self, data: bytes, peer: str) -> SubmitReply:
        """The receiving side's rules, as any transport keeps them: the channel's size limit and a place in the
        intake before the body goes through the door."""
        assert self.receiver is not None
        if len(data) > Channel.ROLLOUT_BATCH.value:
            return self.receiver.reject(Rejected("oversized", f"{len(data)} bytes"), peer)
        if not self.receiver.intake.take(peer):
            return self.receiver.reject(Rejected("busy", "too many bodies on their way"), peer)
        try:
            return await self.receiver.on_batch(data, peer)
        finally:
            self.receiver.intake.give_back(peer)

    async def deliver(self, data: bytes, peer: str) -> bytes:
        """A push: the door's reply, signed by the run key."""
        return seal(self.endpoint.identity, await self._door(data, peer))

    async def pull(self, peer: str, digest: str, size: int) -> str:
        body = self.wire.offered.get(digest)
        if body is None or len(body) > size:
            return "missing"
        reply = await self._door(body, peer)
        return "ok" if reply.ok else reply.reason


class MemorySink(RolloutSink):
    def __init__(self, wire: Wire, endpoint: Endpoint) -> None:
        self.wire, self.endpoint = wire, endpoint

    async def offer(self, batch: RolloutBatch, data: bytes) -> bool:
        self.wire.offered[hashlib.sha256(data).hexdigest()] = data
        return True

    async def push(self, trainer: NodeRecord, data: bytes) -> SubmitReply:
        source = self.wire.sources.get(self.endpoint.run_id)
        if source is None:
            raise ConnectionError("no trainer listening")
        signed = open_signed(await source.deliver(data, self.endpoint.identity.node_id), SubmitReply)
        if signed.signer_id != self.endpoint.run_id:
            raise Rejected("foreign_reply", f"reply signed by {signed.signer_id}")
        return signed.message


class Door:
    """A door callback: opens the envelope, refuses a batch it has seen, and says how many groups it holds."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}
        self.refused: list[str] = []

    async def on_batch(self, data: bytes, peer: str) -> SubmitReply:
        signed = open_signed(data, RolloutBatch)
        if signed.signer_id != signed.message.node_id or peer != signed.message.node_id:
            return SubmitReply(ok=False, reason="signer_mismatch")
        digest = hashlib.sha256(data).hexdigest()
        if digest in self.seen:
            return SubmitReply(ok=False, reason="duplicate", next_index=signed.message.batch_index + 1)
        self.seen[digest] = peer
        groups = len(signed.message.groups)
        return SubmitReply(ok=True, accepted_groups=groups, backlog=groups * len(self.seen))

    def reject(self, e: Rejected, peer: str) -> SubmitReply:
        self.refused.append(e.reason)
        return SubmitReply(ok=False, reason=e.reason, detail=e.detail)


def _sealed(producer: Identity, index: int = 0) -> tuple[RolloutBatch, bytes]:
    group = RolloutGroup(slot=0, prompt_ids=[1, 2, 3], completions=[[4, 5], [6]], logprobs=[[-0.5, -0.25], [-1.0]])
    batch = RolloutBatch(run_id=RUN, node_id=producer.node_id, version=0, batch_index=index, groups=[group, group])
    return batch, seal(producer, batch)


def _ends(
    monkeypatch: pytest.MonkeyPatch, producer: Identity, intake: Intake
) -> tuple[RolloutSink, RolloutSource, Door, Receiver]:
    wire = Wire()
    monkeypatch.setitem(TRANSPORTS, "memory", Transport(partial(MemorySink, wire), partial(MemorySource, wire)))
    sink = make_sink(Endpoint(None, producer, RUN, Metrics()), "memory")
    source = make_source(Endpoint(None, RUN_KEY, RUN, Metrics()), "memory")
    door = Door()
    return sink, source, door, Receiver(door.on_batch, door.reject, intake)


def test_a_sealed_batch_goes_from_the_producer_to_the_door_and_the_reply_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    producer = Identity.generate()
    sink, source, door, receiver = _ends(monkeypatch, producer, Intake())
    trainer = NodeRecord(run_id=RUN, node_id=RUN, role="trainer", updated=time.time())
    batch, data = _sealed(producer)

    async def scenario() -> None:
        acks: list[str] = []
        await source.start(receiver)
        await sink.start(acks.append)
        assert await sink.offer(batch, data)
        reply = await sink.push(trainer, data)
        assert reply.ok and reply.accepted_groups == 2 and reply.backlog == 2
        assert door.seen == {hashlib.sha256(data).hexdigest(): producer.node_id}  # the exact envelope, its producer
        again = await sink.push(trainer, data)  # a refusal comes back as the door wrote it
        assert (again.ok, again.reason, again.next_index) == (False, "duplicate", 1)
        _, second = _sealed(producer, index=1)  # offered, never pushed: the trainer pulls it through the same door
        assert await sink.offer(batch, second)
        assert await source.pull(producer.node_id, hashlib.sha256(second).hexdigest(), len(second)) == "ok"
        assert await source.pull(producer.node_id, "0" * 64, 1024) == "missing"
        assert len(door.seen) == 2 and not acks
        await source.close()
        await sink.close()
        with pytest.raises(ConnectionError):  # nobody listening: the producer keeps the batch and sends it again
            await sink.push(trainer, data)

    asyncio.run(scenario())


def test_the_source_keeps_the_intake_budget_and_refuses_before_the_door(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = Identity.generate()
    intake = Intake(total=1, per_peer=1)
    sink, source, door, receiver = _ends(monkeypatch, producer, intake)
    trainer = NodeRecord(run_id=RUN, node_id=RUN, role="trainer", updated=time.time())
    _, data = _sealed(producer)

    async def scenario() -> None:
        await source.start(receiver)
        assert intake.take("someone pulling")  # the one place taken by another body on its way in
        reply = await sink.push(trainer, data)
        assert (reply.ok, reply.reason) == (False, "busy") and door.refused == ["busy"] and not door.seen
        intake.give_back("someone pulling")
        assert (await sink.push(trainer, data)).ok and len(intake) == 0

    asyncio.run(scenario())


def test_a_transport_is_found_by_name_and_an_unknown_name_says_which_exist() -> None:
    assert set(TRANSPORTS) >= {"libp2p"}
    with pytest.raises(ValueError, match="libp2p"):
        make_sink(Endpoint(None, RUN_KEY, RUN, Metrics()), "carrier-pigeon")
