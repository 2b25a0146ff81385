"""Sharing a node's upload: an optional cap on it (``TokenBucket``), the children of one node kept moving
through a version together (``Lockstep``), and what really left (``on_the_wire``); used by relay.ShardServer."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
import time

from aiohttp import web

from intellect_node.aio import within

_CHUNK = 256 * 1024
_WRITTEN, _ACKED = web.RequestKey("written", int), web.RequestKey("acked", int)


def on_the_wire(request: web.Request, n: int) -> int:
    """Bytes of the response to ``request`` the peer has acknowledged since the last call, after ``n`` more were
    written: what was written less what still waits in the transport's buffer and the kernel's send queue
    (SIOCOUTQ). Counting writes instead measures the kernel's buffers: the first second of a response reads
    megabytes, and the fan-out planned from it was half again too high (measured: six children for four)."""
    written = int(request.get(_WRITTEN, 0)) + n
    request[_WRITTEN] = written
    transport = request.transport
    queued = transport.get_write_buffer_size() if transport is not None else 0
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        try:
            queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            pass
    acked = max(int(request.get(_ACKED, 0)), written - queued)
    delta = acked - int(request.get(_ACKED, 0))
    request[_ACKED] = acked
    return delta


UNSENT_LOWAT = 64 * 1024
"""Bytes of a response the kernel may hold unsent (TCP_NOTSENT_LOWAT)."""
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def bound_unsent(request: web.Request) -> None:
    """Keep at most ``UNSENT_LOWAT`` of this response waiting in the kernel (Linux, TCP_NOTSENT_LOWAT): the
    socket reads as writable only below it, so the rest waits in the process, where a relay's next bytes are
    its newest. Without it the kernel's send buffer grows to megabytes, and every byte a relay passes on
    cut-through waits behind them: a level of the tree then adds that buffer's drain time (a megabyte is 1.3 s
    for a stripe at 6.25 Mbit/s), not a round trip."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    with contextlib.suppress(OSError, ValueError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, UNSENT_LOWAT)


_SIOCOUTQNSD = 0x894B
"""Linux: bytes in a TCP socket's send queue not yet sent (TIOCOUTQ also counts those sent and not acknowledged)."""


def backlogged(request: web.Request) -> bool:
    """Whether bytes written to this response earlier still wait to be sent (in the transport's buffer or the
    kernel's send queue): the link, not the supply of bytes, is what limits this response now."""
    transport = request.transport
    if transport is None:
        return False
    if transport.get_write_buffer_size() > 0:
        return True
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQNSD, b"\0\0\0\0"))[0] > 0
    except (OSError, ValueError):
        return True  # not Linux: count the second as before


class TokenBucket:
    """Shared upload budget: at most ``rate`` bytes per second, bursts of a quarter second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(rate / 4, _CHUNK)
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class Lockstep:
    """The children of one node move through a version together: a child that asks for a shard more than ``LAG``
    places (its rank in its stripe) ahead of the furthest-behind child still asking waits (at most ``HOLD_S``).
    TCP alone shares one upload unevenly (measured with the origin's four children, one per stripe: one stripe
    at 0.4x the rate of another); a stripe's first hop sets its rate for the whole tree below, so one node's
    uneven shares become a tail for every node below it. Held back, the fast child leaves the upload to the slow
    ones. Progress is the place of the shard asked for, per child slot (node and stripe): counting requests per
    node held every child of the origin back for 4 s when a node took a second slot there mid-version (its count
    started at 0) and held a node with two slots as if it were twice as far. A child that has not asked for
    ``IDLE_S`` no longer counts.

    A child slow at its own end (a thin download), or one that asks slowly on purpose, costs the others at most
    ``HOLD_SHARE`` of their time in the version: past it they are not held again.

    The origin's only (relay.ShardServer._get): a relay's children are all in its one home stripe, and holding
    each for its slowest sibling made every level of the tree wait for one (netns, 16 nodes at 25 Mbit/s, a
    version after a warm-up: 35.0 s with it at every relay, 25.7 s at the origin alone)."""

    LAG = 2
    HOLD_S = 2.0
    IDLE_S = 5.0
    HOLD_SHARE = 0.25

    def __init__(self) -> None:
        self._asked: dict[tuple[str, int], tuple[int, float]] = {}
        """Per child slot and version: (place of the shard it last asked for, when)."""
        self._held: dict[tuple[str, int], tuple[float, float]] = {}
        """Per child slot and version: (first request, seconds held so far)."""
        self._changed = asyncio.Event()

    async def turn(self, child: str | None, version: int, place: int) -> None:
        """``child`` (a slot, ``node/stripe``) asks for the shard at ``place`` in its stripe of ``version``."""
        if child is None:
            return
        key = (child, version)
        began, held = self._held.setdefault(key, (time.monotonic(), 0.0))
        budget = self.HOLD_SHARE * (time.monotonic() - began) - held + self.HOLD_S  # the first hold is free
        started = time.monotonic()
        deadline = started + min(self.HOLD_S, max(0.0, budget))
        while (left := deadline - time.monotonic()) > 0:
            now = time.monotonic()
            others = [n for k, (n, t) in self._asked.items() if k[1] == version and k != key and now - t < self.IDLE_S]
            if not others or place <= min(others) + self.LAG:
                break
            with contextlib.suppress(TimeoutError):
                await within(self._changed.wait(), left)
        self._held[key] = (began, held + time.monotonic() - started)
        self._asked[key] = (max(place, self._asked.get(key, (0, 0.0))[0]), time.monotonic())
        if len(self._asked) > 4096:  # old versions' places
            self._asked = {k: v for k, v in self._asked.items() if k[1] >= version - 2}
            self._held = {k: v for k, v in self._held.items() if k[1] >= version - 2}
        self._changed.set()
        self._changed = asyncio.Event()
