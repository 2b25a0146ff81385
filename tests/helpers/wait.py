"""Waiting on readiness in tests: poll a condition with a deadline, never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def until(
    done: Callable[[], bool | Awaitable[bool]], what: str = "a condition", timeout: float = 60.0, every: float = 0.05
) -> None:
    """Return once ``done()`` (a plain or an async predicate) is true, polled every ``every`` seconds; raise
    ``TimeoutError`` ("timed out waiting for {what}") once ``timeout`` seconds have gone by, as ``asyncio.wait_for``
    does (a caller may expect it: a bounded wait whose outcome the test then checks)."""
    deadline = time.monotonic() + timeout
    while True:
        ok = done()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(every)
