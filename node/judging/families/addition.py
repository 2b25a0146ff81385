"""``addition``: "What is 63 + 11? Reply with just the number." for pretrained chat models.

Operands have ``digits`` digits. A completion is right when the last integer in its text equals the sum (the
``integer`` checker, ``base.last_integer``). Exactly ``held_out`` distinct problems, drawn by SHA-256, are kept for
evaluation; an assignment that lands on one is re-drawn away from it.
"""

from __future__ import annotations

from intellect_node.judging.families.base import Task, TaskFamily, TaskSet, indexed_task_set
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

        # TaskSpec bounds held_out to half the problems
        return indexed_task_set(task, problems, spec.held_out, f"addition/{spec.digits}")
