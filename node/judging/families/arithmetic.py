"""``arithmetic``: ``a+b=`` for the tiny character-level demo, exactly as ``intellect_protocol.tasks``.

Operands in ``[0, max_operand]``; the reward is ``intellect_protocol.tasks.arithmetic_reward`` unchanged (1.0 for
the exact integer followed by end of sequence, 0.2 for a well-formed wrong one, else 0), with no length shaping:
the run spec refuses a target length for this family. It trains on its whole table: no held-out set.
"""

from __future__ import annotations

from intellect_node.judging.families.base import Task, TaskFamily, TaskSet
from intellect_protocol.messages import TaskSpec
from intellect_protocol.tasks import arithmetic_reward, arithmetic_task


class Arithmetic(TaskFamily):
    def load(self, spec: TaskSpec) -> TaskSet:
        return TaskSet(lambda seed: _task(seed, spec.max_operand), (spec.max_operand + 1) ** 2)

    def reward(self, task: Task, text: str, terminated: bool, completion_tokens: int, spec: TaskSpec) -> float:
        return arithmetic_reward(text, task.answer, terminated)


def _task(seed: int, max_operand: int) -> Task:
    t = arithmetic_task(seed, max_operand)
    return Task(prompt=t.prompt, kind="integer", answer=t.answer, id=f"arithmetic/{t.prompt}")
