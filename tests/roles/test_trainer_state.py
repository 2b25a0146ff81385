"""What the trainer's parts share (node/roles/trainer_state.py): the training queue gives the oldest fresh groups
first and hands back what went stale, a ban empties a producer's share, counts in flight leave nothing behind, and
a batch replayed after a restart is not counted twice in the reward curve, and an acknowledged batch none of whose
groups was trained is handed to the next ledger entry with the reason its last group went."""

from __future__ import annotations

from intellect_node.policy.engine import Group
from intellect_node.roles.trainer_state import InFlight, Ledger, RewardCurve, TrainQueue


def _group(node: str, version: int, index: int = 0, rewards: tuple[float, ...] = (0.0, 1.0)) -> Group:
    return Group(node, version, [1], [[2]] * len(rewards), [[-1.0]] * len(rewards), list(rewards), index, 0)


def test_the_queue_takes_the_oldest_fresh_groups_and_returns_the_stale() -> None:
    q = TrainQueue()
    q.add("a", [_group("a", 5), _group("a", 3)])
    q.add("b", [_group("b", 4), _group("b", 1)])
    assert q.changed.is_set() and q.by_node == {"a": 2, "b": 2} and q.fresh(3) == 3
    batch, stale = q.take(2, floor=3)
    assert [g.version for g in stale] == [1]
    assert batch is not None and [g.version for g in batch] == [3, 4]
    assert [g.version for g in q.groups] == [5] and q.by_node == {"a": 1}
    batch, stale = q.take(2, floor=3)
    assert batch is None and not stale and len(q) == 1, "fewer than a batch: nothing taken, nothing lost"


def test_a_ban_drops_every_queued_group_of_its_producer() -> None:
    q = TrainQueue()
    q.add("cheat", [_group("cheat", 1), _group("cheat", 2)])
    q.add("honest", [_group("honest", 1)])
    assert [g.version for g in q.drop_node("cheat")] == [1, 2]
    assert [g.node_id for g in q.groups] == ["honest"] and "cheat" not in q.by_node


def test_counts_in_flight_leave_nothing_behind() -> None:
    f = InFlight()
    f.add(("a", 0, 0), 4)
    f.add(("a", 0, 1), 4)
    f.add(("b", 0, 0), 2)
    assert len(f) == 3 and f.of("a") == 2 and f.count(lambda n: n == "b") == 1 and f.groups() == 10
    for key, groups in ((("a", 0, 0), 4), (("a", 0, 1), 4), (("b", 0, 0), 2)):
        f.done(key, groups)
    assert len(f) == 0 and dict(f.groups_by_node) == {}, "a flood of keys must leave no per-node entries"


def test_a_replayed_batch_is_not_counted_twice_in_the_reward_curve() -> None:
    curve = RewardCurve([0.5])
    curve.replayed(("a", 0, 0))  # its rewards were in the curve the checkpoint saved
    curve.accepted(("a", 0, 0), [_group("a", 0)])
    curve.accepted(("b", 0, 0), [_group("b", 0, rewards=(1.0, 1.0))])
    assert curve.drain() == [0.5, 1.0, 1.0] and curve.drain() == []
    curve.accepted(("a", 0, 0), [_group("a", 0)])  # accepted again later (not a replay): counted
    assert curve.drain() == [0.0, 1.0]


def test_an_acknowledged_batch_dropped_untrained_goes_to_the_ledger_with_why() -> None:
    ledger = Ledger(epoch=1, step=lambda: 3)
    ledger("acked", ("a", 2, 0), 3, "d" * 64)
    ledger("acked", ("b", 2, 0), 2, "e" * 64)
    ledger("stale", ("a", 2, 0), 2)
    assert ledger.drain_dropped() == [], "a group of it is still undecided"
    ledger("invalid", ("a", 2, 0), 1)
    ledger("trained", ("b", 2, 0), 1)
    ledger("stale", ("b", 2, 0), 1)  # one of its groups was trained: credited, not dropped
    ledger("stale", ("c", 1, 0), 4)  # accepted before a restart and not followed: nothing to say
    assert ledger.drain_dropped() == [("a", "d" * 64, "invalid")]
    assert ledger.drain_dropped() == [] and not ledger.open
    ledger.follow(("r", 1, 5), 2, "f" * 64)  # replayed whole after a restart
    ledger("stale", ("r", 1, 5), 2)
    assert ledger.drain_dropped() == [("r", "f" * 64, "stale")]
