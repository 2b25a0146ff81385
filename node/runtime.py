"""What every role's process shares: the startup banner, the READY line, signal handling."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from intellect_node import __version__

logger = logging.getLogger(__name__)
READY_PREFIX = "READY "
STOP_GRACE_S = 15.0
LOCK_NAME = "node.lock"
_held_locks: list[int] = []
"""The data dir locks this process holds (their descriptors stay open as long as it lives)."""


def lock_data_dir(path: Path) -> None:
    """Hold ``path``'s lock for as long as this process lives, or exit saying which process holds it. Two nodes on
    one data dir run as one identity (each one's batches refused as duplicates of the other's) and overwrite each
    other's saved HTTP URL (``intellect-node status`` then asks a dead port); two containers on the README's volume
    name are the easy way there. A POSIX record lock (``fcntl.lockf``): the kernel drops it when the process ends,
    however it ends (a restart after ``kill -9`` finds it free), a forked child (the DHT process) does not inherit
    it, and it holds between containers that share the volume. The file names the holder: its pid and host name
    (a container's id, in Docker), for the message only."""
    lock = path / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.read(fd, 256).decode(errors="replace").split()
        except OSError:
            holder = []
        os.close(fd)
        who = f"process {holder[0]} on {holder[1]}" if len(holder) >= 2 else "another process"
        raise SystemExit(
            f"intellect-node: --data-dir {path} is in use by {who}: one node per data dir (they would run as one "
            "identity). Stop that node first, or give this one its own --data-dir (in Docker, its own volume: "
            "-v intellect-data-2:/data)"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _held_locks.append(fd)


@functools.cache
def _libc() -> Any:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Make glibc give freed memory back to the system, before the node allocates much: a training step's transient
    gigabyte (logits, activations) otherwise stays resident after it, held by the allocator (tensors up to its dynamic
    32 MiB mmap threshold live in heap arenas, one arena per thread), and the next part's peak comes on top. Blocks over
    1 MiB are mapped and unmapped on their own; two arenas. Elsewhere than glibc: nothing to do."""
    import ctypes

    libc = _libc()
    if libc is None:
        return
    for option, value in ((-3, 1 << 20), (-1, 16 << 20), (-8, 2)):  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_ARENA_MAX
        libc.mallopt(ctypes.c_int(option), ctypes.c_int(value))


def trim_freed() -> None:
    """After a phase that allocated much in small blocks (a training step, a judged batch, a generated one): the
    free parts of the heap go back to the system (``malloc_trim``), not held for this process alone: a SmolLM2
    step leaves ~650 MB so held otherwise (docs/training.md, "Memory: the demo in 4 GB"); this takes milliseconds."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def announce(role: str, node_id: str, run_id: str, info: dict[str, Any]) -> None:
    """Print the banner for people and one ``READY {json}`` line for scripts (tests, the demo)."""
    addrs = " ".join(info.get("p2p_maddrs", []))
    print(
        f"intellect-node {__version__} role={role} node_id={node_id} run_id={run_id}\n"
        f"  p2p: {addrs}\n  http: {info.get('status_url', '')}",
        flush=True,
    )
    reach = info.get("reachability") or {}
    if reach.get("checked"):
        p2p, http = ("yes" if reach[k] else "NO" for k in ("p2p", "http"))
        print(
            f"  reachable from outside (as the trainer sees it, from {reach['observed_ip']}): p2p {p2p}, http {http}",
            flush=True,
        )
        if reach.get("fix"):
            print(f"  {reach['fix']}", flush=True)
    elif reach.get("fix"):
        print(f"  reachable from outside: not checked\n  {reach['fix']}", flush=True)
    if "join" in info:
        print(f"Volunteers join this run with:\n  {info['join']}", flush=True)
    ready = {"role": role, "node_id": node_id, "run_id": run_id, **info}
    print(READY_PREFIX + json.dumps(ready), flush=True)


def dump_tasks() -> None:
    """``kill -USR1 <pid>``: every asyncio task of the node and where it waits, to the log (a node that seems stuck
    tells what it is waiting for, without stopping it)."""
    tasks = asyncio.all_tasks()
    lines = [f"{len(tasks)} tasks:"]
    for task in tasks:
        frames = task.get_stack()
        where = " <- ".join(
            f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})" for f in reversed(frames)
        )
        lines.append(f"  {task.get_name()}: {where or 'not started'}")
    logger.warning("\n".join(lines))


def _run_loop(main: Coroutine[Any, Any, None], join_threads: bool) -> None:
    """``asyncio.run`` on uvloop (where installed), except that without ``join_threads`` the end does not wait for
    the threads of ``asyncio.to_thread`` still running: ``asyncio.run`` joins them, and a trainer sent SIGTERM during
    a training step waited for the step to end (~50 s with SmolLM2 on two cores) before it exited. What such a thread
    did not finish is not durable yet, and what is durable is on disk (checkpoints and spool appends are atomic or
    replayed): the node ends without it."""
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        try:
            rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in rest:
                task.cancel()
            if rest:
                loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            if join_threads:
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # the default executor is shut down without waiting for its threads


def run_until_signalled(main: Coroutine[Any, Any, None], hard_exit: bool = True) -> None:
    """Run ``main`` on uvloop; SIGINT/SIGTERM cancel it, so its ``finally`` blocks drain and close.

    With ``hard_exit`` the process then ends at once (``os._exit``) with 0, or 1 after an error: a thread still
    blocked on a DHT process that a signal to the whole process group has killed must not keep the node alive
    (the interpreter joins its worker threads at exit, and would wait on that one forever)."""

    async def _runner() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        runner = asyncio.current_task()
        overdue: list[asyncio.TimerHandle] = []

        def stop() -> None:
            task.cancel()
            if not overdue:
                overdue.append(loop.call_later(STOP_GRACE_S, still_stopping))

        def still_stopping() -> None:
            """A part that lost its cancellation (a library's ``wait_for``) costs STOP_GRACE_S, never a hung node:
            every task is cancelled again (a task group that is already stopping would not pass it on)."""
            logger.warning("still stopping after %.0f s; cancelling every task again", STOP_GRACE_S)
            dump_tasks()
            for other in asyncio.all_tasks():
                if other is not runner:
                    other.cancel()
            overdue.append(loop.call_later(STOP_GRACE_S, still_stopping))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
        try:
            await task
        except asyncio.CancelledError:
            logger.info("stopped by signal")

    code = 0
    try:
        _run_loop(_runner(), join_threads=not hard_exit)
    except SystemExit as e:
        if not hard_exit:
            raise
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 1
    except (ValueError, OSError) as e:
        if not hard_exit:
            raise
        print(f"intellect-node: {e}", file=sys.stderr)
        code = 1
    except BaseException:
        if not hard_exit:
            raise
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if hard_exit:
        logging.shutdown()
        _end_children()
        os._exit(code)


def _end_children(grace_s: float = 3.0) -> None:
    """Every process this node started dies with it: os._exit skips the finalizers that would stop them (vLLM's
    engine core would outlive its node, holding its memory, until killed by hand)."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            child.terminate()
        _, alive = psutil.wait_procs(children, timeout=grace_s)
        for child in alive:
            child.kill()
    except Exception:  # the process table may change under us; nothing here may stop the exit
        pass
