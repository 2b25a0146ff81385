"""``addition``: "What is 63 + 11? Reply with just the number." for pretrained chat models.

Operands have ``digits`` digits. A completion is right when the last integer in its text equals the sum (the
``integer`` checker, ``base.last_integer``). Exactly ``held_out`` distinct problems, drawn by SHA-256, are kept for
evaluation; an assignment that lands on one is re-drawn away from it.
"""

from __future__ import annotations

from intellect_node.judging.families.base import Task, TaskFamily, TaskSet, digest64
from intellect_protocol.messages import TaskSpec


class Addition(TaskFamily):
    def load(self, spec: TaskSpec) -> TaskSet:
        lo, span = 10 ** (spec.digits - 1), 9 * 10 ** (spec.digits - 1)
        problems = span * span

        def task(index: int) -> Task:
            a, b = lo + index % span, lo + index // span
            return Task(
                prompt=f"What is {a} + {b}? Reply with just the number.",
                kind="integer",
                answer=str(a + b),
                id=f"addition/{a}+{b}",
            )

        held: dict[int, None] = {}  # insertion-ordered: the held-out problems in draw order
        k = 0
        while len(held) < spec.held_out:  # TaskSpec bounds held_out to half the problems: this ends quickly
            held.setdefault(digest64(f"held-out/addition/{spec.digits}/{k}") % problems)
            k += 1

        def draw(seed: int) -> Task:
            index, attempt = seed % problems, 0
            while index in held:
                index, attempt = digest64(f"redraw/{seed}/{attempt}") % problems, attempt + 1
            return task(index)

        return TaskSet(draw, problems - len(held), [task(i) for i in held])
