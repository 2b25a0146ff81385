"""Start nodes as OS processes and wait on their readiness line: used by the demo and the tests.

A node prints ``READY {json}`` once it serves; ``NodeProcess.wait_ready`` returns that JSON. Output goes to a log
file (stderr) and is scanned line by line (stdout); nothing here waits on a fixed sleep.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from intellect_node.runtime import READY_PREFIX


def join_argv(role: str, ready: dict[str, Any], data_dir: Path, *extra: str) -> list[str]:
    """The arguments of ``intellect-node join`` for a ``role`` node of the run whose trainer printed ``ready``."""
    return [
        "join",
        "--role",
        role,
        "--peers",
        ready["p2p_maddrs"][0],
        "--run-id",
        ready["run_id"],
        "--data-dir",
        str(data_dir),
        *extra,
    ]


class NodeExited(RuntimeError):
    pass


class NodeProcess:
    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
        prefix: list[str] | None = None,
        stdin: int | None = None,
    ) -> None:
        """Run ``prefix + command + argv``; ``command`` defaults to the ``intellect-node`` CLI of this Python,
        ``prefix`` can place it elsewhere (``ip netns exec NS``)."""
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.stdout_path = log_dir / f"{name}.out"
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        command = command or [sys.executable, "-m", "intellect_node.cli"]
        self.proc = subprocess.Popen(
            [*(prefix or []), *command, *argv],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            start_new_session=True,  # a Ctrl-C to the demo is handled by the demo, which stops its nodes
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ready: dict[str, Any] | None = None
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _pump(self, stream: IO[bytes]) -> None:
        with open(self.stdout_path, "w") as copy:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip("\n")
                copy.write(line + "\n")
                copy.flush()
                self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with ``prefix``; raises if the process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                # its output may stay open after it died (killed by the OOM killer, say): children that inherited
                # it outlive it for a moment, or for ever if one misbehaves; the process itself is what counts
                if self.proc.poll() is not None:
                    line = None
                elif time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.name}: no line starting {prefix!r} within {timeout}s") from None
                else:
                    continue
            if line is None:
                raise NodeExited(f"{self.name} exited with {self.proc.wait()}; see {self.log_path}\n{self.tail()}")
            if line.startswith(prefix):
                return line

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        self.ready = json.loads(self.wait_for_line(READY_PREFIX, timeout)[len(READY_PREFIX) :])
        return self.ready

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def terminate(self) -> None:
        """Ask the node to shut down (SIGTERM); ``stop`` waits for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL the whole process group (the node's DHT and p2pd children too)."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.wait()
        self._reader.join(timeout=5)
        self._log.close()
        return code
