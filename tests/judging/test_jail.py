"""The jail, attacked the way a hostile completion would: each program below tries to do harm and reports what it
could do; the jail must leave it nothing (real bubblewrap processes, real limits)."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from intellect_node.judging import jail
from intellect_node.judging.verifiers import run_code_tests


def _jailed(program: str, limits: jail.Limits | None = None, timeout: float = 30.0) -> tuple[int | None, str]:
    run = jail.Run([sys.executable, "-I", "-c", program], limits or jail.Limits(), stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out, _ = run.proc.communicate(timeout=timeout)
        return run.proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        return None, ""
    finally:
        run.close()


def test_the_jail_works_here() -> None:
    status = jail.probe()
    assert status.works, status.error


def test_a_program_sees_no_key_no_home_no_environment_and_a_private_tmp(tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    key.write_bytes(b"secret")
    os.environ["INTELLECT_SECRET_PROBE"] = "leak"
    program = f"""
import os, pathlib
print("uid", os.getuid(), os.getgid())
print("env", sorted(k for k in os.environ if k not in ("PATH", "LANG", "PWD")))
for p in ({str(key)!r}, {str(key.parent)!r}, "/etc/passwd", "/work", {str(Path.home() / ".intellect-node")!r}):
    print("sees", p, os.path.exists(p))
home = {str(Path.home())!r}
print("home", sorted(os.listdir(home)) if os.path.isdir(home) else [])
print("tmp", os.listdir("/tmp"))
open("/tmp/scratch", "w").write("x")
for p in ("/usr/evil", {sys.base_prefix + "/evil"!r}):
    try:
        open(p, "w")
        print("wrote", p)
    except OSError:
        print("read-only", p)
"""
    try:
        code, out = _jailed(program)
    finally:
        del os.environ["INTELLECT_SECRET_PROBE"]
    assert code == 0, out
    assert f"uid {jail.NOBODY} {jail.NOBODY}" in out
    assert "env []" in out
    assert "True" not in out, out  # none of the node's files, not even the path of its key
    home = out.split("home ", 1)[1].splitlines()[0]
    # at most the folder that leads to the Python installation (e.g. .pyenv), bound read-only
    assert all(sys.base_prefix.startswith(str(Path.home() / name)) for name in ast.literal_eval(home)), home
    assert "tmp []" in out and not Path("/tmp/scratch").exists()
    assert "wrote" not in out and out.count("read-only") == 2


def test_a_program_reaches_no_network() -> None:
    """A server listening on the host's loopback is out of reach (the jail has its own network namespace)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        program = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as e:
    print("refused", type(e).__name__)
"""
        code, out = _jailed(program)
    finally:
        server.close()
    assert code == 0 and "refused" in out and "connected" not in out


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind() -> None:
    """Forks until it cannot: the process limit holds (fork fails inside), the run ends, nothing outlives it."""
    program = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError:
    print("fork failed after", n)
"""
    started = time.monotonic()
    code, out = _jailed(program, jail.Limits(processes=16), timeout=30)
    assert "fork failed after" in out, out
    assert int(out.split()[-1]) < 16
    assert time.monotonic() - started < 30
    # close() killed the group and emptied the cgroup: nothing of the bomb is left
    leftovers = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""


def test_memory_and_cpu_limits_hold() -> None:
    hog = "x = bytearray(2 << 30)\nprint('allocated')\n"
    code, out = _jailed(hog, jail.Limits(memory_bytes=256 << 20))
    assert code != 0 and "allocated" not in out
    spin = "while True:\n    pass\n"
    started = time.monotonic()
    code, _ = _jailed(spin, jail.Limits(cpu_s=1), timeout=30)
    assert code is not None and code != 0 and time.monotonic() - started < 20  # SIGXCPU/SIGKILL after 1 CPU s


def test_a_code_reward_cannot_copy_the_key_into_a_served_folder(tmp_path: Path) -> None:
    """The takeover the review found: a completion copied the node key into a published version folder."""
    data = tmp_path / "data"
    (data / "weights" / "run" / "3").mkdir(parents=True)
    (data / "node.key").write_bytes(b"secret")
    program = f"""
import shutil
try:
    shutil.copy({str(data / "node.key")!r}, {str(data / "weights" / "run" / "3" / "k")!r})
    print("copied")
except OSError:
    print("failed")
"""
    assert run_code_tests(program, (("", "failed"),), timeout_s=10.0, memory_mb=256) == 1.0
    assert not (data / "weights" / "run" / "3" / "k").exists()


def test_without_bubblewrap_untrusted_code_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jail, "_status", None)
    monkeypatch.setattr(jail.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
        run_code_tests("print(1)", (("", "1"),), timeout_s=5.0, memory_mb=256)
    monkeypatch.setattr(jail, "_status", None)  # probed again, for real, by later tests
