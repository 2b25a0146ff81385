"""The trainer's registry (node/roles/trainer_registry.py) against a flood of unknown signers: the reads they
trigger take at most READ_SHARE of the time however long a read takes (a read of a large ``nodes`` key costs in
proportion to its records), and a new node's first batch still gets one."""

from __future__ import annotations

import asyncio
import time

import pytest

from intellect_node.roles.trainer_registry import MAX_SHARING, PATIENT_REFRESH_S, READ_SHARE, NodeRegistry
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord

RUN = Identity.generate().node_id


class _SlowDHT:
    """A ``nodes`` key whose every read takes ``cost`` seconds and holds ``records``."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.reads = 0
        self.records: dict[str, NodeRecord] = {}

    async def get_nodes(self) -> dict[str, NodeRecord]:
        self.reads += 1
        await asyncio.sleep(self.cost)
        return dict(self.records)


@pytest.mark.integration  # waits seconds by design: reads that take time, spaced by it
def test_a_flood_of_unknown_signers_spends_at_most_the_read_share_on_reads() -> None:
    dht = _SlowDHT(cost=0.05)
    registry = NodeRegistry(dht)  # type: ignore[arg-type]
    newcomer = Identity.generate().node_id

    async def flood(seconds: float) -> NodeRecord | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:  # a stranger's key each time, as fast as the registry answers
            await asyncio.gather(*(registry.registered(Identity.generate().node_id) for _ in range(4)))
            await asyncio.sleep(0.01)
        dht.records[newcomer] = NodeRecord(run_id=RUN, node_id=newcomer, role="inference", updated=time.time())
        return await registry.registered(newcomer)

    started = time.monotonic()
    found = asyncio.run(flood(2.0))
    elapsed = time.monotonic() - started
    assert dht.reads * dht.cost <= READ_SHARE * elapsed + 2 * dht.cost, (dht.reads, elapsed)
    assert found is not None, "a new node's first batch got no read"


def test_strangers_slot_requests_buy_one_read_per_patient_interval() -> None:
    """Relay slot and audit requests from unknown keys (each a fresh key: the red team's made-up ids) trigger a read
    only once PATIENT_REFRESH_S passed since the last, whoever asks; a registered relay is found once it has."""
    dht = _SlowDHT(cost=0.0)
    registry = NodeRegistry(dht)  # type: ignore[arg-type]
    relay = Identity.generate().node_id

    async def flood() -> tuple[int, NodeRecord | None, NodeRecord | None]:
        for _ in range(200):
            assert await registry.registered(Identity.generate().node_id, patient=True) is None
        reads = dht.reads
        dht.records[relay] = NodeRecord(run_id=RUN, node_id=relay, role="relay", updated=time.time())
        too_soon = await registry.registered(relay, patient=True)
        registry._read_at -= PATIENT_REFRESH_S  # the interval passed
        registry._lookup_at.clear()
        return reads, too_soon, await registry.registered(relay, patient=True)

    reads, too_soon, found = asyncio.run(flood())
    assert reads == 1, f"200 strangers' slot requests bought {reads} reads"
    assert too_soon is None and found is not None and dht.reads == 2


def test_strangers_slot_requests_wait_while_a_read_is_under_way() -> None:
    """While a read is under way (a stranger's batch bought it, or a slow ``nodes`` key), patient requests from
    unknown keys are answered at once instead of queueing for reads of their own."""
    dht = _SlowDHT(cost=0.3)
    registry = NodeRegistry(dht)  # type: ignore[arg-type]

    async def flood() -> list[NodeRecord | None]:
        reading = asyncio.ensure_future(registry.registered(Identity.generate().node_id))  # a batch's lookup
        while not registry._lock.locked():  # until its read is under way
            await asyncio.sleep(0)
        registry._read_at -= PATIENT_REFRESH_S  # as if the last read were long ago: only the lock holds them
        strangers = [registry.registered(Identity.generate().node_id, patient=True) for _ in range(50)]
        answers = await asyncio.gather(*strangers)
        await reading
        return answers

    answers = asyncio.run(flood())
    assert answers == [None] * 50 and dht.reads == 1, f"50 strangers' slot requests queued {dht.reads - 1} reads"


def test_a_producers_announcement_and_push_of_one_batch_share_one_lookup_and_both_find_it() -> None:
    """A new producer announces its first batch on gossip and pushes it at once: the second request came while the
    first's lookup was under way and was refused as an unknown signer (fresh-clone CI's bf16 swarm). Both wait for
    the one lookup and find the record."""
    dht = _SlowDHT(cost=0.2)
    registry = NodeRegistry(dht)  # type: ignore[arg-type]
    producer = Identity.generate().node_id
    dht.records[producer] = NodeRecord(run_id=RUN, node_id=producer, role="inference", updated=time.time())

    async def both() -> list[NodeRecord | None]:
        return list(await asyncio.gather(registry.registered(producer), registry.registered(producer)))

    announced, pushed = asyncio.run(both())
    assert announced is not None and pushed is not None
    assert dht.reads == 1 and registry._pending == {}


def test_a_keys_requests_beyond_a_few_do_not_wait_for_its_lookup_and_patient_ones_never_do() -> None:
    """Each request waiting for a lookup holds one of the trainer's stream slots: one unregistered key pushing 16
    signed batches at once must not hold them all through a slow read. Two more wait with the first; the rest, and
    a relay slot or audit request (it asks again), are answered at once."""
    dht = _SlowDHT(cost=0.3)
    registry = NodeRegistry(dht)  # type: ignore[arg-type]
    key = Identity.generate().node_id
    dht.records[key] = NodeRecord(run_id=RUN, node_id=key, role="inference", updated=time.time())

    async def many() -> tuple[list[NodeRecord | None], NodeRecord | None]:
        first = asyncio.ensure_future(registry.registered(key))
        await asyncio.sleep(0)  # its lookup is under way
        patient = await registry.registered(key, patient=True)
        rest = await asyncio.gather(*(registry.registered(key) for _ in range(15)))
        return [await first, *rest], patient

    answers, patient = asyncio.run(many())
    assert patient is None
    assert sum(a is not None for a in answers) == 1 + MAX_SHARING and dht.reads == 1
    assert registry._sharing == {} and registry._pending == {}
