"""Timeouts that never lose a cancellation, and waits that back off.

On Python 3.11 ``asyncio.wait_for`` returns its operation's result (or raises its error) when a cancellation
arrives in the same loop iteration as the operation completes: the cancellation is gone. A loop that then sleeps
and goes on keeps a stopping node alive for ever (a trainer sent SIGTERM just as its DHT record is stored runs on,
its task group waiting on that loop). ``asyncio.timeout`` has no inner task, so a cancellation always reaches the
awaiting task; every timeout in the node goes through ``within``.

``Backoff``: what a node waits between tries of something that keeps failing (a trainer that is down, or busy).
"""

from __future__ import annotations

import asyncio
import random
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


class Backoff:
    """Waits that double from ``first`` to ``cap`` seconds while an action keeps failing, each drawn between half
    and all of the current one (nodes that failed together do not try again in step); ``reset`` after a success.
    A producer that sent its batch every 250 ms to a trainer that was down, or busy, made 457 refusals for 4
    accepted batches in one demo, and four log lines a second."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap
        self.failures = 0
        """Failures in a row since the last success."""

    def next(self) -> float:
        """One more failure: the seconds to wait before the next try."""
        self.failures += 1
        current = min(self.cap, self.first * 2 ** min(self.failures - 1, 30))
        return random.uniform(current / 2, current)

    def reset(self) -> int:
        """A success: the failures in a row there had been before it."""
        failures, self.failures = self.failures, 0
        return failures
