"""The task family interface: what a family of tasks must say so that every node derives and scores it alike.

A ``TaskFamily`` builds the run's task set from its ``TaskSpec`` (``load``: the task of an assignment seed, how many
there are, the held-out ones) and scores a completion (``score``: the task reward of a completion that ended with
end of sequence; ``reward``: the whole reward, termination and target-length shaping included). Families are
registered by name in ``FAMILIES`` (``node/judging/tasks.py``); the run spec's ``task.family`` names one.

Invariants every family keeps (every node must agree on them):
- ``load`` and ``TaskSet.draw`` are deterministic across processes and machines: choices come from SHA-256 of
  explicit strings (``digest64``) over lists in a fixed order, never Python ``hash()`` or set order.
- ``draw`` never returns a held-out task.
- ``score`` and ``reward`` read only the task and the completion (never what a worker reported), and may block
  (a checker in the jail): they run off the event loop. A family whose scoring runs untrusted programs or
  parsers sets ``needs_jail``, so a node refuses to start where the jail does not work.

The built-in answer checkers live here, keyed by ``Task.kind``: ``integer`` (``last_integer``), ``math``
(math-verify) and ``code`` (stdin/stdout test cases), both of the latter in the jail (``verifiers.py``).
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from intellect_node.judging.verifiers import run_code_tests, verify_math
from intellect_protocol.messages import TaskSpec

TaskKind = str
"""How ``TaskFamily.score`` checks an answer: ``integer``, ``math`` or ``code`` for the built-in checkers; a family
that overrides ``score`` may name its own."""
MAX_INTEGER_DIGITS = 100
_INTEGER = re.compile(r"(?<![0-9.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?![0-9])")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Task:
    """One problem as a node sees it. ``prompt`` already carries the target length when there is one."""

    prompt: str
    kind: TaskKind
    answer: str = ""
    """integer: the decimal answer; math: the ground truth (LaTeX or plain)."""
    tests: tuple[tuple[str, str], ...] = ()
    """code: (stdin, expected stdout) cases."""
    target_tokens: int | None = None
    pass_rate: float | None = None
    id: str = ""


@dataclass(frozen=True)
class TaskSet:
    """A family's task set for one spec: ``draw(seed)`` is the task of an assignment seed (``size`` distinct ones,
    none of them held out); ``held_out`` the tasks kept for evaluation, in a fixed order."""

    draw: Callable[[int], Task]
    size: int
    held_out: list[Task] = field(default_factory=list)


class TaskFamily(ABC):
    """A kind of task set and its reward. Subclass it, implement ``load`` (and ``score`` for an answer that is
    not one of the built-in kinds), and add one line to ``FAMILIES`` in ``node/judging/tasks.py``."""

    needs_jail: ClassVar[bool] = False
    """Whether scoring runs untrusted programs or parsers: a node then refuses to start without a working jail."""

    @abstractmethod
    def load(self, spec: TaskSpec) -> TaskSet:
        """The task set of ``spec``; raises ``ValueError`` / ``RuntimeError`` saying how to fix the spec or source.
        Called once per spec and process (``tasks.task_source`` caches it)."""

    def score(self, task: Task, text: str, spec: TaskSpec) -> float:
        """The task reward of a completion that ended with end of sequence (``text``: before it).

        integer: 1.0 when ``last_integer(text)`` equals the answer, else 0.0. math: 1.0 when math-verify finds the
        answer equivalent to the ground truth, else 0.0. code: the fraction of test cases whose stdout matches (see
        ``run_code_tests``). May block for seconds (subprocesses)."""
        if task.kind == "integer":
            got = last_integer(text)
            return 1.0 if got is not None and got == int(task.answer) else 0.0
        if task.kind == "math":
            return 1.0 if verify_math(task.answer, text) else 0.0
        if task.kind == "code":
            return run_code_tests(extract_code(text), task.tests, spec.code_timeout_s, spec.code_memory_mb)
        raise ValueError(f"no built-in checker for task kind {task.kind!r}: its family must override score")

    def reward(self, task: Task, text: str, terminated: bool, completion_tokens: int, spec: TaskSpec) -> float:
        """The reward of one completion: ``score`` when it ended with end of sequence, else 0 (a cut-off answer is
        not an answer), then target-length shaping (``length_shaped``)."""
        r = self.score(task, text, spec) if terminated else 0.0
        return length_shaped(r, completion_tokens, task.target_tokens, spec.length_reward, spec.length_coef)

    def exact_reward(self, task: Task) -> bool:
        """Whether ``task``'s reward is exact and cheap, so that a validator recomputes it in its cheap checks and
        refuses a batch whose reported reward differs. Not for checks that run under time limits (code may score
        differently on a slower machine) or that are costly."""
        return task.kind == "integer"


def digest64(text: str) -> int:
    """The first 8 bytes of SHA-256 of ``text``, little-endian: every deterministic choice of a task set."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def indexed_task_set(task: Callable[[int], Task], size: int, held_out: int, label: str) -> TaskSet:
    """The task set of ``size`` problems numbered ``0 .. size - 1`` (``task(i)``): exactly ``held_out`` distinct
    ones, drawn by SHA-256 of ``held-out/<label>/<k>``, kept for evaluation; an assignment seed picks
    ``seed % size``, re-drawn by SHA-256 away from a held-out one. ``held_out`` must be at most half of ``size``
    (so the draws end quickly)."""
    held: dict[int, None] = {}  # insertion-ordered: the held-out problems in draw order
    k = 0
    while len(held) < held_out:
        held.setdefault(digest64(f"held-out/{label}/{k}") % size)
        k += 1

    def draw(seed: int) -> Task:
        index, attempt = seed % size, 0
        while index in held:
            index, attempt = digest64(f"redraw/{seed}/{attempt}") % size, attempt + 1
        return task(index)

    return TaskSet(draw, size - len(held), [task(i) for i in held])


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (``-12``, ``1,234``), or None.

    Chosen for instruction-tuned models that answer "74", "74.", "The answer is 74." or "63 + 11 = 74": all
    read as 74. Strict in that only the last number counts ("74, or maybe 75" is 75) and a decimal ("74.5")
    is not an integer. The same reading is used for evaluation before and after training.
    """
    found = None
    for m in _INTEGER.finditer(text):
        if text[m.end() : m.end() + 2].startswith(".") and text[m.end() + 1 : m.end() + 2].isdigit():
            continue  # "74.5": a decimal, not an integer
        found = m.group()
    if found is None:
        return None
    digits = found.replace(",", "")
    if len(digits) > MAX_INTEGER_DIGITS:  # no answer is that long; int() of 5,000 digits raises ValueError
        return None
    return int(digits)


def extract_code(text: str) -> str:
    """The last ```` ```python ```` (or ``py``, ``python3``) fenced block of ``text``; the whole text if none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def length_shaped(r: float, length: int, target: int | None, mode: str, coef: float) -> float:
    """Target-length shaping of task reward ``r`` for a completion of ``length`` tokens, target ``target``.

    - none: ``r``.
    - exact (L1's LCPO-Exact): ``r - coef * |length - target|``.
    - max (L1's LCPO-Max): ``r * clip(coef * (target - length) + 0.5, 0, 1)``: full reward well under the
      budget, half at the budget, none ``0.5 / coef`` tokens past it.
    - clip: ``r`` when ``length <= target``, else 0.
    """
    if mode == "none" or target is None:
        return r
    if mode == "exact":
        return r - coef * abs(length - target)
    if mode == "max":
        return r * min(1.0, max(0.0, coef * (target - length) + 0.5))
    if mode == "clip":
        return r if length <= target else 0.0
    raise ValueError(f"unknown length_reward {mode!r}")
