"""The trainer's queue of batches awaiting a verdict prefers the version its validator holds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from intellect_node.roles import trainer_validation
from intellect_node.roles.trainer_validation import PendingBatches
from intellect_protocol.messages import RolloutBatch, RolloutGroup


def _batch(version: int, index: int) -> RolloutBatch:
    group = RolloutGroup(slot=0, prompt_ids=[1], completions=[[2]], logprobs=[[-0.1]], proofs=[[]])
    return RolloutBatch(run_id="a" * 32, node_id="b" * 32, version=version, batch_index=index, groups=[group])


def test_a_producer_alternating_versions_costs_one_reload_per_version_not_per_batch() -> None:
    async def main() -> list[int]:
        pending = PendingBatches()
        for i in range(6):
            pending.put_nowait((_batch(i % 2, i), [], b""))
        loaded, order = -1, []
        while pending.qsize():
            batch, _, _ = await pending.get(prefer=loaded)
            loaded = batch.version
            order.append(batch.version)
        waiter = asyncio.ensure_future(pending.get())
        await asyncio.sleep(0)
        pending.put_nowait((_batch(7, 0), [], b""))
        order.append((await waiter)[0].version)
        return order

    assert asyncio.run(main()) == [0, 0, 0, 1, 1, 1, 7]


def test_a_batch_of_another_version_is_not_passed_over_for_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady flow of the validator's version once kept a flooder's first batch pending for a whole attack: its
    key was answered 'busy', not banned, and every submission cost a signature check."""
    clock = [1000.0]  # the queue's clock, moved by hand
    monkeypatch.setattr(trainer_validation, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def main() -> list[int]:
        pending = PendingBatches()
        pending.put_nowait((_batch(9, 0), [], b""))  # the odd one out, first in
        order = []
        for i in range(40):
            pending.put_nowait((_batch(3, i), [], b""))  # the honest flow, of the version the validator holds
            batch, _, _ = await pending.get(prefer=3)
            order.append(batch.version)
            if batch.version == 9:
                break
            clock[0] += trainer_validation.MAX_DEFER_S / 10
        return order

    order = asyncio.run(main())
    assert order[-1] == 9 and order[0] == 3  # preferred at first, taken once it had waited MAX_DEFER_S
