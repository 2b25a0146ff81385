"""Per-node counts that a flood of new keys cannot grow without bound (the trainer's /status, its backlog)."""

from __future__ import annotations

from intellect_node.p2p.metrics import BoundedCounter


def test_a_flood_of_refused_keys_leaves_a_bounded_table_and_keeps_the_busiest() -> None:
    refused = BoundedCounter(limit=100)
    for _ in range(50):
        refused["honest"] += 1
    for i in range(10_000):  # every stranger refused once
        refused[f"sybil-{i}"] += 1
    assert len(refused) == 100
    assert refused["honest"] == 50  # the busiest stay; the smallest counts were folded away
    assert refused.others + sum(refused.values()) == 10_050


def test_a_count_that_falls_to_zero_leaves() -> None:
    pending = BoundedCounter()
    for i in range(1000):
        pending[f"node-{i}"] += 2
        pending[f"node-{i}"] -= 2
    assert len(pending) == 0 and pending["node-1"] == 0
