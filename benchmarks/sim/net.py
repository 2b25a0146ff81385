"""The network model and clock of the broadcast simulator: a fluid (flow-level) model, no packets.

Every receiver fetches each stripe of the version as one stream (the real fetcher's two workers per stripe take
the stripe's shards in manifest order, so they pipeline and hide each request's round trip; modelled as one
stream in order). A stream has one source at a time (its parent in that stripe, or an alternate for a shard).

Rates: max-min fair over every node's upload and download capacity, computed by alternating water-filling at the
uploads and at the downloads (two rounds each: exact when one side binds, close otherwise); with ``unfair`` > 0,
weighted by each connection's fixed weight (``tcp_weights``: TCP shares a link unevenly, and a connection it
favours keeps its edge for the whole transfer, as measured in the netns runs; at the uploads only where the
sender does not pace its connections, ``paced``), with a cap per flow
for cut-through: a child cannot be ahead of the bytes its source held ``lag`` seconds ago (what waits in the relay's
buffers and its link's queue before it goes on: the source's bytes less ``lag`` times the rate it receives them);
a child that has caught up is capped at its source's own incoming rate. Rates are recomputed at every tick
(``tick`` seconds: events in between change who sends to whom at once, their rates at the next tick). Bytes
advance linearly between events and ticks; a completion time is interpolated within its step. A departed node's
flows stop at once; its children learn it only after the keep-alive delay.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

INF = float("inf")
Side = tuple[int, int, int, float]
"""A side transfer that ended: (node, stripe, source, seconds it took)."""


def waterfill(
    group: np.ndarray, demand: np.ndarray, cap: np.ndarray, weight: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted max-min fair shares: each group's capacity ``cap[g]`` split among its flows in proportion to
    ``weight`` (all 1: max-min fair), none above its ``demand``. Returns (rates, level per group): a flow of a
    saturated group gets ``min(demand, weight * level)``; a group that is not saturated has level inf."""
    n = len(demand)
    level = np.full(len(cap), INF)
    if n == 0:
        return demand.copy(), level
    w = np.ones(n) if weight is None else weight
    d_all = np.minimum(demand, cap[group])  # no flow gets more than its whole group: keeps the sums finite
    order = np.lexsort((d_all / w, group))
    g, d, wo = group[order], d_all[order], w[order]
    counts = np.bincount(g, minlength=len(cap))
    starts = np.cumsum(counts) - counts
    csum, wsum = np.cumsum(d), np.cumsum(wo)
    prev = csum - d - np.concatenate(([0.0], csum))[starts][g]  # demands below this one in its group
    wtot = np.bincount(g, weights=wo, minlength=len(cap))
    wrem = wtot[g] - (wsum - wo - np.concatenate(([0.0], wsum))[starts][g])  # weights from this one to the end
    sat = np.nonzero(prev + d / wo * wrem >= cap[g])[0]
    if len(sat):
        gs, first = np.unique(g[sat], return_index=True)
        k = sat[first]
        level[gs] = (cap[gs] - prev[k]) / wrem[k]
    out = np.empty(n)
    out[order] = np.minimum(d, wo * level[g])
    return out, level


def tcp_weights(rows: np.ndarray, cols: np.ndarray, srcs: np.ndarray, spread: float, seed: int) -> np.ndarray:
    """Each connection's weight in the sharing of a bottleneck: log-uniform with standard deviation ``spread``
    of its log, fixed for the connection (receiver, stripe, source) and the seed; 1 everywhere at spread 0."""
    if spread <= 0:
        return np.ones(len(rows))
    h = (
        rows.astype(np.uint64) * np.uint64(0x9E3779B1)
        + cols.astype(np.uint64) * np.uint64(0x85EBCA77)
        + srcs.astype(np.uint64) * np.uint64(0xC2B2AE3D)
        + np.uint64(seed * 0x27D4EB2F + 1)
    )
    h ^= h >> np.uint64(15)
    h *= np.uint64(0x2C1B3C6D)
    h ^= h >> np.uint64(12)
    h *= np.uint64(0x297A2D39)
    h ^= h >> np.uint64(15)
    u = (h & np.uint64(0xFFFFFF)).astype(float) / float(0x1000000)
    return np.exp(spread * np.sqrt(3.0) * (2.0 * u - 1.0))


class Net:
    """Stripe streams of ``n`` nodes. ``need[s]``: bytes of stripe s; ``got``: bytes each node holds of each
    stripe; ``src``: the stream's source (-1: none); ``ready``: it may not flow before then (a request in
    flight); ``want``: the node is receiving the version. ``store_forward``: a source passes on whole shards
    only (shardcast), else cut-through ``lag`` seconds behind."""

    def __init__(
        self,
        n: int,
        need: list[float],
        shard: float,
        lag: float,
        store_forward: bool = False,
        unfair: float = 0.0,
        seed: int = 0,
        paced: float | None = None,
    ) -> None:
        k = len(need)
        self.unfair, self.seed, self.paced = unfair, seed, paced
        """``unfair``: the spread of TCP's uneven sharing of one link (tcp_weights); 0: max-min fair. ``paced``:
        senders pace the connections their upload limits at about equal shares (pacing.FairShare): the spread
        left at the uploads (each connection's weight there, its log scaled to it); None: not paced."""
        self.need = np.array(need, dtype=float)
        self.shard, self.lag, self.store_forward = shard, lag, store_forward
        self.up = np.zeros(n)
        self.down = np.full(n, 1e12)
        self.alive = np.zeros(n, dtype=bool)
        self.got = np.zeros((n, k))
        self.src = np.full((n, k), -1, dtype=np.int64)
        self.ready = np.zeros((n, k))
        self.want = np.zeros((n, k), dtype=bool)
        self.rate = np.zeros((n, k))
        self.prev = np.zeros((n, k))
        """The rates of the tick before: a caught-up stream's cap is its source's rate."""
        self.done_at = np.full((n, k), np.nan)
        self.skip = np.zeros((n, k))
        """Bytes of a stream that a side transfer is fetching (the main stream stops that much short)."""
        self.side: dict[tuple[int, int], list[float]] = {}
        """(node, stripe) -> [source, bytes left, size, started]: one shard from an alternate, beside the main
        stream (the fetcher's other worker keeps taking shards from the parent meanwhile)."""
        self.side_rate = np.zeros(0)
        self.lent = np.zeros(n, dtype=np.int64)
        """Side transfers each node serves now: each uses one of its slots (relay.ShardServer._get)."""

    def limit(self, rows: np.ndarray, cols: np.ndarray, srcs: np.ndarray, src_rate: np.ndarray) -> np.ndarray:
        """Bytes a stream may hold at most: what its source holds, less what a relay holds back (``src_rate``:
        the rate the source receives the stripe at)."""
        have = self.got[srcs, cols]
        full = have >= self.need[cols]
        held = (
            np.floor(have / self.shard) * self.shard
            if self.store_forward
            else np.maximum(0.0, have - self.lag * src_rate)
        )
        return np.where(full, self.need[cols], held)

    def start_side(self, n: int, s: int, src: int, size: float, now: float, ready: float) -> None:
        self.cancel_side(n, s)
        self.side[(n, s)] = [float(src), size, size, now, ready]
        self.lent[src] += 1
        self.skip[n, s] += size
        self.side_rate = np.append(self.side_rate, 0.0)  # it flows from the next tick

    def cancel_side(self, n: int, s: int) -> None:
        """The alternate went away: the shard goes back to the main stream (its bytes so far are lost)."""
        if (n, s) in self.side:
            at = list(self.side).index((n, s))
            x = self.side.pop((n, s))
            self.skip[n, s] -= x[2]
            self.lent[int(x[0])] -= 1
            self.side_rate = np.delete(self.side_rate, at)

    def active(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        m = self.want & (self.src >= 0) & (self.ready <= now) & (self.got < self.need[None, :] - self.skip)
        rows, cols = np.nonzero(m)
        ok = self.alive[rows] & self.alive[self.src[rows, cols]]
        return rows[ok], cols[ok]

    def rates(self, now: float, dt: float) -> None:
        """Max-min fair rates of every active stream (see the module docstring)."""
        self.prev, self.rate = self.rate, np.zeros_like(self.rate)
        rows, cols = self.active(now)
        srcs = self.src[rows, cols]
        src_rate = self.prev[srcs, cols]
        avail = self.limit(rows, cols, srcs, src_rate) - self.got[rows, cols]
        src_full = self.got[srcs, cols] >= self.need[cols]
        # caught up with a source still receiving: no faster than it receives (plus what it is ahead by)
        cap = np.where(src_full, INF, np.maximum(0.0, src_rate + avail / max(dt, 1e-9)))
        cap = np.minimum(cap, (self.need[cols] - self.skip[rows, cols] - self.got[rows, cols]) / max(dt, 1e-9) + 1)
        sides = list(self.side.values())  # alternates hold the whole version: no cut-through cap
        s_rows = np.array([int(k[0]) for k in self.side], dtype=np.int64)
        s_src = np.array([int(x[0]) for x in sides], dtype=np.int64)
        s_cap = np.array([x[1] / max(dt, 1e-9) + 1 if x[4] <= now else 0.0 for x in sides])
        if len(sides):
            s_cap[~(self.alive[s_rows] & self.alive[s_src])] = 0.0
        g_up, g_down = np.concatenate([srcs, s_src]), np.concatenate([rows, s_rows])
        cap = np.concatenate([cap, s_cap])
        if len(cap) == 0:
            self.side_rate = np.zeros(0)
            return
        side = np.full(len(s_rows), self.need.size)  # a side transfer: a connection of its own
        w = tcp_weights(g_down, np.concatenate([cols, side]), g_up, self.unfair, self.seed)
        wu = w if self.paced is None or self.unfair <= 0 else w ** (self.paced / self.unfair)
        r, _ = waterfill(g_up, cap, self.up, wu)
        r, down_level = waterfill(g_down, r, self.down, w)
        r, _ = waterfill(g_up, np.minimum(cap, w * down_level[g_down]), self.up, wu)
        r, _ = waterfill(g_down, r, self.down, w)
        self.rate[rows, cols] = r[: len(rows)]
        self.side_rate = r[len(rows) :]

    def advance(self, now: float, dt: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[Side]]:
        """Move bytes for ``dt`` seconds; returns the streams that crossed a shard boundary, those that
        completed (their completion time interpolated into ``done_at``), and the side transfers that ended."""
        sides_done: list[Side] = []
        if dt <= 0:
            return [], [], sides_done
        ended: list[tuple[int, int]] = []
        keep = []
        for (key, x), rate in zip(list(self.side.items()), self.side_rate.tolist(), strict=True):
            x[1] -= rate * dt
            keep.append(x[1] > 0.5)
            if x[1] <= 0.5:
                n, s = key
                del self.side[key]
                self.skip[n, s] -= x[2]
                self.lent[int(x[0])] -= 1
                self.got[n, s] += x[2]
                sides_done.append((n, s, int(x[0]), now + dt - x[3]))
                if self.got[n, s] >= self.need[s] - 0.5 and self.skip[n, s] < 0.5:
                    self.got[n, s] = self.need[s]
                    self.done_at[n, s] = now + dt
                    ended.append((n, s))
        if sides_done:
            self.side_rate = self.side_rate[np.array(keep, dtype=bool)]
        rows, cols = np.nonzero(self.rate > 0)
        if len(rows) == 0:
            return [], ended, sides_done
        before = self.got[rows, cols].copy()
        after = before + self.rate[rows, cols] * dt
        srcs = self.src[rows, cols]
        self.got[rows, cols] = after  # sources first, then the clamp against them (one pass)
        after = np.minimum(after, self.limit(rows, cols, srcs, self.rate[srcs, cols]))
        after = np.maximum(after, before)
        self.got[rows, cols] = after
        crossed = np.floor(after / self.shard) > np.floor(before / self.shard)
        need = self.need[cols]
        done = (after >= need - 0.5) & (before < need - 0.5) & (self.skip[rows, cols] < 0.5)
        if done.any():
            r, c = rows[done], cols[done]
            self.got[r, c] = self.need[c]
            frac = (self.need[c] - before[done]) / np.maximum(self.rate[r, c] * dt, 1e-9)
            self.done_at[r, c] = now + np.clip(frac, 0.0, 1.0) * dt
        cross = crossed & ~done
        ended += list(zip(rows[done].tolist(), cols[done].tolist(), strict=True))
        return list(zip(rows[cross].tolist(), cols[cross].tolist(), strict=True)), ended, sides_done


class Clock:
    """Discrete events on a simulated clock, interleaved with the fluid network's ticks. Bytes are moved lazily:
    up to an event's time only before an event that touches the network (``quiet`` ones do not: record
    publishing, asking for a slot), and at every tick, so thousands of control events cost no network steps."""

    def __init__(self, net: Net, tick: float, start: float = 0.0, exact: bool = True) -> None:
        self.net, self.tick, self.now = net, tick, start
        self.exact = exact
        """False: bytes move at ticks only, every event sees the network as of the last tick (an event changes
        who sends to whom at once, as before; what moved since the tick is counted at the next one). Each move
        is O(N), and events grow with N: at 10,000 nodes moving before each one was O(N^2) per simulated second."""
        self._q: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.quiet: set[object] = set()
        """Functions (or methods' functions) that neither read nor change the network's state."""
        self.events = 0
        self.ticks = 0
        self._moved_to = start

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._q, (max(t, self.now), next(self._seq), fn, args))

    def run(
        self,
        until: float,
        on_cross: Callable[[int, int], None],
        on_done: Callable[[int, int], None],
        stop: Callable[[], bool],
        flows_from: float = 0.0,
        on_side: Callable[[Side], None] = lambda side: None,
    ) -> None:
        """Run events and move bytes until ``until`` or ``stop()``; no bytes move before ``flows_from``."""

        def move() -> None:
            if self.now > self._moved_to:
                crossed, done, sides = self.net.advance(self._moved_to, self.now - self._moved_to)
                self._moved_to = self.now
                for side in sides:
                    on_side(side)
                for n, s in done:
                    on_done(n, s)
                for n, s in crossed:
                    on_cross(n, s)

        next_tick = max(self.now, flows_from)
        while self.now < until and not stop():
            if self.now < flows_from:
                self._moved_to = self.now
            elif self.now >= next_tick:
                move()
                self.net.rates(self.now, self.tick)
                next_tick = self.now + self.tick
                self.ticks += 1
            te = self._q[0][0] if self._q else INF
            if te <= min(next_tick, until):
                _, _, fn, args = heapq.heappop(self._q)
                self.now = te
                self.events += 1
                if self.exact and self.now >= flows_from and getattr(fn, "__func__", fn) not in self.quiet:
                    move()
                fn(*args)
            else:
                self.now = min(next_tick, until)
        move()
