"""Checkers for untrusted completions: math answers (math-verify), reasoning-gym answers and Python programs, all
in the jail.

Each runs the untrusted part in a jailed process (node/judging/jail.py: bubblewrap namespaces, no network, no
environment, a read-only view of the system and the Python installation, a private empty /tmp and /dev/shm of
fixed sizes, uid 65534, CPU, memory (a cgroup per run), process and output limits), so that a completion cannot
read the node's key, touch its files, reach the network, hang, fork or fill the memory of the node scoring it.
All are safe to call from any thread (math-verify's own ``signal.alarm`` timeouts only work in a main thread:
here they run in the main thread of the helper process).

- ``verify_math(ground_truth, text)``: one long-lived jailed helper process per node (``python -c`` with
  math-verify), one request at a time under a lock. A check that takes longer than ``MATH_DEADLINE_S`` kills the
  helper (restarted on the next call) and counts as wrong.
- ``score_gym(name, config, index, answer)``: the same kind of helper with reasoning-gym, which rebuilds the
  problem from its dataset, config and index and scores the answer with the dataset's own ``score_answer``
  (some scorers parse the answer with sympy, which evaluates it: untrusted). A crash, a deadline or a score
  outside [0, 1] counts as 0.
- ``score_verifiers(task, text, folders)``: the same kind of helper with verifiers, one per environment package
  (bound read-only when it lies outside the installation), scoring a reply with the task's own reward hooks.
- ``run_code_tests(code, tests, timeout_s, memory_mb)``: each test case runs ``python -I /code/main.py`` in a fresh
  jail, the program's folder bound read-only at /code, stdin from the case, stdout to a file capped at 16 MiB.
  Wall clock ``timeout_s`` (the whole process group is killed), CPU time ``ceil(timeout_s)``, memory
  ``memory_mb``, 32 processes.

Where the jail cannot run (no bubblewrap, or no memory cgroup), both raise RuntimeError naming the fix: nothing
untrusted runs outside it.
"""

from __future__ import annotations

import atexit
import base64
import importlib.util
import json
import logging
import math
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from intellect_node.judging import jail

logger = logging.getLogger(__name__)

MATH_DEADLINE_S = 10.0
"""Longest one math check may take (math-verify's own per-step timeout inside the helper is 5 s)."""
MATH_START_DEADLINE_S = 120.0
MATH_MEMORY_BYTES = 4 << 30
MATH_CPU_S = 3600
"""CPU seconds of one helper process over its life (restarted when spent); each check also has its deadline."""
OUTPUT_LIMIT_BYTES = 16 << 20
NOBODY = 65534

_MATH_HELPER = r"""
import json, sys
from math_verify import parse, verify

def check(gold, text):
    g = parse("\\boxed{" + gold + "}") or parse(gold)
    p = parse(text)
    return bool(g) and bool(p) and bool(verify(g, p))

print("ready", flush=True)
for line in sys.stdin:
    try:
        req = json.loads(line)
        ok = check(req["gold"], req["text"])
    except Exception:
        ok = False
    sys.stdout.write("1\n" if ok else "0\n")
    sys.stdout.flush()
"""


_GYM_HELPER = r"""
import json, math, sys
import reasoning_gym

datasets = {}
print("ready", flush=True)
for line in sys.stdin:
    try:
        req = json.loads(line)
        key = json.dumps([req["name"], req["config"]], sort_keys=True)
        if key not in datasets:
            if len(datasets) >= 8:
                datasets.clear()
            datasets[key] = reasoning_gym.create_dataset(req["name"], **req["config"])
        ds = datasets[key]
        score = float(ds.score_answer(answer=req["answer"], entry=ds[req["index"]]))
        if not (math.isfinite(score) and 0.0 <= score <= 1.0):
            score = 0.0
    except Exception:
        score = 0.0
    sys.stdout.write(repr(score) + "\n")
    sys.stdout.flush()
"""


_VERIFIERS_HELPER = r"""
import asyncio, base64, json, math, os, pickle, sys
for folder in json.loads(sys.argv[1]):  # an environment package outside the installation, bound read-only
    sys.path.insert(0, os.path.dirname(folder))
import verifiers.v1 as vf
from verifiers.v1.state import state_cls

async def score(task, text):
    data, nodes = task.data, []
    if data.system_prompt:
        nodes.append(vf.MessageNode(message=vf.SystemMessage(content=data.system_prompt)))
    prompt = data.prompt if isinstance(data.prompt, str) else data.prompt[0].content
    nodes.append(vf.MessageNode(parent=len(nodes) - 1 if nodes else None, message=vf.UserMessage(content=prompt)))
    nodes.append(vf.MessageNode(parent=len(nodes) - 1, message=vf.AssistantMessage(content=text), sampled=True))
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="intellect-node", trainable=False),
        nodes=nodes,
    )
    await task.score(trace)
    return float(trace.reward)

print("ready", flush=True)
for line in sys.stdin:
    try:
        req = json.loads(line)
        task = pickle.loads(base64.b64decode(req["task"]))  # made by the node from the task it loaded
        reward = asyncio.run(score(task, req["text"]))
        if not math.isfinite(reward):
            reward = 0.0
    except Exception:
        reward = 0.0
    sys.stdout.write(repr(reward) + "\n")
    sys.stdout.flush()
"""


class _JailedHelper:
    """A long-lived jailed process that answers one JSON request per line; ``ask`` serializes callers.
    ``folders``: host folders bound read-only at the same path, handed to the program as a JSON argument."""

    def __init__(self, what: str, program: str, module: str, install: str, folders: list[str] | None = None) -> None:
        self._what = what
        self._program = program
        self._module = module
        self._install = install
        self._folders = folders or []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._run: jail.Run | None = None
        self._buf = b""

    def ask(self, request: dict[str, object]) -> bytes | None:
        """The helper's answer line, or None when it crashed or outlasted ``MATH_DEADLINE_S`` (it is restarted
        on the next call)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                return self._read_line(MATH_DEADLINE_S)
            except (BrokenPipeError, TimeoutError, EOFError) as e:
                logger.warning("%s check failed, restarting the helper reason=%s", self._what, type(e).__name__)
                self._kill()
                return None

    def _start(self) -> None:
        if importlib.util.find_spec(self._module) is None:
            raise RuntimeError(f"{self._what} rewards need {self._module}: {self._install}")
        self._buf = b""
        self._run = jail.Run(
            [sys.executable, "-I", "-c", self._program, json.dumps(self._folders)],
            jail.Limits(cpu_s=MATH_CPU_S, memory_bytes=MATH_MEMORY_BYTES, processes=8),
            [(folder, folder) for folder in self._folders],
            die_with_parent=False,  # started from whichever worker thread asks first; ends when its stdin closes
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._proc = self._run.proc
        try:
            ready = self._read_line(MATH_START_DEADLINE_S)
        except (TimeoutError, EOFError) as e:
            self._kill()
            raise RuntimeError(
                f"the {self._what} helper did not start ({type(e).__name__}): check "
                f"`{sys.executable} -c 'import {self._module}'` works"
            ) from e
        if ready != b"ready":
            self._kill()
            raise RuntimeError(f"the {self._what} helper said {ready[:200]!r} instead of ready")

    def _read_line(self, timeout_s: float) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.strip()

    def _kill(self) -> None:
        if self._run is not None:
            self._run.close()
        self._run = None
        self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()


_math = _JailedHelper("math", _MATH_HELPER, "math_verify", "pip install math-verify")
_gym = _JailedHelper("reasoning-gym", _GYM_HELPER, "reasoning_gym", "pip install reasoning-gym==0.1.25")
_verifiers: dict[tuple[str, ...], _JailedHelper] = {}  # by the folders it binds (one per environment package)
_verifiers_lock = threading.Lock()
atexit.register(_math.close)  # the helpers outlive no process, and their cgroups go with them
atexit.register(_gym.close)


@atexit.register
def _close_verifiers_helpers() -> None:
    for helper in list(_verifiers.values()):
        helper.close()


def verify_math(ground_truth: str, text: str) -> bool:
    """Whether the answer in ``text`` (its last ``\\boxed{}``, else its last expression) equals ``ground_truth``.

    math-verify compares symbolically and numerically ("\\boxed{\\frac{1}{2}}" matches "0.5"). A check that
    crashes or outlasts ``MATH_DEADLINE_S`` counts as not equal. Blocks; thread-safe (one check at a time).
    """
    return _math.ask({"gold": ground_truth, "text": text}) == b"1"


def score_gym(name: str, config: dict[str, object], index: int, answer: str | None) -> float:
    """reasoning-gym's own score of ``answer`` for problem ``index`` of dataset ``name`` built with ``config``
    (seed and size included), in [0, 1]; 0 when the scorer crashes or outlasts ``MATH_DEADLINE_S``. Blocks;
    thread-safe (one check at a time)."""
    line = _gym.ask({"name": name, "config": config, "index": index, "answer": answer})
    try:
        score = float(line) if line is not None else 0.0
    except ValueError:
        return 0.0
    return score if math.isfinite(score) and 0.0 <= score <= 1.0 else 0.0


# -- code -----------------------------------------------------------------------------------------------------


def sandbox() -> jail.Status:
    """The jail's state on this machine; raises ``RuntimeError`` naming the fix when it does not work."""
    status = jail.probe()
    if not status.works:
        raise RuntimeError(f"code and math rewards need the jail ({status.error}): {status.hint}")
    return status


def run_code_tests(code: str, tests: tuple[tuple[str, str], ...], timeout_s: float, memory_mb: int) -> float:
    """The fraction of ``tests`` (stdin, expected stdout) that ``code`` passes, each in its own jail.

    A case passes when the program exits 0 within the limits and its stdout equals the expected output once
    trailing whitespace is stripped from every line and trailing empty lines are dropped. Blocks up to
    ``len(tests) * timeout_s`` seconds; thread-safe.
    """
    if not tests:
        return 0.0
    sandbox()
    passed = sum(_run_case(code, stdin, expected, timeout_s, memory_mb) for stdin, expected in tests)
    return passed / len(tests)


def _normalized(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _run_case(code: str, stdin: str, expected: str, timeout_s: float, memory_mb: int) -> bool:
    with tempfile.TemporaryDirectory(prefix="intellect-code-") as tmp:
        work = Path(tmp)
        program = work / "code"
        program.mkdir()
        (program / "main.py").write_text(code)
        (work / "stdin").write_text(stdin)
        os.chmod(program, 0o755)
        os.chmod(program / "main.py", 0o644)
        limits = jail.Limits(cpu_s=math.ceil(timeout_s), memory_bytes=memory_mb << 20, file_bytes=OUTPUT_LIMIT_BYTES)
        with open(work / "stdin", "rb") as fin, open(work / "stdout", "wb") as fout:
            run = jail.Run(
                [sys.executable, "-I", "/code/main.py"],
                limits,
                [(str(program), "/code")],
                stdin=fin,
                stdout=fout,
                stderr=subprocess.DEVNULL,
            )
            try:
                rc = run.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                run.close()  # the whole group, and what is left in its cgroup
        if rc != 0:
            return False
        with open(work / "stdout", "rb") as f:
            out = f.read(OUTPUT_LIMIT_BYTES).decode("utf-8", "replace")
    return _normalized(out) == _normalized(expected)


def score_verifiers(task: bytes, text: str, folders: tuple[str, ...]) -> float:
    """The reward a verifiers task (``task``: the node's own pickle of the task it loaded) gives the reply
    ``text``: the taskset's weighted sum of rewards, computed in the jail with ``folders`` (the environment's
    package, when outside the installation) bound read-only; 0 when it crashes or outlasts ``MATH_DEADLINE_S``.
    Blocks; thread-safe."""
    with _verifiers_lock:
        helper = _verifiers.get(folders)
        if helper is None:
            install = "pip install 'intellect-node[verifiers]'"
            helper = _verifiers[folders] = _JailedHelper(
                "verifiers", _VERIFIERS_HELPER, "verifiers", install, list(folders)
            )
    line = helper.ask({"task": base64.b64encode(task).decode(), "text": text})
    try:
        reward = float(line) if line is not None else 0.0
    except ValueError:
        return 0.0
    return reward if math.isfinite(reward) else 0.0
