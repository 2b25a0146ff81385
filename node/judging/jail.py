"""The jail every untrusted program and parser runs in: bubblewrap namespaces, plus limits that hold.

A peer's completion is hostile: the Python program a code task runs, and even the text math-verify parses. Each
runs as ``jailed(argv)`` in a process started as

    launcher (outside) -> joins a per-run cgroup, sets rlimits -> exec bwrap -> exec the command

- namespaces (bubblewrap 0.8, Debian package ``bubblewrap``): new user, PID, network (no route out, not even to
  the host's loopback services), IPC, UTS and cgroup namespaces; uid/gid 65534 inside; no environment; a new
  session (no terminal injection); nested user namespaces disabled; it dies with the node.
- filesystem: a read-only view of /usr (and the /bin, /lib* links or folders), of the Python installation
  running the node, and of the files a run passes in; /proc and a minimal /dev. Nothing of the node's data dir,
  keys, weights or checkpoints is visible. Every writable mount is bounded: an empty private /tmp (tmpfs of
  ``tmp_bytes``) and /dev/shm (tmpfs of ``shm_bytes``) are the only places a file can be written; the root and
  /dev (tmpfs that bubblewrap makes without a size) are remounted read-only once the view is built.
- limits: CPU seconds, address space, file size and open files by rlimit; memory and processes by a cgroup per run
  (cgroup v1 or v2, memory and pids). The cgroup is what bounds memory: it counts the pages of files written to
  tmpfs, memfds and SysV shared memory, none of which RLIMIT_AS sees, and every process of the run together.
  Wall time by the caller, which kills the whole process group. Each of these is tested to hold:
  tests/judging/test_jail.py.
- no cgroup, no jail: where the node cannot make a cgroup (not root, and no group handed to its user) ``probe()``
  reports ``works=False`` with ``MEMORY_HINT``, and nothing untrusted runs.

``probe()`` says whether the jail works here (one jailed no-op, inside a cgroup of its own), and what holds; a
run that needs it (code or math tasks) refuses to start without it, naming the fix (``Status.hint``).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
NOBODY = 65534
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_NAME = "intellect-jail"
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) and allow user "
    "namespaces (sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu 24.04+ "
    "kernel.apparmor_restrict_unprivileged_userns=0; in Docker: --security-opt seccomp=unconfined or run as root)"
)
MEMORY_HINT = (
    "untrusted programs run only inside a memory cgroup, the one limit that counts what they write to /tmp and "
    "/dev/shm and their shared memory (RLIMIT_AS does not): run the node as root (cgroup v1, or v2 with the memory "
    "and pids controllers enabled at the root), or on cgroup v1 hand the node's user two groups, once, as root: "
    f"mkdir /sys/fs/cgroup/memory/{CGROUP_NAME} /sys/fs/cgroup/pids/{CGROUP_NAME} && chown USER "
    f"/sys/fs/cgroup/memory/{CGROUP_NAME} /sys/fs/cgroup/pids/{CGROUP_NAME} (again after a reboot). A container's "
    "cgroups are read-only to it: run roles that score code or math tasks on the host"
)
CLOSE_DEADLINE_S = 10.0
"""How long closing a run waits for its processes to exit before it leaves the cgroup behind (logged)."""
_JOIN_FAILED = 125
"""The launcher's exit status when it cannot join the run's cgroup (the run never starts)."""


@dataclass(frozen=True)
class Limits:
    """One run's limits. ``tmp_bytes`` and ``shm_bytes`` size the only writable mounts (/tmp, /dev/shm); their
    pages are charged to the run's cgroup like any other memory."""

    cpu_s: int = 10
    memory_bytes: int = 512 << 20
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 32
    tmp_bytes: int = 64 << 20
    shm_bytes: int = 16 << 20


@dataclass
class Status:
    """What the jail can do on this machine (``probe``)."""

    bwrap: str | None = None
    works: bool = False
    cgroups: str = ""
    """"v1" or "v2" where the node can make a cgroup per run; "" where it cannot (then ``works`` is False)."""
    error: str = ""
    hint: str = INSTALL_HINT
    """What to do about ``error``, for the message that refuses a run."""


_LAUNCHER = r"""
import os, resource, sys
cpu, mem, fsize, nofile, cgroups = sys.argv[1:6]
for path in filter(None, cgroups.split(",")):
    try:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        sys.stderr.write(f"jail: could not join the cgroup {path}: {e}\n")
        sys.exit(JOIN_FAILED)
for limit, value in ((resource.RLIMIT_CPU, int(cpu)), (resource.RLIMIT_AS, int(mem)),
                     (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_NOFILE, int(nofile)),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_MSGQUEUE, 0)):
    resource.setrlimit(limit, (value, value))
os.execv(sys.argv[6], sys.argv[6:])
""".replace("JOIN_FAILED", str(_JOIN_FAILED))

_status: Status | None = None
_lock = threading.Lock()


def _python_roots() -> list[str]:
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable))}
    return sorted(r for r in roots if r != "/usr" and not r.startswith("/usr/"))


def _system_view() -> list[str]:
    """/usr read-only, and /bin, /sbin, /lib* as they are on this system (links on merged-/usr systems)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return args


def _cgroup_mode() -> str:
    """The hierarchy to make run cgroups in; whether this user may make them there is found by trying."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        return "v2" if {"memory", "pids"} <= set(controllers) else ""
    if (CGROUP_ROOT / "memory").is_dir() and (CGROUP_ROOT / "pids").is_dir():
        return "v1"
    return ""


class _Cgroup:
    """One run's memory and pids cgroup (v1: a group in each controller; v2: one group)."""

    def __init__(self, mode: str, limits: Limits) -> None:
        self.mode = mode
        self.dirs: list[Path] = []
        try:
            self._make(uuid.uuid4().hex[:12], limits)
        except BaseException:
            self.close()  # a memory group made before the pids group failed
            raise

    def _make(self, name: str, limits: Limits) -> None:
        mode = self.mode
        if mode == "v1":
            mem = CGROUP_ROOT / "memory" / CGROUP_NAME / name
            pids = CGROUP_ROOT / "pids" / CGROUP_NAME / name
            for d in (mem, pids):
                d.mkdir(parents=True)
                self.dirs.append(d)
            (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            swap = mem / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limits.memory_bytes))
            (pids / "pids.max").write_text(str(limits.processes))
        elif mode == "v2":
            parent = CGROUP_ROOT / CGROUP_NAME
            parent.mkdir(exist_ok=True)
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
            d = parent / name
            d.mkdir()
            self.dirs.append(d)
            (d / "memory.max").write_text(str(limits.memory_bytes))
            (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(limits.processes))

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def close(self) -> None:
        for d in self.dirs:
            _kill_all(d / "cgroup.procs", time.monotonic() + CLOSE_DEADLINE_S)
            try:
                d.rmdir()
            except OSError as e:
                logger.warning("could not remove cgroup %s: %s", d, e)


def _kill_all(procs: Path, deadline: float) -> None:
    """Kill what is left in a group (a fork bomb's stragglers, a jail's processes still exiting after bwrap was
    reaped) and wait until each has exited: a group is removable only once empty."""
    while True:
        try:
            pids = [int(p) for p in procs.read_text().split()]
        except OSError:
            return
        if not pids or time.monotonic() >= deadline:
            return
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)  # a handle on this process, not on whoever reuses its pid
            except ProcessLookupError:
                continue
            except OSError:  # no pidfds (Linux < 5.3): kill by pid; the loop reads the group again
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                exited = select.poll()  # poll, not select: the node may hold more than FD_SETSIZE descriptors
                exited.register(fd, select.POLLIN)  # readable once the process has exited
                exited.poll(max(0.0, deadline - time.monotonic()) * 1000)
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)


def jailed_command(
    command: list[str],
    limits: Limits,
    binds: list[tuple[str, str]],
    cgroup_files: list[str],
    status: Status,
    die_with_parent: bool = True,
) -> list[str]:
    """The full argv: the launcher, then bwrap, then ``command``. ``binds``: (host path, jail path), read-only.

    ``die_with_parent`` kills the jail when the *thread* that started it ends (Linux ties the parent-death signal
    to the thread): right for a run waited on where it started, wrong for a long-lived helper started from a
    worker thread (it ends when its stdin closes instead)."""
    assert status.bwrap is not None
    bwrap = [
        status.bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid",
        str(NOBODY),
        "--gid",
        str(NOBODY),
        *(["--die-with-parent"] if die_with_parent else []),
        "--new-session",
        "--clearenv",
        "--disable-userns",
        *_system_view(),
        "--proc",
        "/proc",
        # bubblewrap's /dev and root are tmpfs without a size: read-only once what they hold is in place
        "--dev",
        "/dev",
        "--size",
        str(limits.shm_bytes),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--size",
        str(limits.tmp_bytes),
        "--tmpfs",
        "/tmp",
        # after the private /tmp, which would hide a Python installed under /tmp (a venv there, a CI checkout)
        *[a for root in _python_roots() for a in ("--ro-bind", root, root)],
        *[a for host, inside in binds for a in ("--ro-bind", host, inside)],
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "LANG",
        "C.UTF-8",
        *command,
    ]
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _LAUNCHER,
        str(limits.cpu_s),
        str(limits.memory_bytes),
        str(limits.file_bytes),
        str(limits.open_files),
        ",".join(cgroup_files),
        *bwrap,
    ]


class Run:
    """One jailed process: ``proc`` and its cgroup; ``close()`` kills what is left and frees the cgroup."""

    def __init__(
        self,
        command: list[str],
        limits: Limits,
        binds: list[tuple[str, str]] | None = None,
        die_with_parent: bool = True,
        **popen: object,
    ) -> None:
        status = probe()
        if not status.works:
            raise RuntimeError(f"the jail for untrusted programs is unavailable here ({status.error}): {status.hint}")
        self.cgroup = _Cgroup(status.cgroups, limits)
        argv = jailed_command(command, limits, binds or [], self.cgroup.procs_files(), status, die_with_parent)
        try:
            self.proc = subprocess.Popen(argv, start_new_session=True, **popen)  # type: ignore[call-overload]
        except BaseException:
            self.cgroup.close()
            raise

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        self.kill()
        self.proc.wait()
        self.cgroup.close()


def probe() -> Status:
    """Whether the jail works here (probed once per process: one jailed no-op, inside a cgroup)."""
    global _status
    with _lock:
        if _status is None:
            _status = _probe()
            if _status.works:
                logger.info("jail: bubblewrap %s, cgroups=%s", _status.bwrap, _status.cgroups)
            else:
                logger.warning("jail: unavailable (%s)", _status.error)
        return _status


def _probe() -> Status:
    status = Status(bwrap=shutil.which("bwrap"))
    if status.bwrap is None:
        status.error = "bwrap not found"
        return status
    cgroup: _Cgroup | None = None
    no_cgroup = ""
    try:
        status.cgroups = _cgroup_mode()
        if status.cgroups:
            cgroup = _Cgroup(status.cgroups, Limits())
        else:
            no_cgroup = f"no cgroup hierarchy with the memory and pids controllers under {CGROUP_ROOT}"
    except OSError as e:
        no_cgroup = f"cannot make one: {e}"
    # bubblewrap is tried either way, so the message names the fix that is missing first
    argv = jailed_command(
        [sys.executable, "-I", "-S", "-c", "pass"], Limits(), [], cgroup.procs_files() if cgroup else [], status
    )
    try:
        done = subprocess.run(argv, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        status.error = repr(e)
        return status
    finally:
        if cgroup is not None:
            cgroup.close()
    stderr = done.stderr.decode(errors="replace").strip()
    if done.returncode == _JOIN_FAILED and cgroup is not None:
        no_cgroup = stderr[:300]
    elif done.returncode != 0:
        status.error = stderr[:300] or f"exit {done.returncode}"
        return status
    if no_cgroup:
        status.cgroups = ""
        status.error = f"no memory cgroup for untrusted programs ({no_cgroup})"
        status.hint = MEMORY_HINT
        return status
    status.works = True
    return status
