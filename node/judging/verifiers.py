"""Checkers for untrusted completions: math answers (math-verify) and Python programs (a sandbox).

Both run the untrusted part in another process, so that a completion cannot hang, crash or fill the memory of
the node scoring it, and both are safe to call from any thread (math-verify's own ``signal.alarm`` timeouts only
work in a main thread: here they run in the main thread of the helper process).

- ``verify_math(ground_truth, text)``: one long-lived helper process per node (``python -c`` with math-verify),
  one request at a time under a lock. A check that takes longer than ``MATH_DEADLINE_S`` kills the helper
  (restarted on the next call) and counts as wrong.
- ``run_code_tests(code, tests, timeout_s, memory_mb)``: each test case runs ``python -I main.py`` in a fresh
  temporary directory, in new network and PID namespaces (``unshare --net --pid --fork --kill-child``): no
  network, not even loopback, and every process it starts dies with it. Limits: wall clock ``timeout_s``, CPU
  time ``ceil(timeout_s)``, address space ``memory_mb``, 16 MiB of output, no core files. As root, the program
  runs as ``nobody`` (uid 65534) when that user can run the interpreter; otherwise (and when the node is not
  root) it runs as root of a new user namespace (``--user --map-root-user``), which cannot raise its limits.
  Not isolated: the filesystem. A program run without ``nobody`` can read and write what the node's user can;
  volunteers scoring code should run the node as a dedicated user. Where no namespace can be made, code is
  refused with an error saying what to enable, never run unsandboxed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MATH_DEADLINE_S = 10.0
"""Longest one math check may take (math-verify's own per-step timeout inside the helper is 5 s)."""
MATH_START_DEADLINE_S = 120.0
MATH_MEMORY_BYTES = 4 << 30
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


class _MathHelper:
    """The helper process; ``check`` serializes callers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""

    def check(self, gold: str, text: str) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps({"gold": gold, "text": text}).encode() + b"\n")
                self._proc.stdin.flush()
                line = self._read_line(MATH_DEADLINE_S)
            except (BrokenPipeError, TimeoutError, EOFError) as e:
                logger.warning("math check failed, restarting the helper reason=%s", type(e).__name__)
                self._kill()
                return False
            return line == b"1"

    def _start(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise RuntimeError("math rewards need math-verify: pip install math-verify")
        self._buf = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _MATH_HELPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        resource.prlimit(self._proc.pid, resource.RLIMIT_AS, (MATH_MEMORY_BYTES, MATH_MEMORY_BYTES))
        try:
            ready = self._read_line(MATH_START_DEADLINE_S)
        except (TimeoutError, EOFError) as e:
            self._kill()
            raise RuntimeError(
                f"the math-verify helper did not start ({type(e).__name__}): check "
                f"`{sys.executable} -c 'import math_verify'` works"
            ) from e
        if ready != b"ready":
            self._kill()
            raise RuntimeError(f"the math-verify helper said {ready[:200]!r} instead of ready")

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
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()


_math = _MathHelper()


def verify_math(ground_truth: str, text: str) -> bool:
    """Whether the answer in ``text`` (its last ``\\boxed{}``, else its last expression) equals ``ground_truth``.

    math-verify compares symbolically and numerically ("\\boxed{\\frac{1}{2}}" matches "0.5"). A check that
    crashes or outlasts ``MATH_DEADLINE_S`` counts as not equal. Blocks; thread-safe (one check at a time).
    """
    return _math.check(ground_truth, text)


# -- code -----------------------------------------------------------------------------------------------------

_LAUNCHER = rf"""
import os, resource, sys
mem, cpu, out, drop = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
for limit, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, out),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
if drop:
    os.setgroups([])
    os.setgid({NOBODY})
    os.setuid({NOBODY})
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""

_sandbox_lock = threading.Lock()
_sandbox: tuple[list[str], bool] | None = None


def sandbox() -> tuple[list[str], bool]:
    """The ``unshare`` command line that isolates a test run, and whether the program drops to ``nobody``.

    Probed once per process. Raises ``RuntimeError`` saying what to enable when no network namespace can be made.
    """
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = _probe_sandbox()
        return _sandbox


def _probe_sandbox() -> tuple[list[str], bool]:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("code rewards need `unshare` (util-linux) to run programs without network: install it")
    base = [unshare, "--net", "--pid", "--fork", "--kill-child"]
    userns = [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]
    if os.geteuid() == 0 and subprocess.run([*base, "true"], capture_output=True, timeout=30).returncode == 0:
        if _run_case(base, True, "print(1)", "", "1", 10.0, 256):
            return base, True
        logger.warning(
            "code sandbox: %s cannot be run by nobody (uid %d), so programs under test run as root in a user "
            "namespace: no network and no raising limits, but they can touch root-owned files. Install Python "
            "where every user can read it, or run the node as an unprivileged user",
            sys.executable,
            NOBODY,
        )
    probe = subprocess.run([*userns, "true"], capture_output=True, timeout=30)
    if probe.returncode == 0:
        return userns, False
    raise RuntimeError(
        "code rewards need a network namespace and none could be made "
        f"({probe.stderr.decode(errors='replace').strip()[:200]}): run the node as root, or enable unprivileged "
        "user namespaces (sysctl kernel.unprivileged_userns_clone=1 and kernel.apparmor_restrict_unprivileged_userns=0"
        "; in a container: --security-opt seccomp=unconfined, or --cap-add SYS_ADMIN)"
    )


def run_code_tests(code: str, tests: tuple[tuple[str, str], ...], timeout_s: float, memory_mb: int) -> float:
    """The fraction of ``tests`` (stdin, expected stdout) that ``code`` passes, each in its own sandbox run.

    A case passes when the program exits 0 within the limits and its stdout equals the expected output once
    trailing whitespace is stripped from every line and trailing empty lines are dropped. Blocks up to
    ``len(tests) * timeout_s`` seconds; thread-safe.
    """
    if not tests:
        return 0.0
    prefix, drop = sandbox()
    passed = sum(_run_case(prefix, drop, code, stdin, expected, timeout_s, memory_mb) for stdin, expected in tests)
    return passed / len(tests)


def _normalized(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _run_case(
    prefix: list[str], drop: bool, code: str, stdin: str, expected: str, timeout_s: float, memory_mb: int
) -> bool:
    with tempfile.TemporaryDirectory(prefix="intellect-code-") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code)
        (work / "stdin").write_text(stdin)
        if drop:
            os.chmod(work, 0o755)
            os.chown(work, NOBODY, NOBODY)
        with open(work / "stdin", "rb") as fin, open(work / "stdout", "wb") as fout:
            cmd = [
                *prefix,
                sys.executable,
                "-I",
                "-c",
                _LAUNCHER,
                str(memory_mb << 20),
                str(math.ceil(timeout_s)),
                str(OUTPUT_LIMIT_BYTES),
                "1" if drop else "0",
            ]
            proc = subprocess.Popen(
                cmd, cwd=work, stdin=fin, stdout=fout, stderr=subprocess.DEVNULL, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:  # the whole group: unshare, and (through --kill-child) the PID namespace under it
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if rc != 0:
            return False
        with open(work / "stdout", "rb") as f:
            out = f.read(OUTPUT_LIMIT_BYTES).decode("utf-8", "replace")
    return _normalized(out) == _normalized(expected)
