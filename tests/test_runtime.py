"""A node stops when told to: no timeout may swallow the cancellation that SIGTERM starts (the trainer once ran on
after SIGTERM, its task group waiting on a DHT loop whose ``wait_for`` had returned the store's result instead), and
a part that loses it anyway costs seconds, with a dump of what it waited on, never a hung node."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from intellect_node.aio import within

ROOT = Path(__file__).resolve().parents[1]


def test_a_cancellation_that_comes_as_the_operation_completes_is_kept() -> None:
    async def main() -> None:
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        after: list[str] = []

        async def loop_forever() -> None:
            while True:
                await within(done, 5)
                after.append("went on")
                await asyncio.sleep(3600)

        task = asyncio.create_task(loop_forever())
        await asyncio.sleep(0)  # the task now waits on ``done``
        done.set_result(1)  # completes, and in the same loop iteration...
        task.cancel()  # ...the node is told to stop
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert after == []

    asyncio.run(main())


def test_a_timeout_still_times_out() -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(3600), 0.05)
        assert await within(asyncio.sleep(0, "x"), 1) == "x"

    asyncio.run(main())


def test_the_node_never_uses_wait_for() -> None:
    """``asyncio.wait_for`` loses cancellations on Python 3.11; the node's code uses ``within``."""
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("node", "protocol", "kernels")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bwait_for\(", line) and "def " not in line
    ]
    assert not found, found


def test_a_part_that_swallows_its_cancellation_costs_seconds_not_a_hung_node(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        from intellect_node import runtime

        runtime.STOP_GRACE_S = 1.0

        async def stubborn() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # as a library's wait_for does when its operation completes at that moment
            await asyncio.sleep(3600)

        async def main() -> None:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(stubborn())
                print("ready", flush=True)

        runtime.run_until_signalled(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "still stopping after 1 s" in err
    assert "stubborn (" in err  # the dump names where the stuck task waited


def test_a_stop_does_not_wait_for_a_thread_still_working() -> None:
    """A trainer sent SIGTERM during a training step (``asyncio.to_thread``, ~50 s with SmolLM2 on two cores) waited
    for the step to end: ``asyncio.run`` joins those threads at its end. The node ends without them."""
    script = textwrap.dedent(
        """
        import asyncio, time
        from intellect_node import runtime

        async def main() -> None:
            started = asyncio.get_running_loop().create_future()

            def step() -> None:
                started.get_loop().call_soon_threadsafe(started.set_result, None)
                time.sleep(120)

            work = asyncio.ensure_future(asyncio.to_thread(step))
            await started
            print("ready", flush=True)
            await work

        runtime.run_until_signalled(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)  # the thread sleeps 120 s: exiting here means it was not waited for
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
