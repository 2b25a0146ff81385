"""The jail every untrusted program and parser runs in: bubblewrap namespaces, plus limits that hold.

A peer's completion is hostile: the Python program a code task runs, and even the text math-verify parses. Each
runs as ``jailed(argv)`` in a process started as

    launcher (outside) -> joins a per-run cgroup, sets rlimits -> exec bwrap -> exec the command

- namespaces (bubblewrap 0.8, Debian package ``bubblewrap``): new user, PID, network (no route out, not even to
  the host's loopback services), IPC, UTS and cgroup namespaces; uid/gid 65534 inside; no environment; a new
  session (no terminal injection); nested user namespaces disabled; it dies with the node.
- filesystem: a read-only view of /usr (and the /bin, /lib* links or folders), of the Python installation
  running the node, and of the files a run passes in; an empty private /tmp (tmpfs of ``tmp_bytes``); /proc and a
  minimal /dev. Nothing of the node's data dir, keys, weights or checkpoints is visible.
- limits: CPU seconds, address space, file size and open files by rlimit (measured to hold: tests/judging/
  test_jail.py); processes and memory by a cgroup per run where the node can create one (root, cgroup v1 or v2),
  else by RLIMIT_NPROC (an unprivileged node: counted per user). Wall time by the caller, which kills the whole
  process group.

``probe()`` says whether the jail works here, and what holds; a run that needs it (code or math tasks) refuses to
start without it, saying how to install it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10
    memory_bytes: int = 512 << 20
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 32
    tmp_bytes: int = 64 << 20


@dataclass
class Status:
    """What the jail can do on this machine (``probe``)."""

    bwrap: str | None = None
    works: bool = False
    cgroups: str = ""
    """"v1", "v2" or "" (then processes are bounded by RLIMIT_NPROC, memory by RLIMIT_AS alone)."""
    error: str = ""
    notes: list[str] = field(default_factory=list)


_LAUNCHER = r"""
import os, resource, sys
cpu, mem, fsize, nofile, nproc, cgroups = sys.argv[1:7]
for path in filter(None, cgroups.split(",")):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
for limit, value in ((resource.RLIMIT_CPU, int(cpu)), (resource.RLIMIT_AS, int(mem)),
                     (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_NOFILE, int(nofile)),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
if int(nproc) > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
os.execv(sys.argv[7], sys.argv[7:])
"""

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
    if os.geteuid() != 0:
        return ""
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
        name = uuid.uuid4().hex[:12]
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
            procs = d / "cgroup.procs"
            for _ in range(50):  # kill what is left (a fork bomb's stragglers), then remove the group
                try:
                    pids = [int(p) for p in procs.read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            try:
                d.rmdir()
            except OSError as e:
                logger.debug("could not remove cgroup %s: %s", d, e)


def jailed_command(command: list[str], limits: Limits, binds: list[tuple[str, str]], cgroup_files: list[str],
                   status: Status, die_with_parent: bool = True) -> list[str]:  # fmt: skip
    """The full argv: the launcher, then bwrap, then ``command``. ``binds``: (host path, jail path), read-only.

    ``die_with_parent`` kills the jail when the *thread* that started it ends (Linux ties the parent-death signal
    to the thread): right for a run waited on where it started, wrong for a long-lived helper started from a
    worker thread (it ends when its stdin closes instead)."""
    assert status.bwrap is not None
    bwrap = [
        status.bwrap, "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
        *(["--die-with-parent"] if die_with_parent else []), "--new-session", "--clearenv", "--disable-userns",
        *_system_view(),
        *[a for root in _python_roots() for a in ("--ro-bind", root, root)],
        *[a for host, inside in binds for a in ("--ro-bind", host, inside)],
        "--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp",
        "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
        *command,
    ]  # fmt: skip
    nproc = 0 if status.cgroups else limits.processes + _user_processes()
    return [
        sys.executable, "-I", "-S", "-c", _LAUNCHER,
        str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes), str(limits.open_files), str(nproc),
        ",".join(cgroup_files), *bwrap,
    ]  # fmt: skip


def _user_processes() -> int:
    """Processes this user runs now: RLIMIT_NPROC counts them all, so the jail's budget comes on top."""
    uid = os.geteuid()
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


class Run:
    """One jailed process: ``proc`` and its cgroup; ``close()`` kills what is left and frees the cgroup."""

    def __init__(self, command: list[str], limits: Limits, binds: list[tuple[str, str]] | None = None,
                 die_with_parent: bool = True, **popen: object) -> None:  # fmt: skip
        status = probe()
        if not status.works:
            raise RuntimeError(f"the jail for untrusted programs is unavailable here ({status.error}): {INSTALL_HINT}")
        self.cgroup = _Cgroup(status.cgroups, limits) if status.cgroups else None
        argv = jailed_command(command, limits, binds or [], self.cgroup.procs_files() if self.cgroup else [], status,
                              die_with_parent)  # fmt: skip
        try:
            self.proc = subprocess.Popen(argv, start_new_session=True, **popen)  # type: ignore[call-overload]
        except BaseException:
            if self.cgroup is not None:
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
        if self.cgroup is not None:
            self.cgroup.close()


def probe() -> Status:
    """Whether the jail works here (probed once per process: one jailed ``true``)."""
    global _status
    with _lock:
        if _status is None:
            _status = _probe()
            if _status.works:
                logger.info("jail: bubblewrap %s, cgroups=%s%s", _status.bwrap, _status.cgroups or "none",
                            "".join(f"; {n}" for n in _status.notes))  # fmt: skip
        return _status


def _probe() -> Status:
    status = Status(bwrap=shutil.which("bwrap"))
    if status.bwrap is None:
        status.error = "bwrap not found"
        return status
    try:
        status.cgroups = _cgroup_mode()
        if status.cgroups:
            _Cgroup(status.cgroups, Limits()).close()
    except OSError as e:
        status.notes.append(f"no cgroup ({e}): processes bounded by RLIMIT_NPROC")
        status.cgroups = ""
    if not status.cgroups:
        status.notes.append("processes bounded by RLIMIT_NPROC, memory by RLIMIT_AS per process")
    argv = jailed_command([sys.executable, "-I", "-S", "-c", "pass"], Limits(), [], [], status)
    try:
        done = subprocess.run(argv, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        status.error = repr(e)
        return status
    if done.returncode != 0:
        status.error = done.stderr.decode(errors="replace").strip()[:300] or f"exit {done.returncode}"
        return status
    status.works = True
    return status
