"""``reasoning_gym``: a procedural dataset of the reasoning-gym package (pinned: 0.1.25), by name and config.

The run spec names the dataset (``task.source = "chain_sum"``) and configures its generator (``task.options``, the
fields of the dataset's config class, e.g. ``min_terms``; ``size`` is how many distinct problems there are,
100,000 when absent). The generator's seed is never the run's choice nor reasoning-gym's global RNG: it is
SHA-256 of the dataset's name and options (``generator_seed``), so every node builds the same problems, and
problem ``i`` is reasoning-gym's item ``i`` of that dataset (generated from ``Random(seed + i)``, as its
procedural datasets do). An assignment seed picks an index; ``held_out`` indices, drawn by SHA-256, are kept for
evaluation and never assigned. ``load`` refuses a dataset whose items change with Python's global RNG state.

Scoring is the dataset's own ``score_answer`` (exact answers, partial credit where the dataset gives it), run in
the jail (``verifiers.score_gym``): several scorers evaluate the answer (``eval``, sympy). The answer read from
a completion depends on ``task.answer_format`` (``plain``: the last non-empty line; ``number``: the last number;
``tags``: the last ``<answer>...</answer>`` span). A completion that did not end with end of sequence scores 0,
as in every family.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import threading
from typing import Any

from intellect_node.judging.families.base import Task, TaskFamily, TaskSet, digest64, indexed_task_set
from intellect_node.judging.verifiers import score_gym
from intellect_protocol.messages import TaskSpec

VERSION = "0.1.25"
"""The reasoning-gym every node of a run must have: a different version may generate different problems."""
DEFAULT_SIZE = 100_000
MAX_SIZE = 10_000_000
_DETERMINISM_PROBES = 4
_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"(?<![0-9.])-?[0-9]+(?:\.[0-9]+)?(?![0-9])")
_INSTRUCTION = {
    "plain": " Reply with just the answer.",
    "number": " Reply with just the number.",
    "tags": " Give your final answer between <answer> and </answer>.",
}
_lock = threading.Lock()  # reasoning-gym's generators are not documented as thread-safe


class ReasoningGym(TaskFamily):
    needs_jail = True  # scorers may evaluate the answer (string_insertion's eval, sympy)

    def load(self, spec: TaskSpec) -> TaskSet:
        rg = _package()
        config = generator_config(spec)
        size = int(config["size"])
        if spec.held_out > size // 2:
            raise ValueError(
                f"task.held_out = {spec.held_out} is more than half of the {size} problems of {spec.source}: lower "
                "held_out or raise task.options.size"
            )
        if spec.source not in rg.factory.DATASETS:
            raise ValueError(
                f"reasoning-gym {VERSION} has no dataset {spec.source!r}; its datasets: "
                + ", ".join(sorted(rg.factory.DATASETS))
            )
        try:
            dataset = rg.create_dataset(spec.source, **config)
        except Exception as e:  # the config class's own checks: TypeError, AssertionError, ValueError
            raise ValueError(
                f"reasoning-gym cannot build dataset {spec.source!r} with options {dict(spec.options)} "
                f"({type(e).__name__}: {e}): fix task.options (the fields of its config class)"
            ) from e
        _check_deterministic(spec, dataset)
        suffix = _INSTRUCTION[spec.answer_format]

        def task(index: int) -> Task:
            with _lock:
                entry = dataset[index]
            return Task(
                prompt=str(entry["question"]).rstrip() + suffix,
                kind="reasoning_gym",
                answer=str(entry["answer"]),
                id=f"reasoning_gym/{spec.source}/{index}",
            )

        return indexed_task_set(task, size, spec.held_out, f"reasoning_gym/{spec.source}")  # held_out checked above

    def score(self, task: Task, text: str, spec: TaskSpec) -> float:
        answer = read_answer(text, spec.answer_format)
        if answer is None:
            return 0.0
        return score_gym(spec.source, generator_config(spec), task_index(task), answer)


def generator_config(spec: TaskSpec) -> dict[str, Any]:
    """The keyword arguments of ``reasoning_gym.create_dataset``: the spec's options, its size, and the seed every
    node derives alike."""
    config: dict[str, Any] = dict(spec.options)
    size = config.get("size", DEFAULT_SIZE)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
        raise ValueError(f"task.options.size must be a whole number of problems in [1, {MAX_SIZE}], got {size!r}")
    config["size"] = size
    config["seed"] = generator_seed(spec.source, spec.options)
    return config


def generator_seed(name: str, options: dict[str, Any]) -> int:
    """The generator's seed: 31 bits of SHA-256 over the dataset's name and its options as sorted JSON."""
    return digest64("reasoning_gym/" + name + "/" + json.dumps(options, sort_keys=True)) % 2**31


def task_index(task: Task) -> int:
    """The problem's index in its dataset, from its id (``reasoning_gym/<name>/<index>``)."""
    return int(task.id.rsplit("/", 1)[1])


def read_answer(text: str, answer_format: str) -> str | None:
    """The answer a completion gives: ``plain``, its last non-empty line (stripped, without a closing period);
    ``number``, the last number written in it (``-12``, ``3.5``); ``tags``, its last ``<answer>`` span
    (stripped); None when there is none."""
    if answer_format == "number":
        numbers = _NUMBER.findall(text[-4096:])
        return numbers[-1] if numbers else None
    if answer_format == "tags":
        spans = _TAGS.findall(text)
        return spans[-1].strip() if spans else None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1]
    return last[:-1].rstrip() if last.endswith(".") and len(last) > 1 else last


def _package() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise RuntimeError(
            f"this run's tasks come from reasoning-gym, which is not installed: pip install reasoning-gym=={VERSION}"
        ) from e
    try:
        installed = importlib.metadata.version("reasoning-gym")  # its __version__ string lags its releases
    except importlib.metadata.PackageNotFoundError:
        installed = ""
    if installed != VERSION:
        raise RuntimeError(
            f"this run's tasks need reasoning-gym {VERSION} (every node must generate the same problems), this "
            f"node has {installed or 'an unknown version'}: pip install reasoning-gym=={VERSION}"
        )
    return reasoning_gym


def _check_deterministic(spec: TaskSpec, dataset: Any) -> None:
    """Refuse a dataset that cannot generate its first problems, or whose problems depend on Python's global RNG
    (nodes would derive different tasks)."""
    state = random.getstate()
    seen: list[list[str]] = []
    try:
        for salt in (1, 2):
            random.seed(salt)
            with _lock:
                seen.append([json.dumps(dataset[i], sort_keys=True, default=str) for i in range(_DETERMINISM_PROBES)])
    except Exception as e:  # a config its checks let through (e.g. operators without as many weights)
        raise ValueError(
            f"reasoning-gym's {spec.source!r} cannot generate problems with options {dict(spec.options)} "
            f"({type(e).__name__}: {e}): fix task.options"
        ) from e
    finally:
        random.setstate(state)
    if seen[0] != seen[1]:
        raise ValueError(
            f"reasoning-gym's {spec.source!r} generates different problems from the same seed (it draws from "
            "Python's global random state): every node must derive the same tasks, so it cannot be a run's task set"
        )
