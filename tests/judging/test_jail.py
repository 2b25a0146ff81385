"""The jail, attacked the way a hostile completion would: each program below tries to do harm and reports what it
could do; the jail must leave it nothing (real bubblewrap processes, real limits)."""

from __future__ import annotations

import ast
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from intellect_node.judging import jail
from intellect_node.judging.verifiers import run_code_tests


def _jailed(
    program: str, limits: jail.Limits | None = None, timeout: float = 30.0, args: tuple[str, ...] = ()
) -> tuple[int | None, str]:
    run = jail.Run(
        [sys.executable, "-I", "-c", program, *args],
        limits or jail.Limits(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
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
    tmp = ast.literal_eval(out.split("tmp ", 1)[1].splitlines()[0])
    # empty, but for the folder that leads to a Python installed under /tmp (a venv there), bound read-only
    assert all(sys.prefix.startswith(f"/tmp/{name}") for name in tmp), tmp
    assert not Path("/tmp/scratch").exists()
    assert "wrote" not in out and out.count("read-only") == 2


def test_the_jail_works_for_a_python_installed_under_tmp(tmp_path: Path) -> None:
    """A newcomer's venv in /tmp: the jail's private /tmp must not hide the interpreter it runs."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    probe = "from intellect_node.judging import jail; s = jail.probe(); print(s.works, s.error)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("True"), out.stdout + out.stderr


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


@pytest.mark.integration
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


# -- writable space and memory: what RLIMIT_AS does not see ---------------------------------------------------

MiB = 1 << 20
FILL_MOUNTS = r"""
import errno, os, sys
target = int(sys.argv[1])
chunk = b"x" * (1 << 20)
mounts = sorted({line.split()[1] for line in open("/proc/self/mounts")})
for mount in mounts:  # every mount point, so a writable mount added later is tried too
    written, i, err = 0, 0, "target"
    try:
        while written < target:  # file after file: one file stops at RLIMIT_FSIZE
            with open(os.path.join(mount, "fill%d" % i), "wb", buffering=0) as f:
                i += 1
                try:
                    while written < target:
                        written += f.write(chunk)
                except OSError as e:
                    if e.errno != errno.EFBIG:
                        raise
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
    print(mount, written, err, flush=True)
    for j in range(i):
        try:
            os.unlink(os.path.join(mount, "fill%d" % j))
        except OSError:
            pass
"""
FILL_MEMORY = r"""
import ctypes, errno, os, sys
target, where = int(sys.argv[1]), sys.argv[2]
chunk = b"x" * (1 << 20)
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p

def fill_file(fd, written):  # up to RLIMIT_FSIZE
    try:
        while written < target:
            written += os.write(fd, chunk)
            print(written, flush=True)
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
    return written

def fill_sysv(written):  # a segment outlives its detach: RLIMIT_AS sees it only while attached
    sid = libc.shmget(0, len(chunk), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    addr = libc.shmat(sid, None, 0) if sid >= 0 else None
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmget/shmat")
    ctypes.memset(addr, 120, len(chunk))
    libc.shmdt(ctypes.c_void_p(addr))
    print(written + len(chunk), flush=True)
    return written + len(chunk)

written, i, files = 0, 0, []
try:
    while written < target:  # SysV segments, memfds, or files in a folder
        if where == "sysv":
            written = fill_sysv(written)
            continue
        if where == "memfd":
            files.append(os.memfd_create("fill%d" % i))
        else:
            files.append(os.open(os.path.join(where, "fill%d" % i), os.O_WRONLY | os.O_CREAT))
        i += 1
        written = fill_file(files[-1], written)
except OSError as e:
    print("stopped", errno.errorcode.get(e.errno), flush=True)
print("done", written, flush=True)
"""


def _mount_fill(out: str) -> dict[str, tuple[int, str]]:
    fills = {}
    for line in out.splitlines():
        mount, written, err = line.split()
        fills[mount] = (int(written), err)
    return fills


def _assert_only_capped_mounts_take_data(fills: dict[str, tuple[int, str]], limits: jail.Limits) -> None:
    caps = {"/tmp": limits.tmp_bytes, "/dev/shm": limits.shm_bytes}
    assert set(caps) <= set(fills), fills
    for mount, (written, err) in fills.items():
        if mount in caps:  # filled to its size, then "no space"
            assert (written, err) == (caps[mount], "ENOSPC"), (mount, written, err)
        else:  # the root, /dev, /proc, the read-only views: not one byte
            assert written == 0 and err != "target", (mount, written, err)


def test_every_writable_mount_is_bounded() -> None:
    """A program fills every mount point it can see: only /tmp and /dev/shm take data, each up to its size
    (bubblewrap makes the root and /dev as tmpfs without a size: up to half the machine's memory each)."""
    limits = jail.Limits(tmp_bytes=8 * MiB, shm_bytes=4 * MiB)
    code, out = _jailed(FILL_MOUNTS, limits, args=(str(64 * MiB),))
    assert code == 0, out
    _assert_only_capped_mounts_take_data(_mount_fill(out), limits)


def test_without_a_memory_cgroup_code_rewards_are_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A machine where no cgroup can be made (here: a cgroup root with no controllers): bubblewrap works, but the
    jail refuses, since nothing would count the files a program writes to memory."""
    monkeypatch.setattr(jail, "_status", None)
    monkeypatch.setattr(jail, "CGROUP_ROOT", tmp_path)
    status = jail.probe()
    assert not status.works and status.cgroups == "" and status.hint == jail.MEMORY_HINT, status
    assert "no memory cgroup" in status.error
    with pytest.raises(RuntimeError, match="memory cgroup.*chown"):
        run_code_tests("print(1)", (("", "1"),), timeout_s=5.0, memory_mb=256)
    monkeypatch.setattr(jail, "_status", None)  # probed again, for real, by later tests


# As another user: the node's uid (the Docker image runs as 10001) is not root, so it cannot make cgroups unless
# root hands it some. The child loads this checkout's jail.py from its source (a non-root user may not read the
# test's interpreter or site-packages) and reports, as JSON, the probe and what each jailed program printed.
OTHER_UID = 65534
_CHILD = r"""
import importlib.util, json, os, subprocess, sys
source, cgroup_name, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spec = importlib.util.spec_from_loader("jail_under_test", loader=None)
jail = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = jail
exec(compile(source, "jail.py", "exec"), jail.__dict__)
jail.CGROUP_NAME = cgroup_name
status = jail.probe()
report = {"uid": os.getuid(), "works": status.works, "cgroups": status.cgroups,
          "error": status.error, "hint": status.hint, "runs": []}
for program, args, limits in runs:
    try:
        run = jail.Run([sys.executable, "-I", "-c", program, *args], jail.Limits(**limits),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except RuntimeError as e:
        report["runs"].append({"refused": str(e)})
        continue
    try:
        out, _ = run.proc.communicate(timeout=60)
    finally:
        run.close()
    report["runs"].append({"rc": run.proc.returncode, "out": out.decode(errors="replace")})
print(json.dumps(report))
"""
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="running the node as another user needs root")


def _as_other_user(cgroup_name: str, runs: list[tuple[str, list[str], dict[str, int]]]) -> dict:
    """The child above, as ``OTHER_UID``, with the first Python that user may run."""
    setpriv = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
    source = Path(jail.__file__).read_text()
    # setpriv execs with root's capabilities still in effect: the interpreter checks what its user may run
    usable = "import os, sys; sys.exit(not (os.access(sys.executable, os.X_OK) and os.access(os.__file__, os.R_OK)))"
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
        if subprocess.run([*setpriv, python, "-I", "-S", "-c", usable], capture_output=True).returncode == 0:
            break
    else:
        pytest.skip(f"no Python that uid {OTHER_UID} may run")
    done = subprocess.run(
        [*setpriv, python, "-I", "-c", _CHILD, source, cgroup_name, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] == OTHER_UID
    return report


@as_root
def test_a_node_that_is_not_root_refuses_untrusted_programs_with_the_fix() -> None:
    """Not root, no cgroup handed to it: the probe says so and a run refuses, naming the fix, instead of running
    under RLIMIT_AS alone, which lets a program fill /dev/shm, /tmp, memfds and shared memory past its limit."""
    fill = (FILL_MEMORY, [str(64 * MiB), "/dev/shm"], {"memory_bytes": 32 * MiB})
    report = _as_other_user(f"{jail.CGROUP_NAME}-absent-{uuid.uuid4().hex[:8]}", [fill])
    assert not report["works"] and report["cgroups"] == "", report
    assert "no memory cgroup" in report["error"] and report["hint"] == jail.MEMORY_HINT
    (run,) = report["runs"]
    assert "refused" in run and jail.MEMORY_HINT in run["refused"], run


def _v1_controllers() -> list[Path]:
    return [jail.CGROUP_ROOT / "memory", jail.CGROUP_ROOT / "pids"]


def _remove_cgroups(top: Path) -> None:
    """Kill what is left in ``top`` and its children, wait until each has exited, then remove them (deepest
    first). The child's runs close their own groups: this is for a test that failed half-way."""
    for group in sorted(top.glob("**/"), key=lambda d: len(d.parts), reverse=True):
        for pid in [int(p) for p in (group / "cgroup.procs").read_text().split()]:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                select.select([fd], [], [], 10.0)  # readable once the process has exited
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)
        group.rmdir()


@as_root
@pytest.mark.skipif(not all(d.is_dir() for d in _v1_controllers()), reason="handing a user a cgroup: cgroup v1")
def test_a_node_that_is_not_root_is_bounded_by_the_cgroup_it_is_handed() -> None:
    """Root hands the node's user two cgroup v1 groups (the fix MEMORY_HINT names): the jail works as that user,
    every writable mount stays bounded, and files in tmpfs, memfds and SysV shared memory, which RLIMIT_AS does not
    count, are stopped at the memory limit."""
    name = f"{jail.CGROUP_NAME}-test-{uuid.uuid4().hex[:8]}"
    groups = [d / name for d in _v1_controllers()]
    try:
        for group in groups:
            group.mkdir()
            os.chown(group, OTHER_UID, OTHER_UID)
        mounts = {"tmp_bytes": 8 * MiB, "shm_bytes": 4 * MiB}
        memory = {"memory_bytes": 96 * MiB, "tmp_bytes": 512 * MiB}
        report = _as_other_user(
            name,
            [
                (FILL_MOUNTS, [str(64 * MiB)], mounts),
                (FILL_MEMORY, [str(384 * MiB), "/tmp"], memory),  # /tmp larger than the memory limit
                (FILL_MEMORY, [str(384 * MiB), "memfd"], memory),
                (FILL_MEMORY, [str(384 * MiB), "sysv"], memory),
            ],
        )
    finally:
        for group in groups:
            _remove_cgroups(group)
    assert not any(group.exists() for group in groups)
    assert report["works"] and report["cgroups"] == "v1", report
    fill_mounts, *fills = report["runs"]
    assert fill_mounts.get("rc") == 0, fill_mounts
    _assert_only_capped_mounts_take_data(_mount_fill(fill_mounts["out"]), jail.Limits(**mounts))
    for run in fills:
        assert "rc" in run, run
        lines = run["out"].split()
        written = max([int(w) for w in lines if w.isdigit()], default=0)
        # killed by the cgroup (or refused a page) near the limit: Python's own pages count too
        assert run["rc"] != 0 or "stopped" in lines, run["out"][-300:]
        assert memory["memory_bytes"] // 2 < written < memory["memory_bytes"], run["out"][-300:]
