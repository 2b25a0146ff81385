"""The trainer's registry (node/roles/trainer_registry.py) against a flood of unknown signers: the reads they
trigger take at most READ_SHARE of the time however long a read takes (a read of a large ``nodes`` key costs in
proportion to its records), and a new node's first batch still gets one."""

from __future__ import annotations

import asyncio
import time

import pytest

from intellect_node.roles.trainer_registry import READ_SHARE, NodeRegistry
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
