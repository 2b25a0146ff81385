"""Sharing a node's upload: an optional cap on it (``TokenBucket``), what really left (``on_the_wire``,
``backlogged``), how much may wait unsent (``bound_unsent``) and equal shares of the link (``FairShare``); used by
relay.ShardServer.

No receiver waits for its siblings: a shard is sent when asked for, however far ahead of the others its receiver
is. A wait for the slowest sibling adds that sibling's delays at every level of the tree, and a sibling slow for
its own reasons (a request's round trip, a thin download) leaves the upload idle; TCP's uneven sharing of a link
is evened out by pacing instead (``FairShare``). (docs/weights.md, "No lockstep"; measured: benchmarks/broadcast.py,
docs/notes/stripes-history.md.)"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable

from aiohttp import web

_CHUNK = 256 * 1024
_WRITTEN, _ACKED = web.RequestKey("written", int), web.RequestKey("acked", int)


def on_the_wire(request: web.Request, n: int) -> int:
    """Bytes of the response to ``request`` the peer has acknowledged since the last call, after ``n`` more were
    written: what was written less what still waits in the transport's buffer and the kernel's send queue
    (SIOCOUTQ). Counting writes would measure the kernel's buffers: the first second of a response reads
    megabytes, and a fan-out planned from it is half again too high (docs/weights.md, "Fan-out from the measured
    upload")."""
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


VERIFIED_HEADER = "X-Intellect-Verified"
"""'0' on a shard relayed cut-through, before this node verified it (the receiver verifies it in any case)."""


async def respond(request: web.Request, size: int, cut_through: bool = False) -> tuple[web.StreamResponse, int, int]:
    """The prepared response to a shard request for ``size`` bytes, and the range it is to send (start, stop):
    the Range asked for, or all. ``cut_through`` (a shard still arriving): only "bytes=N-" or none, marked
    unverified; any other range is a 404 (the receiver retries later)."""
    try:
        rng = request.http_range
    except ValueError:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"}) from None
    start = rng.start or 0
    if cut_through and (rng.stop is not None or start < 0 or start >= size):
        raise web.HTTPNotFound()
    if start < 0:
        start = max(0, size + start)
    stop = size if rng.stop is None else min(rng.stop, size)
    ranged = rng.start is not None or rng.stop is not None
    if ranged and start >= stop:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
    if cut_through:
        headers[VERIFIED_HEADER] = "0"
    if ranged:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    resp = web.StreamResponse(status=206 if ranged else 200, headers=headers)
    resp.content_length = stop - start
    await resp.prepare(request)
    bound_unsent(request)
    return resp, start, stop


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
        return True  # not Linux: the kernel does not say, so the second counts as limited by the link


PACE_SHARE = 1.1
"""A response the link limits beside others it limits is paced at this share of its part of the link: above 1, so
that a share not taken for a moment (a receiver's pause between two shards) is not the link's loss."""
_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
_UNPACED = 0xFFFFFFFF
_PACED = web.RequestKey("paced", int)


class FairShare:
    """Responses the link limits get about equal parts of it: each is paced by the kernel (Linux,
    SO_MAX_PACING_RATE) at ``PACE_SHARE`` of the link's recent peak over the number of them. TCP alone shares one
    link very unevenly (four equal transfers through one shaped link end up to a third apart), and in the relay
    tree that unevenness is time lost: the origin's stripe done last arrives at its root at the end at the full
    rate of the origin's link, and the root passes it on at its share of its own; a root's child fed at half its
    siblings' rate starves the subtree below it. Shares are per receiver, not per response: a fetcher takes a
    stripe's shards two at a time, and receivers with one or two responses from moment to moment get equal shares
    only so. (docs/weights.md, "Equal shares of a link"; measured: docs/notes/stripes-history.md.)

    A response counts while its bytes are here (a whole shard, or cut-through with more waiting than the chunk written:
    relay._write); one that waits for its bytes (cut-through at a stripe's pace) is not limited by the link and is not
    counted, and a single one is never paced. (Whether the kernel holds its bytes unsent does not tell: a saturated
    link's queue is past the socket, in a shaper or the modem.) The shares are weighed by each receiver's place in its
    stripe (``_catch_up``). Nor does a receiver that moves at under ``SLOW`` of an equal share hold the others to that
    share, if it holds itself back (its window was the limit: it reads slowly; TCP_INFO's ``rwnd_limited``, where the
    kernel tells) or has been that slow for ``SLOW_FOR_S`` (its path is thin elsewhere): what it leaves is theirs. Else
    a member's grudge, children or alternates that read a byte a second, would pace a node's honest children down to a
    fraction of its link. A receiver slow for neither reason is one TCP starved beside its siblings, and it is their
    equal: left out, it stays starved while the others take its share. Pure bookkeeping but for ``pace``."""

    SLOW = 0.5
    SLOW_FOR_S = 3.0
    CATCH_UP = 1.0
    """Shards: a receiver this far behind the others' mean place in its stripe gets ``MAX_EXTRA`` more than an
    equal share (less in proportion), one as far ahead as much less (at most half as much)."""
    MAX_EXTRA = 0.5
    KEEPS_UP = 0.8
    """Only receivers moving at this share of an equal share at least are weighed by place (the others get an
    equal share): more to one that cannot use it would leave the link idle (a thin path, a grudge)."""
    TAU_S = 1.0
    """Time constant of each response's rate estimate (it is written to every 256 KiB: 0.1 s at 20 Mbit/s)."""

    def __init__(self, peak: Callable[[float], float] | None = None) -> None:
        self._rate: dict[int, tuple[str, float, float, int | None, bool]] = {}
        """Response (its id) the link limits -> (its receiver, bytes/s it moved lately, when last told, its
        connection's rwnd_limited then, whether its receiver's window held it back since the time before)."""
        self._slow_since: dict[str, float] = {}
        self._peak = peak
        """The link's recent peak (bytes/s) at a time: given, the responses left are paced again the moment
        one joins or leaves the count (``repace``)."""
        self._requests: dict[int, web.Request] = {}
        self._reached: dict[str, tuple[int, float]] = {}
        """Receiver -> the furthest (version, place in its stripe, in shards) we have sent it (``update``)."""
        self._moved: dict[str, tuple[float, float]] = {}
        """Receiver -> (bytes/s it moved lately over all its responses while it had one, when last told): with one
        response at a time each starts at 0 in ``_rate``, and its rate there reads low for most of each shard;
        the pauses between its requests (a round trip, 0.1-0.4 s through busy uplinks) are not counted either:
        the receiver they hold back is the one that needs to catch up."""

    def update(
        self,
        request: web.Request,
        pressing: bool,
        sent: int = 0,
        now: float = 0.0,
        who: str = "",
        rwnd_us: int | None = None,
        place: tuple[int, float] | None = None,
    ) -> None:
        """``sent`` more bytes of this response reached its receiver ``who`` by ``now``; ``pressing``: its bytes are
        here (the link, not their supply, limits it); ``rwnd_us``: ``rwnd_limited_us`` of its connection now (None:
        not known, as if held back); ``place``: (version, how far along its stripe the response is, in shards:
        ``place_in_stripe``), for a child's. The furthest a receiver reached counts, so asking again for an old
        shard does not look behind."""
        key = id(request)
        if place is not None and place > self._reached.get(who, (-1, 0.0)):
            self._reached[who] = place
        moved, told = self._moved.get(who, (0.0, now))
        if key not in self._rate and all(w != who for w, *_ in self._rate.values()):
            told = now  # its first bytes since a while with nothing in flight to it: the pause is not its rate
        if now > told:
            moved += (sent / (now - told) - moved) * min(1.0, (now - told) / self.TAU_S)
        self._moved[who] = (moved, max(now, told))
        if not pressing:
            self.done(request, now)
            return
        joins = key not in self._rate
        _, rate, at, was_us, held = self._rate.get(key, (who, 0.0, now, rwnd_us, False))
        if now > at:
            rate += (sent / (now - at) - rate) * min(1.0, (now - at) / self.TAU_S)
            held = rwnd_us is None or was_us is None or rwnd_us - was_us >= 0.5e6 * (now - at)
        self._rate[key] = (who, rate, now, rwnd_us, held)
        self._requests[key] = request
        if joins:
            self.repace(now)

    def done(self, request: web.Request, now: float | None = None) -> None:
        if self._rate.pop(id(request), None) is not None:
            self._requests.pop(id(request), None)
            self.repace(time.monotonic() if now is None else now)

    def repace(self, now: float) -> None:
        """Pace every response counted at its share now. Each is otherwise paced again only at its next write (a
        256 KiB chunk: 0.7 s at half of a quarter of 25 Mbit/s), so when one of a receiver's two responses ends the
        other would go on at half the receiver's share until then, and part of the link would stand idle."""
        if self._peak is None:
            return
        peak, caps = self._peak(now), {}
        for key, request in list(self._requests.items()):
            who = self._rate[key][0]
            if who not in caps:
                caps[who] = self.cap(peak, now, who)
            pace(request, caps[who])

    def cap(self, peak_bps: float, now: float = 0.0, who: str = "") -> float | None:
        """Bytes/s a response to ``who`` may send: an equal share per receiver (a node fetching two shards at
        once gets no more than one fetching one), split among its responses. None (no cap) with one receiver
        or no peak measured."""
        per: dict[str, float] = {}
        count: dict[str, int] = {}
        held: set[str] = set()
        for w, r, at, _, h in self._rate.values():
            # one not written to for a while (its receiver does not read) moved at most that much over the while
            per[w] = per.get(w, 0.0) + r * min(1.0, self.TAU_S / max(1e-9, now - at))
            count[w] = count.get(w, 0) + 1
            if h:
                held.add(w)
        n = len(per)
        if n < 2 or peak_bps <= 0:
            return None
        low = [w for w, r in per.items() if r < self.SLOW * peak_bps / n]
        for w in per:  # kept between a receiver's responses: each new one starts at 0, its slowness does not
            if w in low:
                self._slow_since.setdefault(w, now)
            else:
                self._slow_since.pop(w, None)
        if len(self._slow_since) > 1024:  # receivers long gone (alternates by address are many)
            self._slow_since = {w: t for w, t in self._slow_since.items() if w in per or now - t < 60.0}
        if len(self._reached) > 1024 or len(self._moved) > 1024:
            self._reached = {w: r for w, r in self._reached.items() if w in per}
            self._moved = {w: r for w, r in self._moved.items() if w in per}
        slow = {w for w in low if w in held or now - self._slow_since[w] >= self.SLOW_FOR_S}
        if len(slow) == n:
            return None
        left = peak_bps - sum(per[w] for w in slow)
        weight = self._catch_up([w for w in per if w not in slow], now, left / (n - len(slow)))
        return PACE_SHARE * left * weight.get(who, 1.0) / sum(weight.values()) / max(1, count.get(who, 0))

    def _catch_up(self, fair: list[str], now: float, equal: float) -> dict[str, float]:
        """Each receiver's weight in the link's split: 1, or, among those whose place we know, more to one behind
        the others' mean place in the current version and less to one ahead. Equal shares alone keep whatever lag a
        receiver took (a first shard late, a few seconds slower), and the subtree of the root behind, starved
        meanwhile, ends last (docs/notes/weights-findings.md, "A receiver behind catches up")."""
        weight = dict.fromkeys(fair, 1.0)

        def moving(w: str) -> float:  # its rate, decayed over a while not told (it read nothing)
            r, at = self._moved.get(w, (0.0, now))
            return r * min(1.0, self.TAU_S / max(1e-9, now - at))

        known = {w: self._reached[w] for w in fair if w in self._reached and moving(w) >= self.KEEPS_UP * equal}
        if len(known) < 2:
            return weight
        version = max(v for v, _ in known.values())
        places = {w: at for w, (v, at) in known.items() if v == version}
        if len(places) < 2:
            return weight
        mean = sum(places.values()) / len(places)
        for w, at in places.items():
            weight[w] = 1.0 + max(-self.MAX_EXTRA, min(self.MAX_EXTRA, (mean - at) / self.CATCH_UP * self.MAX_EXTRA))
        return weight


def place_in_stripe(version: int, index: int | None, stripes: int, pos: int, size: int) -> tuple[int, float] | None:
    """How far along its stripe a response for the ``index``-th shard of ``version``'s manifest is once ``pos`` of
    its ``size`` bytes are written: (version, in shards: the shard's place among its stripe's and the part of it
    written). None for a shard not known."""
    return None if index is None else (version, index // max(1, stripes) + pos / max(1, size))


_TCPI_RWND_LIMITED = 176
"""Offset of ``tcpi_rwnd_limited`` (u64, microseconds) in Linux's struct tcp_info (since 4.10)."""


def rwnd_limited_us(request: web.Request) -> int | None:
    """Microseconds this response's connection has spent limited by the receiver's window so far (it read slower
    than we could send): TCP_INFO, Linux 4.10 and later; None elsewhere."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
    except (OSError, ValueError, AttributeError):
        return None
    return int(struct.unpack_from("Q", info, _TCPI_RWND_LIMITED)[0]) if len(info) >= _TCPI_RWND_LIMITED + 8 else None


def pace(request: web.Request, rate: float | None) -> None:
    """Cap this response's connection at ``rate`` bytes/s (None: no cap). A kept-alive connection keeps the cap
    of the response before: the first call of each response always sets it."""
    want = _UNPACED if rate is None else max(1, min(int(rate), _UNPACED - 1))
    was = request.get(_PACED)
    if was is not None and abs(want - was) <= 0.05 * was:
        return
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    with contextlib.suppress(OSError, ValueError):
        sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, struct.pack("I", want))
        request[_PACED] = want


class Yielded(ConnectionResetError):
    """A response on spare upload (relay.py) cut short for a child's."""


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
