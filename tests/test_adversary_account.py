"""The red team's cost account (benchmarks/adversary.py ``charge``): what an attack window costs each node beyond
its pace in the attack-free windows around it. The figures in docs/security.md rest on it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # as the script runs: beside harness.py

from adversary import Outcome, charge  # noqa: E402


def window(steps: int, seconds: float, **by_node: float) -> Outcome:
    return Outcome("control", "", False, "", steps=steps, seconds=seconds, by_node=dict(by_node))


def test_a_node_paced_as_before_costs_nothing() -> None:
    calm = window(10, 30.0, trainer=30.0, inference=27.0)
    attack = charge(window(10, 30.0, trainer=30.0, inference=27.0), calm, calm)
    assert attack.by_node == {"trainer": 0.0, "inference": 0.0}
    assert attack.extra_cpu == 0.0


def test_extra_work_is_the_lesser_of_time_and_step_pace() -> None:
    """The trainer slowed to 5 steps (paced per step it would have used 15 CPU-s: 18 extra) but used only 3 CPU-s
    more than its pace in time: 3 is charged; an inference node that generates at its own pace is charged nothing
    for the trainer's slowdown."""
    calm = window(10, 30.0, trainer=30.0, inference=27.0)
    attack = charge(window(5, 30.0, trainer=33.0, inference=27.0), calm, calm)
    assert attack.by_node["trainer"] == 3.0
    assert attack.by_node["inference"] == 0.0
    assert attack.extra_cpu == 3.0


def test_a_node_missing_from_one_window_is_paced_by_the_other() -> None:
    """A node that left (or joined) between the windows: counting it as idle in the window it missed halved its
    pace and charged the attack for half its work."""
    before = window(10, 30.0, trainer=30.0, inference=27.0)
    after = window(10, 30.0, trainer=30.0)
    attack = charge(window(10, 30.0, trainer=30.0, inference=27.0, newcomer=2.0), before, after)
    assert attack.by_node["inference"] == 0.0
    assert attack.by_node["newcomer"] == 2.0  # in neither window: all it used is the attack's
    assert attack.extra_cpu == 2.0


def test_paces_are_sums_over_the_windows_a_node_was_in() -> None:
    """Windows of unequal length: the pace is the node's CPU-s over the windows' seconds (and steps), summed, not
    an average of rates; a node only in the window after is paced by that one alone."""
    before = window(5, 20.0, trainer=20.0)
    after = window(15, 40.0, trainer=50.0, relay=8.0)
    attack = charge(window(12, 30.0, trainer=40.0, relay=9.0), before, after)
    # trainer: 70 CPU-s over 60 s and 20 steps: 35.0 by time, 42.0 by steps; the lesser extra: 40 - 42 = -2.0
    assert attack.by_node["trainer"] == -2.0
    # relay: 8 CPU-s over 40 s and 15 steps: 6.0 by time, 6.4 by steps: 9 - 6.4 = 2.6 extra
    assert abs(attack.by_node["relay"] - 2.6) < 1e-9
    assert abs(attack.extra_cpu - 2.6) < 1e-9


def test_windows_without_steps_pace_by_time_alone() -> None:
    """A stalled swarm around the attack has no pace per step: dividing by one step charged every node nothing."""
    calm = window(0, 30.0, trainer=6.0)
    attack = charge(window(3, 30.0, trainer=9.0), calm, calm)
    assert attack.by_node["trainer"] == 3.0


def test_savings_do_not_offset_costs() -> None:
    calm = window(10, 30.0, trainer=30.0, inference=27.0)
    attack = charge(window(10, 30.0, trainer=34.0, inference=20.0), calm, calm)
    assert attack.extra_cpu == 4.0
