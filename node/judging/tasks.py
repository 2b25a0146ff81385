"""Task sets and verifiable rewards: what a node is asked to solve, and how a completion is scored.

``load_task_source(spec)`` builds the run's task set once per node; ``TaskSource.assigned(...)`` gives the
task of one (node, version, batch, slot), re-derived by any receiver; ``reward(...)`` scores a completion from
its text alone. Families (``TaskSpec.family``):

- ``arithmetic``: ``a+b=`` for the tiny character-level demo, exactly as ``intellect_protocol.tasks`` (its reward
  gives 0.2 for a well-formed wrong integer). It trains on its whole table: no held-out set, no target length.
- ``addition``: "What is 63 + 11? Reply with just the number." with ``digits``-digit operands, for pretrained
  chat models. A completion is right when the last integer in its text equals the sum (see ``last_integer``).
- ``dataset``: rows in INTELLECT-2's shape (``prompt``, ``task_type``, ``verification_info``, a pass-rate
  column) from a ``.jsonl``, a ``.parquet`` (``pip install 'intellect-node[data]'``) or ``hf:owner/name``.
  ``verifiable_math`` rows are checked with math-verify against ``ground_truth``; ``verifiable_code`` rows run
  the last ```` ```python ```` block against stdin/stdout ``test_cases`` in a sandbox; the reward is the
  fraction of cases passed. Both checkers live in ``verifiers.py``.

Invariants:
- Deterministic across processes and machines: every choice is made by SHA-256 of explicit strings, over lists
  in file order; never Python ``hash()`` or set order.
- Held-out tasks (``held_out``) are never assigned: for ``addition`` a SHA-256-drawn set of exactly ``held_out``
  distinct problems, re-drawn away from on assignment; for ``dataset`` the ``held_out`` rows (after dedup by id
  and the pass-rate filter) whose id hashes lowest.
- A completion that did not end with end of sequence (``terminated=False``) gets task reward 0.
- Target length (``length_reward`` != none): the target ``T`` is chosen from ``target_tokens`` by SHA-256 of the
  assignment seed and appended to the prompt as ``" Think for {T} tokens before giving a response."`` (exact;
  INTELLECT-2's wording) or ``" Think for at most {T} tokens before giving a response."`` (max, clip).

Rewards may block: a math check up to ``verifiers.MATH_DEADLINE_S`` in a helper process, a code task up to
``code_timeout_s`` per test case. Call ``reward`` from a worker thread, never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from intellect_node.judging import jail
from intellect_node.judging.verifiers import run_code_tests, verify_math
from intellect_protocol.messages import TaskSpec
from intellect_protocol.tasks import arithmetic_reward, arithmetic_task, assignment_seed

logger = logging.getLogger(__name__)

TaskKind = Literal["integer", "math", "code"]
_MAX_TEST_CASES = 64
_INTEGER = re.compile(r"(?<![0-9.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?![0-9])")


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


def _h(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class TaskSource:
    """The run's task set: ``assigned`` tasks for training, ``held_out_tasks`` for evaluation, disjoint."""

    def __init__(self, spec: TaskSpec, draw: Callable[[int], Task], size: int, held_out: list[Task]) -> None:
        self.spec = spec
        self._draw = draw
        self._size = size
        self._held_out = [self._with_target(t, _h(f"held-out-target/{t.id}")) for t in held_out]

    def __len__(self) -> int:
        """Number of distinct assignable tasks."""
        return self._size

    def assigned(self, run_seed: int, node_id: str, version: int, batch_index: int, slot: int) -> Task:
        seed = assignment_seed(run_seed, node_id, version, batch_index, slot)
        return self._with_target(self._draw(seed), seed)

    def held_out_tasks(self) -> list[Task]:
        return list(self._held_out)

    def _with_target(self, task: Task, seed: int) -> Task:
        s = self.spec
        if s.length_reward == "none":
            return task
        target = s.target_tokens[_h(f"target/{seed}") % len(s.target_tokens)]
        bound = "" if s.length_reward == "exact" else "at most "
        return replace(
            task,
            prompt=f"{task.prompt} Think for {bound}{target} tokens before giving a response.",
            target_tokens=target,
        )


_SOURCES: dict[str, TaskSource] = {}
_SOURCES_LOCK = threading.Lock()


def needs_jail(spec: TaskSpec) -> bool:
    """Whether scoring this task set runs untrusted programs or parsers (math-verify, code tests): datasets."""
    return spec.family == "dataset"


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
    if spec.family == "arithmetic":
        return TaskSource(spec, lambda seed: _arithmetic(seed, spec.max_operand), (spec.max_operand + 1) ** 2, [])
    if spec.family == "addition":
        return _addition_source(spec)
    return _dataset_source(spec)


def _arithmetic(seed: int, max_operand: int) -> Task:
    t = arithmetic_task(seed, max_operand)
    return Task(prompt=t.prompt, kind="integer", answer=t.answer, id=f"arithmetic/{t.prompt}")


# -- addition -------------------------------------------------------------------------------------------------


def _addition_source(spec: TaskSpec) -> TaskSource:
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
        held.setdefault(_h(f"held-out/addition/{spec.digits}/{k}") % problems)
        k += 1

    def draw(seed: int) -> Task:
        index, attempt = seed % problems, 0
        while index in held:
            index, attempt = _h(f"redraw/{seed}/{attempt}") % problems, attempt + 1
        return task(index)

    return TaskSource(spec, draw, problems - len(held), [task(i) for i in held])


MAX_INTEGER_DIGITS = 100


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


# -- dataset --------------------------------------------------------------------------------------------------


def _dataset_source(spec: TaskSpec) -> TaskSource:
    rows, digest = _read_rows(spec)
    skipped: Counter[str] = Counter()
    tasks: list[Task] = []
    seen: set[str] = set()  # membership only; order comes from the file
    for row in rows:
        task = _parse_row(row, spec.pass_rate_field, skipped)
        if task is None:
            continue
        if task.id in seen:
            skipped["duplicate id"] += 1
            continue
        seen.add(task.id)
        tasks.append(task)
    if skipped:
        reasons = ", ".join(f"{why}={n}" for why, n in sorted(skipped.items()))
        logger.warning(
            "task source skipped rows source=%s skipped=%d of=%d (%s)",
            spec.source,
            sum(skipped.values()),
            len(rows),
            reasons,
        )
    if not tasks:
        raise ValueError(
            f"task source {spec.source} has no usable rows ({len(rows)} rows read, all skipped: {dict(skipped)}); "
            "each row needs a prompt, a task_type and a verification_info with ground_truth or test_cases"
        )
    full_range = spec.min_pass_rate == 0.0 and spec.max_pass_rate == 1.0
    kept = [t for t in tasks if _in_range(t.pass_rate, spec, full_range)]
    if not kept:
        raise ValueError(
            f"no row of {spec.source} has {spec.pass_rate_field} in [{spec.min_pass_rate}, {spec.max_pass_rate}] "
            f"({len(tasks)} usable rows): widen the range or check pass_rate_field"
        )
    if spec.held_out >= len(kept):
        raise ValueError(
            f"task.held_out = {spec.held_out} leaves none of the {len(kept)} usable rows of "
            f"{spec.source} to train on: lower it (--set task.held_out=N, or held_out under "
            "[run.task]; at most half the rows)"
        )
    ranked = sorted(range(len(kept)), key=lambda i: (hashlib.sha256(kept[i].id.encode()).digest(), i))
    held_idx = sorted(ranked[: spec.held_out])
    held_set = set(held_idx)
    assignable = [t for i, t in enumerate(kept) if i not in held_set]
    logger.info(
        "task source loaded source=%s sha256=%s rows=%d usable=%d in_range=%d held_out=%d assignable=%d",
        spec.source,
        digest,
        len(rows),
        len(tasks),
        len(kept),
        len(held_idx),
        len(assignable),
    )
    return TaskSource(
        spec, lambda seed: assignable[seed % len(assignable)], len(assignable), [kept[i] for i in held_idx]
    )


def _in_range(rate: float | None, spec: TaskSpec, full_range: bool) -> bool:
    if rate is None:
        return full_range
    return spec.min_pass_rate <= rate <= spec.max_pass_rate


def _parse_row(row: Any, rate_field: str, skipped: Counter[str]) -> Task | None:
    """A row of INTELLECT-2's shape as a Task, or None (the reason counted in ``skipped``)."""
    if not isinstance(row, dict):
        skipped["not a JSON object"] += 1
        return None
    prompt = next((row[k] for k in ("prompt", "question", "problem") if isinstance(row.get(k), str)), "")
    if not prompt.strip():
        skipped["missing prompt"] += 1
        return None
    info = row.get("verification_info")
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except json.JSONDecodeError:
            info = None
    if not isinstance(info, dict):
        skipped["bad verification_info"] += 1
        return None
    kind = _kind(row.get("task_type"), info)
    rate = row.get(rate_field)
    rate = float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) and 0 <= rate <= 1 else None
    pid = row.get("problem_id")
    tid = pid if isinstance(pid, str) and pid else "sha256:" + hashlib.sha256(prompt.encode()).hexdigest()[:32]
    if kind == "math":
        truth = info.get("ground_truth")
        if isinstance(truth, int | float) and not isinstance(truth, bool):
            truth = str(truth)
        if not isinstance(truth, str) or not truth.strip():
            skipped["math row without ground_truth"] += 1
            return None
        return Task(prompt=prompt, kind="math", answer=truth, pass_rate=rate, id=tid)
    if kind == "code":
        tests = _test_cases(info.get("test_cases"))
        if not tests:
            skipped["code row without stdin/stdout test_cases"] += 1
            return None
        return Task(prompt=prompt, kind="code", tests=tests, pass_rate=rate, id=tid)
    skipped[f"unknown task_type {str(row.get('task_type'))[:40]!r}"] += 1
    return None


def _kind(task_type: Any, info: dict[str, Any]) -> TaskKind | None:
    if task_type in ("verifiable_math", "math"):
        return "math"
    if task_type in ("verifiable_code", "code", "code_stdio"):
        return "code"
    if task_type is None:  # no column: infer from what can be checked
        return "math" if "ground_truth" in info else "code" if "test_cases" in info else None
    return None


def _test_cases(cases: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(cases, list) or not cases or len(cases) > _MAX_TEST_CASES:
        return ()
    out = []
    for c in cases:
        if not isinstance(c, dict) or c.get("type", "stdin_stdout") != "stdin_stdout":
            return ()
        if not isinstance(c.get("input"), str) or not isinstance(c.get("output"), str):
            return ()
        out.append((c["input"], c["output"]))
    return tuple(out)


def _read_rows(spec: TaskSpec) -> tuple[list[Any], str]:
    """Rows of the source and its SHA-256 (of the file's bytes; of the rows as sorted JSON lines for ``hf:``)."""
    if spec.source.startswith("hf:"):
        rows = _hf_rows(spec.source[3:], spec.split)
        h = hashlib.sha256()
        for r in rows:
            h.update(json.dumps(r, sort_keys=True, default=str).encode() + b"\n")
        digest = h.hexdigest()
    else:
        path = Path(spec.source)
        if not path.is_file():
            raise FileNotFoundError(
                f"task source {path} not found: every node needs the run's task file at this path "
                "(copy it there), or use source = 'hf:owner/name'"
            )
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        _check_pin(spec, digest)
        if path.suffix == ".jsonl":
            lines = data.decode("utf-8", "replace").splitlines()
            return [_json_or_none(line) for line in lines if line.strip()], digest
        if path.suffix == ".parquet":
            return _parquet_rows(path), digest
        raise ValueError(f"task source {path}: use a .jsonl or .parquet file (or hf:owner/name)")
    _check_pin(spec, digest)
    return rows, digest


def _check_pin(spec: TaskSpec, digest: str) -> None:
    if spec.source_sha256 and digest != spec.source_sha256:
        raise ValueError(
            f"task source {spec.source} has sha256 {digest}, the run pins {spec.source_sha256}: every node must "
            "hold the same task set; fetch the run's file (or fix source_sha256 if the run changed it)"
        )


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _parquet_rows(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise RuntimeError(f"reading {path} needs pyarrow: pip install 'intellect-node[data]'") from e
    return list(pq.read_table(path).to_pylist())


def _hf_rows(name: str, split: str) -> list[Any]:
    try:
        import datasets  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        raise RuntimeError(
            f"source hf:{name} needs the datasets package: pip install datasets, or download the dataset's "
            "parquet files and set source to a local path"
        ) from e
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # any failure (offline, no such dataset or split) ends the same way for the volunteer
        raise RuntimeError(
            f"could not load hf:{name} split {split!r} ({type(e).__name__}: {e}): check the name and split and "
            "that this machine can reach huggingface.co, or download the files and set source to a local path"
        ) from e
    return [dict(r) for r in ds]


# -- rewards --------------------------------------------------------------------------------------------------


def reward(task: Task, completion_text: str, terminated: bool, completion_tokens: int, spec: TaskSpec) -> float:
    """The reward of one completion (its text before end of sequence), length shaping applied last.

    ``arithmetic``: ``intellect_protocol.tasks.arithmetic_reward`` unchanged. integer: 1.0 when
    ``last_integer(text)`` equals the answer, else 0.0. math: 1.0 when math-verify finds the answer equivalent
    to the ground truth, else 0.0. code: the fraction of test cases whose stdout matches (see
    ``run_code_tests``). Not terminated: task reward 0 (a cut-off answer is not an answer). May block for
    seconds (subprocesses): call it off the event loop.
    """
    if spec.family == "arithmetic":
        return arithmetic_reward(completion_text, task.answer, terminated)
    r = _task_reward(task, completion_text, spec) if terminated else 0.0
    return length_shaped(r, completion_tokens, task.target_tokens, spec.length_reward, spec.length_coef)


def _task_reward(task: Task, text: str, spec: TaskSpec) -> float:
    if task.kind == "integer":
        got = last_integer(text)
        return 1.0 if got is not None and got == int(task.answer) else 0.0
    if task.kind == "math":
        return 1.0 if verify_math(task.answer, text) else 0.0
    return run_code_tests(extract_code(text), task.tests, spec.code_timeout_s, spec.code_memory_mb)


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


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last ```` ```python ```` (or ``py``, ``python3``) fenced block of ``text``; the whole text if none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


__all__ = [
    "Task",
    "TaskSource",
    "extract_code",
    "last_integer",
    "length_shaped",
    "load_task_source",
    "needs_jail",
    "require_jail",
    "reward",
    "run_code_tests",
    "verify_math",
]
