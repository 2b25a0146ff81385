"""``dataset``: rows in INTELLECT-2's shape from a ``.jsonl``, a ``.parquet`` or ``hf:owner/name``.

Each row has a ``prompt``, a ``task_type``, a ``verification_info`` and optionally a pass-rate column
(``TaskSpec.pass_rate_field``); a ``.parquet`` needs ``pip install 'intellect-node[data]'``, ``hf:`` the
``datasets`` package. ``verifiable_math`` rows are checked with math-verify against ``ground_truth``;
``verifiable_code`` rows run the last ```` ```python ```` block against stdin/stdout ``test_cases`` in the jail,
the reward being the fraction of cases passed (``base.TaskFamily.score``, ``verifiers.py``).

Invariants: rows are read in file order and deduplicated by id (``problem_id``, else SHA-256 of the prompt); rows
whose pass rate lies outside ``[min_pass_rate, max_pass_rate]`` are never used; the ``held_out`` rows whose id
hashes lowest are kept for evaluation and never assigned. A pinned ``source_sha256`` must match the source.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from intellect_node.judging.families.base import Task, TaskFamily, TaskKind, TaskSet
from intellect_protocol.messages import TaskSpec

logger = logging.getLogger(__name__)

_MAX_TEST_CASES = 64


class Dataset(TaskFamily):
    needs_jail = True  # math-verify parses untrusted text; code tasks run untrusted programs

    def load(self, spec: TaskSpec) -> TaskSet:
        return _load(spec)


def _load(spec: TaskSpec) -> TaskSet:
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
    return TaskSet(lambda seed: assignable[seed % len(assignable)], len(assignable), [kept[i] for i in held_idx])


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
