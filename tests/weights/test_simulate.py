"""The broadcast simulator (benchmarks/sim, as benchmarks/simulate.py runs it) on a small swarm: 200 volunteers, a
quarter of them behind NAT, 10% leaving mid-broadcast and as many joining, a 2 GB checkpoint in four stripes. What
its figures rely on: the project's tree code chose every parent, every node that stays ends with the whole version,
no faster than the bound allows, no node ever took a child past its slots, and every node whose parent left found
another."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.sim import runs, scenario
from benchmarks.sim import swarm as simswarm

pytestmark = pytest.mark.integration

ARGS = argparse.Namespace(
    seed=3,
    dc_share=0.1,
    nat=0.25,
    size_gb=2.0,
    shard_mib=64.0,
    stripes=4,
    origin_gbit=10.0,
    hop_lag_s=0.335,
    dht_lag=3.0,
    tick=0.0,
    no_preempt=False,
    spare_min_fanout=0,
    coarse=False,
    tcp_spread=0.0,
    paced_spread=0.0,
)


class Checked(simswarm.Swarm):
    """The simulator's swarm, watched: every admission within slots, every departed parent's children noted."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.over_slots: list[tuple[int, int, int]] = []
        self.orphaned: set[tuple[int, int]] = set()

    def admit(self, t: simswarm.Node, n: simswarm.Node, s: int) -> tuple[int, list[int]]:
        status, kids = super().admit(t, n, s)
        if status == 200 and len(self.active(t)) > t.slots:
            self.over_slots.append((t.idx, len(self.active(t)), t.slots))
        return status, kids

    def depart(self, n: simswarm.Node) -> None:
        self.orphaned |= {(c, s) for (c, s) in n.children if self.nodes[c].alive and self.nodes[c].parent[s] == n.idx}
        super().depart(n)


def test_a_small_swarm_with_churn_and_nat_gets_the_whole_version_through_the_projects_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: dict[int | None, int] = {}
    real: Callable[..., Any] = simswarm.parents

    def parents(*a: Any, **k: Any) -> Any:
        asked[k.get("stripe")] = asked.get(k.get("stripe"), 0) + 1
        return real(*a, **k)

    monkeypatch.setattr(simswarm, "parents", parents)
    monkeypatch.setattr(runs, "Swarm", Checked)
    sc = scenario.scale_scenario(ARGS, 200, 0.1)
    assert len(sc.leave) == len(sc.joiners) == 20 and sum(not p.reachable for p in sc.peers) > 20
    r = runs.run_ours(sc)
    swarm = r.swarm
    assert isinstance(swarm, Checked)
    net = swarm.net

    assert r.complete and r.stayers == 180
    alive = [n for n in swarm.nodes[1:] if n.alive]
    assert len(alive) == 200
    for n in alive:  # joiners too
        assert (net.got[n.idx] >= net.need).all() and n.done == n.done, n.idx
    assert r.seconds >= r.bound
    assert r.joiner_s > 0

    assert set(asked) == {0, 1, 2, 3} and min(asked.values()) >= 150  # the tree code chose in every stripe
    for n in alive:  # and its choices hold at the end: a living parent in every stripe
        assert all(p >= 0 and swarm.nodes[p].alive for p in n.parent), (n.idx, n.parent)
    assert not any(n.children for n in swarm.nodes[1:] if not n.reachable)  # NAT nodes are never parents
    assert swarm.over_slots == []
    assert all(len(swarm.active(n)) <= n.slots for n in alive)  # nor kept more than its slots once planned down

    assert swarm.orphaned  # parents did leave mid-broadcast, and each child that stayed found another
    for c, s in swarm.orphaned:
        n = swarm.nodes[c]
        if n.alive:
            assert n.parent[s] >= 0 and swarm.nodes[n.parent[s]].alive
    assert swarm.stats.reparents >= len(swarm.orphaned) // 2
