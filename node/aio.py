"""Timeouts that never lose a cancellation.

On Python 3.11 ``asyncio.wait_for`` returns its operation's result (or raises its error) when a cancellation
arrives in the same loop iteration as the operation completes: the cancellation is gone. A loop that then sleeps
and goes on keeps a stopping node alive for ever (a trainer sent SIGTERM just as its DHT record is stored runs on,
its task group waiting on that loop). ``asyncio.timeout`` has no inner task, so a cancellation always reaches the
awaiting task; every timeout in the node goes through ``within``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(operation: Awaitable[T], seconds: float | None) -> T:
    """``await operation``, raising ``TimeoutError`` after ``seconds`` (``None``: no limit)."""
    async with asyncio.timeout(seconds):
        return await operation


def raise_if_cancelled() -> None:
    """After catching an error: re-raise a cancellation that came meanwhile (one that a library's own
    ``wait_for`` turned into its operation's error, say), so a loop that logs errors and goes on still stops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
