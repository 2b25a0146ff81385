"""``verifiers``: a single-turn taskset of Prime Intellect's ``verifiers`` (0.4.0, its ``verifiers.v1`` API), the
format of their Environments Hub: its rows as tasks, its rewards as the reward.

Optional: ``pip install 'intellect-node[verifiers]'``, and the environment's own package on every node (the run
spec names it: ``task.source = "reverse-text"`` or ``owner/name@version``, imported as verifiers imports it, the
module ``reverse_text``; ``task.options`` are its taskset config's fields). The taskset's ``load()`` order is the
task order, so every node with the same package derives the same tasks; ``held_out`` rows (those whose id hashes
lowest) are kept for evaluation and never assigned.

What works: single-turn tasksets whose rewards read only the task and the reply (an exact answer, a parsed
``\\boxed{}``, a format check). The prompt is the row's user prompt, after its system prompt when it has one
(this node's models take one user turn). Refused at start, saying why: a row whose prompt is a conversation
(earlier assistant turns), a reward or metric that needs a runtime (a sandbox the environment runs code or tools
in), an LLM judge, or scoring deferred to the group. Multi-turn environments would need the environment in the
producer's loop (tool calls and their results are part of the rollout), and a validator that replays every turn
against the same environment state: not built.

Scoring runs in the jail (``verifiers.score_verifiers``): the environment's reward code is third-party code fed
with a peer's completion. The node hands the jail its own pickle of the task it loaded (so a taskset that reads
its rows from the network or a cache loads once, outside), the jail returns one number: the taskset's weighted
sum of rewards (``trace.reward``); a crash or a deadline counts as 0.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import logging
import pickle
import threading
from pathlib import Path
from typing import Any

from intellect_node.judging.families.base import Task, TaskFamily, TaskSet
from intellect_node.judging.verifiers import score_verifiers
from intellect_protocol.messages import TaskSpec

logger = logging.getLogger(__name__)

VERSION = "0.4.0"
MAX_ROWS = 1_000_000


class VerifiersEnv(TaskFamily):
    needs_jail = True  # the environment's reward code reads a peer's completion

    def __init__(self) -> None:
        self._loaded: dict[str, list[Any]] = {}  # the taskset's own task objects, by spec (scoring needs them)
        self._lock = threading.Lock()

    def load(self, spec: TaskSpec) -> TaskSet:
        vf = _package()
        loaded = _load_tasks(vf, spec)
        rows = [_row(spec, i, t) for i, t in enumerate(loaded)]
        with self._lock:
            self._loaded[spec.model_dump_json()] = loaded
        if not rows:
            raise ValueError(f"the verifiers taskset {spec.source!r} has no rows with options {dict(spec.options)}")
        if spec.held_out > len(rows) // 2:
            raise ValueError(
                f"task.held_out = {spec.held_out} is more than half of the {len(rows)} rows of {spec.source}: lower it"
            )
        ranked = sorted(range(len(rows)), key=lambda i: (hashlib.sha256(rows[i].id.encode()).digest(), i))
        held = set(ranked[: spec.held_out])
        assignable = [t for i, t in enumerate(rows) if i not in held]
        logger.info(
            "verifiers taskset loaded env=%s rows=%d held_out=%d assignable=%d",
            spec.source,
            len(rows),
            len(held),
            len(assignable),
        )
        held_out = [rows[i] for i in sorted(held)]
        return TaskSet(lambda seed: assignable[seed % len(assignable)], len(assignable), held_out)

    def score(self, task: Task, text: str, spec: TaskSpec) -> float:
        key = spec.model_dump_json()
        with self._lock:
            loaded = self._loaded.get(key)
        if loaded is None:
            self.load(spec)
            with self._lock:
                loaded = self._loaded[key]
        env_task = loaded[int(task.id.rsplit("/", 1)[1])]
        return score_verifiers(pickle.dumps(env_task), text, module_folders(spec.source))


def module_name(env_id: str) -> str:
    """The module verifiers imports for ``env_id`` (``owner/reverse-text@0.1`` -> ``reverse_text``)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


@functools.cache
def module_folders(env_id: str) -> tuple[str, ...]:
    """The environment's package folder when it lies outside the Python installation (an editable install, a
    folder on PYTHONPATH): the jail binds it, read-only, and nothing beside it. Looked up once per process (every
    reply scored asks)."""
    name = module_name(env_id)
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{name}") is not None:
        return ()  # one of verifiers' own
    found = importlib.util.find_spec(name)
    if found is None or found.origin is None:
        return ()
    origin = Path(found.origin)
    return (str(origin.parent if found.submodule_search_locations else origin),)


def _package() -> Any:
    try:
        installed = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        installed = ""
    if installed != VERSION:
        have = f"this node has {installed}" if installed else "it is not installed"
        raise RuntimeError(
            f"this run's tasks are a verifiers environment, which needs verifiers {VERSION} ({have}): "
            "pip install 'intellect-node[verifiers]', and the run's environment package"
        )
    import verifiers.v1 as vf

    return vf


def _load_tasks(vf: Any, spec: TaskSpec) -> list[Any]:
    try:
        config = vf.taskset_config_type(spec.source)(id=spec.source, **spec.options)
        taskset = vf.load_taskset(config)
    except ModuleNotFoundError as e:
        raise RuntimeError(
            f"the run's verifiers environment {spec.source!r} is not installed on this node (module "
            f"{module_name(spec.source)!r}): install its package (e.g. `prime env install {spec.source}`), then start "
            "again"
        ) from e
    except Exception as e:  # its config's validation, its own load errors
        raise ValueError(
            f"the verifiers environment {spec.source!r} refused options {dict(spec.options)} "
            f"({type(e).__name__}: {_one_line(e)}): fix task.options (its taskset config's fields)"
        ) from e
    tasks: list[Any] = []
    for t in taskset.load():
        if len(tasks) >= MAX_ROWS:
            raise ValueError(f"the verifiers taskset {spec.source!r} has more than {MAX_ROWS} rows: narrow it")
        tasks.append(t)
    if tasks:
        _check_single_turn(spec.source, tasks[0])
    return tasks


def _check_single_turn(env: str, task: Any) -> None:
    """Refuse tasksets whose reward needs more than the reply: a runtime, an LLM judge, group scoring."""

    def needs_runtime(fn: Any) -> bool:
        param = inspect.signature(fn).parameters.get("runtime")
        return param is not None and param.default is inspect.Parameter.empty

    why = []
    hooks = [*task.hooks("reward"), *task.hooks("metric")]
    if not task.hooks("reward"):
        why.append("it has no reward")
    why += [f"reward {fn.__name__} needs a runtime (a sandbox)" for fn in hooks if needs_runtime(fn)]
    why += [f"judge {j.reward_name} asks a model" for j in task.plugged_judges()]
    if getattr(task, "scoring_deferred", False):
        why.append("it scores whole groups")
    if why:
        raise ValueError(
            f"the verifiers environment {env!r} cannot be a task set here: {'; '.join(why)}. This node scores "
            "single-turn replies from the reply alone (multi-turn and tool environments are not supported)"
        )


def _row(spec: TaskSpec, index: int, task: Any) -> Task:
    data = task.data
    prompt = data.prompt
    if isinstance(prompt, str):
        user = prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and getattr(prompt[0], "role", "") == "user":
        user = _text(prompt[0].content)
    else:
        raise ValueError(
            f"row {index} of the verifiers environment {spec.source!r} opens with a conversation, not one user "
            "prompt: multi-turn environments are not supported"
        )
    if data.system_prompt:
        user = f"{data.system_prompt}\n\n{user}"
    answer = getattr(data, "answer", "")  # shown in logs and evaluation only: the rewards decide
    return Task(
        prompt=user,
        kind="verifiers",
        answer=answer if isinstance(answer, str) else "",
        id=f"verifiers/{data.id or index}/{index}",
    )


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = [getattr(p, "text", None) for p in content or []]
    if any(p is None for p in parts):
        raise ValueError("a verifiers prompt with images or other non-text parts is not supported")
    return "".join(str(p) for p in parts)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]
