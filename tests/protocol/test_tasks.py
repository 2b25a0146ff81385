"""Task assignment is deterministic and per node; rewards come from the completion text alone."""

from __future__ import annotations

from intellect_protocol.tasks import arithmetic_reward, assigned_task, assignment_seed


def test_assignment_is_deterministic_and_depends_on_every_input() -> None:
    base = assignment_seed(1, "a" * 32, 3, 0, 0)
    assert base == assignment_seed(1, "a" * 32, 3, 0, 0)
    variants = [
        assignment_seed(2, "a" * 32, 3, 0, 0),
        assignment_seed(1, "b" * 32, 3, 0, 0),
        assignment_seed(1, "a" * 32, 4, 0, 0),
        assignment_seed(1, "a" * 32, 3, 1, 0),
        assignment_seed(1, "a" * 32, 3, 0, 1),
    ]
    assert base not in variants and len(set(variants)) == len(variants)


def test_assigned_task_is_well_formed() -> None:
    for slot in range(50):
        task = assigned_task(0, "c" * 32, 0, 0, slot, max_operand=20)
        a, b = task.prompt.rstrip("=").split("+")
        assert 0 <= int(a) <= 20 and 0 <= int(b) <= 20
        assert task.prompt.endswith("=") and int(task.answer) == int(a) + int(b)


def test_reward() -> None:
    assert arithmetic_reward("19", "19", terminated=True) == 1.0
    assert arithmetic_reward("019", "19", terminated=True) == 1.0
    assert arithmetic_reward("18", "19", terminated=True) == 0.2
    assert arithmetic_reward("19", "19", terminated=False) == 0.0  # cut off: no end of sequence
    assert arithmetic_reward("19+", "19", terminated=True) == 0.0
    assert arithmetic_reward("", "19", terminated=True) == 0.0
