"""The run's task set and reward: the registry of task families, and the entry points every role calls.

``load_task_source(spec)`` builds the run's task set once per node with the family ``spec.family`` names in
``FAMILIES``; ``TaskSource.assigned(...)`` gives the task of one (node, version, batch, slot), re-derived by any
receiver; ``reward(...)`` scores a completion from its text alone. The families (``node/judging/families/``):

- ``arithmetic``: ``a+b=`` for the tiny character-level demo (``intellect_protocol.tasks``).
- ``addition``: "What is 63 + 11? Reply with just the number." for pretrained chat models.
- ``dataset``: rows in INTELLECT-2's shape (math checked with math-verify, code run against test cases, both in
  the jail) from a ``.jsonl``, a ``.parquet`` or ``hf:owner/name``.
- ``reasoning_gym``: a procedural dataset of reasoning-gym by name and config, scored by its own scorer in the jail.
- ``verifiers``: a single-turn taskset of Prime Intellect's verifiers (optional extra), its rewards in the jail.

Adding a family: a module with a ``TaskFamily`` subclass (``families/base.py`` states what it must keep) and one
line in ``FAMILIES``. The run spec accepts any short name; a node refuses a name not registered here when it
loads the task set or checks the jail, saying which names it knows.

Invariants (of every family; see ``families/base.py``):
- Deterministic across processes and machines: every choice is made by SHA-256 of explicit strings.
- Held-out tasks (``held_out``) are never assigned.
- A completion that did not end with end of sequence (``terminated=False``) gets task reward 0 (``arithmetic``
  included: its reward is 0 when not terminated).
- Target length (``length_reward`` != none): the target ``T`` is chosen from ``target_tokens`` by SHA-256 of the
  assignment seed and appended to the prompt as ``" Think for {T} tokens before giving a response."`` (exact;
  INTELLECT-2's wording) or ``" Think for at most {T} tokens before giving a response."`` (max, clip).

Rewards may block: a math check up to ``verifiers.MATH_DEADLINE_S`` in a helper process, a code task up to
``code_timeout_s`` per test case. Call ``reward`` from a worker thread, never on the event loop.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from intellect_node.judging import jail
from intellect_node.judging.families.addition import Addition
from intellect_node.judging.families.arithmetic import Arithmetic
from intellect_node.judging.families.base import (
    Task,
    TaskFamily,
    TaskSet,
    digest64,
    extract_code,
    last_integer,
    length_shaped,
)
from intellect_node.judging.families.dataset import Dataset
from intellect_node.judging.families.reasoning_gym import ReasoningGym
from intellect_node.judging.families.verifiers_env import VerifiersEnv
from intellect_node.judging.verifiers import run_code_tests, verify_math
from intellect_protocol.messages import TaskSpec
from intellect_protocol.tasks import assignment_seed

FAMILIES: dict[str, TaskFamily] = {
    "arithmetic": Arithmetic(),
    "addition": Addition(),
    "dataset": Dataset(),
    "reasoning_gym": ReasoningGym(),
    "verifiers": VerifiersEnv(),
}
"""Task families by the name a run spec's ``task.family`` gives: one line per family."""


def family(spec: TaskSpec) -> TaskFamily:
    """The family of ``spec``; raises ``ValueError`` naming the families this node knows."""
    found = FAMILIES.get(spec.family)
    if found is None:
        raise ValueError(
            f"this run's task family {spec.family!r} is not one this node knows ({', '.join(sorted(FAMILIES))}): "
            "run a version of intellect-node that has it (a family is registered in FAMILIES, "
            "intellect_node.judging.tasks)"
        )
    return found


class TaskSource:
    """The run's task set: ``assigned`` tasks for training, ``held_out_tasks`` for evaluation, disjoint."""

    def __init__(self, spec: TaskSpec, family: TaskFamily, tasks: TaskSet) -> None:
        self.spec = spec
        self.family = family
        self._draw = tasks.draw
        self._size = tasks.size
        self._held_out = [self._with_target(t, digest64(f"held-out-target/{t.id}")) for t in tasks.held_out]

    def __len__(self) -> int:
        """Number of distinct assignable tasks."""
        return self._size

    def assigned(self, run_seed: int, node_id: str, version: int, batch_index: int, slot: int) -> Task:
        seed = assignment_seed(run_seed, node_id, version, batch_index, slot)
        return self._with_target(self._draw(seed), seed)

    def held_out_tasks(self) -> list[Task]:
        return list(self._held_out)

    def exact_reward(self, task: Task) -> bool:
        """Whether a validator recomputes ``task``'s reward in its cheap checks (``TaskFamily.exact_reward``)."""
        return self.family.exact_reward(task)

    def _with_target(self, task: Task, seed: int) -> Task:
        s = self.spec
        if s.length_reward == "none":
            return task
        target = s.target_tokens[digest64(f"target/{seed}") % len(s.target_tokens)]
        bound = "" if s.length_reward == "exact" else "at most "
        return replace(
            task,
            prompt=f"{task.prompt} Think for {bound}{target} tokens before giving a response.",
            target_tokens=target,
        )


_SOURCES: dict[str, TaskSource] = {}
_SOURCES_LOCK = threading.Lock()


def needs_jail(spec: TaskSpec) -> bool:
    """Whether scoring this task set runs untrusted programs or parsers (math-verify, code tests, reasoning-gym's
    scorers, an environment's rewards): ``dataset``, ``reasoning_gym``, ``verifiers``."""
    return family(spec).needs_jail


def require_jail(spec: TaskSpec) -> None:
    """Refuse to start a run whose rewards need the jail where it does not work, saying how to fix it."""
    if needs_jail(spec):
        status = jail.probe()
        if not status.works:
            raise SystemExit(
                f"this run's tasks ({spec.source}) are scored by running untrusted programs and parsers, which "
                f"happens only in a jail, and the jail does not work here ({status.error}): {status.hint}"
            )


def task_source(spec: TaskSpec) -> TaskSource:
    """``load_task_source``, once per distinct spec in this process (a dataset is read and hashed once)."""
    key = spec.model_dump_json()
    with _SOURCES_LOCK:
        if key not in _SOURCES:
            _SOURCES[key] = load_task_source(spec)
        return _SOURCES[key]


def load_task_source(spec: TaskSpec) -> TaskSource:
    """Build the task set of ``spec``; raises ``ValueError`` / ``RuntimeError`` saying how to fix the source."""
    found = family(spec)
    return TaskSource(spec, found, found.load(spec))


# -- rewards --------------------------------------------------------------------------------------------------


def reward(task: Task, completion_text: str, terminated: bool, completion_tokens: int, spec: TaskSpec) -> float:
    """The reward of one completion (its text before end of sequence) by the run's family: ``TaskFamily.reward``.

    ``arithmetic``: ``intellect_protocol.tasks.arithmetic_reward`` unchanged. Otherwise the task reward by the
    task's kind (``TaskFamily.score``: integer, math, code), 0 when not terminated, length shaping applied last.
    May block for seconds (subprocesses): call it off the event loop.
    """
    return family(spec).reward(task, completion_text, terminated, completion_tokens, spec)


__all__ = [
    "FAMILIES",
    "Task",
    "TaskFamily",
    "TaskSet",
    "TaskSource",
    "extract_code",
    "family",
    "last_integer",
    "length_shaped",
    "load_task_source",
    "needs_jail",
    "require_jail",
    "reward",
    "run_code_tests",
    "verify_math",
]
