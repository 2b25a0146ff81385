"""The fetching side of the simulated nodes (benchmarks/simulate.py): where each stripe's shards come from.

Runs ``fetch.pick_source`` on real ``fetch.Source`` objects for every shard (the stripe's parent preferred, an
alternate probed one pick in ``PROBE_EVERY``), plans the sources as ``fetch.ShardFetcher._refresh`` with
``follower._find`` do (MIRROR: the parents, up to two ``tree.holders``, the origin last, every ``REPLAN_S``), and
measures each source at every shard as ``fetch._one`` does. A shard from an alternate is a side transfer beside the
parent's stream (the fetcher's other worker of the stripe goes on with the parent), served only while the
alternate has a free slot, and it holds one while it is served (MIRROR of relay.ShardServer._get: a stranger gets
503 otherwise, away 2 s; an alternate that streams to a node without a parent is not counted), or on spare
upload: while no child of its own is being sent anything. The endgame (fetch.ShardFetcher.fetch): with one of its
stripes done, a node takes a shard of the stripe furthest behind from ``fetch.pick_spare``'s source, on spare upload
or a free slot. Not modelled: several helpers on one stripe at once (one side transfer per stripe here), a
spare response cut short when a child of its source starts (here it runs to its end). The share of each stripe a
node two levels below the stripe's root takes from the slot the root keeps (``sources.above_due``, relay's
``kept``) is a side transfer too (``Fetcher.above``): one shard a run, from a root that holds it whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from intellect_node.weights.fetch import PROBE_EVERY, REPLAN_S, SPARE_AGAIN_S
from intellect_node.weights.follower import REFUSED_AVOID_S
from intellect_node.weights.sources import ABOVE_EVERY, Source, above_due, faster_than_parent, pick_source, pick_spare
from intellect_node.weights.tree import holders
from intellect_protocol.messages import NodeRecord

from .net import Clock, Net

ORIGIN = 0


@dataclass
class Node:
    idx: int
    nid: str
    up: float
    down: float
    reachable: bool
    latency: float
    """One-way latency to anyone (s): a round trip between a and b is 2 * (a.latency + b.latency)."""
    home: int = 0
    slots: int = 0
    alive: bool = False
    left_at: float = float("inf")
    parent: list[int] = field(default_factory=list)
    children: dict[tuple[int, int], float] = field(default_factory=dict)
    """(child, stripe) -> when it last spoke: children keep their slot alive every second while they live."""
    choosing: list[bool] = field(default_factory=list)
    avoid: dict[int, float] = field(default_factory=dict)
    sources: dict[str, Source] = field(default_factory=dict)
    refreshed: float = -1e9
    picks: int = 0
    fetching: bool = False
    sent_at: float = -1e9
    """When it was last seen serving a fetching child (follower.REHOME_IDLE_S)."""
    moved_at: float = -1e9
    """When it last moved its home stripe (follower.REHOME_HOLD_S)."""
    done: float = float("nan")
    published: tuple[object, ...] = ()
    mark: list[tuple[float, float]] = field(default_factory=list)
    """Per stripe: (time, bytes) at the last shard boundary, for the measured rate of the source."""
    endgame_at: float = -1.0
    """When its endgame is to look for spare upload again (-1: not planned)."""
    climb_after: dict[int, float] = field(default_factory=dict)
    """Grandparents that refused to take it up, and until when they are not asked again (links.CLIMB_REFUSED_S)."""
    kept: int = 0
    """Slots a stripe's root keeps beyond its children's, lent to alternates (relay.ShardServer.kept)."""
    above_run: dict[int, int] = field(default_factory=dict)
    """Per stripe, the last run of ABOVE_EVERY shards whose share came from the root two levels up."""


@dataclass
class Stats:
    asks: int = 0
    refused: int = 0
    silent: int = 0
    adopted: int = 0
    reparents: int = 0
    no_slot_rounds: int = 0
    alt_shards: int = 0
    probes_refused: int = 0
    detached_s: float = 0.0
    slow_parent_moves: int = 0
    preempted: int = 0
    rehomed: int = 0
    records: int = 0
    spare_shards: int = 0
    spare_yielded: int = 0
    climbs: int = 0
    above_shards: int = 0


class Swarm(Protocol):
    """What the fetcher reads and calls of the swarm it serves (swarm.Swarm): the network, the clock, the nodes
    and the records they published."""

    net: Net
    clock: Clock
    k: int
    nodes: list[Node]
    ids: dict[str, int]
    holding: dict[str, NodeRecord]
    stats: Stats

    @property
    def origin(self) -> Node: ...

    def rtt(self, a: Node, b: Node) -> float: ...

    def active(self, t: Node) -> dict[tuple[int, int], float]: ...

    def depth(self, n: Node, s: int) -> int: ...

    def publish(self, n: Node, force: bool = False) -> None: ...


class Fetcher:
    """Every node's fetch of the version, over the swarm ``sw``."""

    def __init__(self, sw: Swarm) -> None:
        self.sw = sw
        self.retrying: set[tuple[int, int]] = set()
        """(node, stripe) without a source that will look again (pick)."""
        self.lent_spare: set[tuple[int, int]] = set()
        """(node, stripe) of side transfers served on spare upload (no free slot): they yield to a child's stream."""
        self.spare: set[tuple[int, int]] = set()
        """(node, stripe) of the side transfers the endgame started: they make no parent (fetch._one)."""

    def begin(self, n: Node) -> None:
        """``n`` learns of the version (news from a parent, or the trainer's record) and starts fetching."""
        if not n.alive or n.fetching or n.done == n.done:
            return
        n.fetching = True
        self.sw.net.want[n.idx, :] = True
        for s in range(self.sw.k):
            n.mark[s] = (self.sw.clock.now, float(self.sw.net.got[n.idx, s]))
            self.pick(n, s)
        self.sw.publish(n)
        for c, _s in list(n.children):  # news travels down as the data does: /relay/next, then the manifest
            child = self.sw.nodes[c]
            self.sw.clock.at(self.sw.clock.now + 2 * self.sw.rtt(n, child), self.begin, child)

    def set_source(self, n: Node, s: int, t: Node) -> None:
        if n.parent[s] == t.idx:  # a child's stream starts: t's responses on spare upload yield (relay._write)
            for key in [k for k in self.lent_spare if int(self.sw.net.side[k][0]) == t.idx]:
                self.sw.net.cancel_side(*key)
                self.lent_spare.discard(key)
                self.spare.discard(key)
                self.sw.stats.spare_yielded += 1
        self.sw.net.src[n.idx, s] = t.idx
        self.sw.net.rate[n.idx, s] = 0.0
        self.sw.net.ready[n.idx, s] = self.sw.clock.now + self.sw.rtt(n, t)

    def refresh(self, n: Node) -> None:
        """fetch.ShardFetcher._refresh with follower._find: the parents, up to two holders, the origin last."""
        now = self.sw.clock.now
        if now - n.refreshed < REPLAN_S:
            return
        n.refreshed = now
        fresh: dict[str, Source] = {}
        for s, p in enumerate(n.parent):
            if p >= 0:
                t = self.sw.nodes[p]
                depth = max(0, self.sw.depth(t, s))  # a record never says below 0 (a parent just unrooted: -1)
                src = fresh.get(t.nid) or n.sources.get(t.nid) or Source(t.nid, f"http://n{p}", depth)
                src.is_parent, src.parent_of = True, src.parent_of | {s} if t.nid in fresh else frozenset({s})
                fresh[t.nid] = src
        down = {nid for nid, x in n.sources.items() if (x.failed >= 2 or x.full) and x.away_until > now}
        skip = down | set(fresh) | {self.sw.nodes[i].nid for i in n.avoid if n.avoid[i] > now}
        for c in holders(self.sw.holding, n.nid, self.sw.origin.nid, 1, skip):
            src = n.sources.get(c.node_id) or Source(c.node_id, c.url, c.depth)
            src.is_parent, src.parent_of = False, frozenset()
            fresh[c.node_id] = src
        o = self.sw.origin
        if o.nid not in skip:
            src = fresh.get(o.nid) or n.sources.get(o.nid) or Source(o.nid, "http://n0", 0)
            if o.nid not in fresh:
                src.is_parent, src.parent_of = False, frozenset()
            fresh[o.nid] = src
        n.sources = fresh

    def pick(self, n: Node, s: int) -> None:
        """The source of the stripe's next shard: ``fetch.pick_source``; an alternate serves only while it has
        a free slot, counting the side transfers it serves (relay: a stranger gets 503 otherwise, and is marked full
        for 2 s)."""
        self.refresh(n)
        now = self.sw.clock.now
        for _ in range(4):
            n.picks += 1
            stripe = s if self.sw.k > 1 else None
            src = pick_source(n.sources.values(), set(), {}, now, n.picks % PROBE_EVERY == 0, stripe)
            if src is None:
                break
            t = self.sw.nodes[self.sw.ids[src.node_id]]
            if src.serves(s if self.sw.k > 1 else None) and n.parent[s] == t.idx:
                if self.sw.net.src[n.idx, s] != t.idx:
                    self.set_source(n, s, t)
                return
            if admitted := self.admits(t):
                p = n.parent[s]
                if p < 0:  # no parent: the alternate is the stream's source for now
                    self.sw.stats.alt_shards += 1
                    if self.sw.net.src[n.idx, s] != t.idx:
                        self.set_source(n, s, t)
                    return
                left = self.sw.net.need[s] - self.sw.net.skip[n.idx, s] - self.sw.net.got[n.idx, s]
                # one worker on it, the other goes on with the parent
                if (n.idx, s) not in self.sw.net.side and left > self.sw.net.shard:
                    self.sw.stats.alt_shards += 1
                    if admitted == "spare":
                        self.lent_spare.add((n.idx, s))
                    self.sw.net.start_side(
                        n.idx, s, t.idx, self.sw.net.shard, self.sw.clock.now, self.sw.clock.now + self.sw.rtt(n, t)
                    )
                if self.sw.net.src[n.idx, s] != p:
                    self.set_source(n, s, self.sw.nodes[p])
                return
            self.sw.stats.probes_refused += 1
            src.full, src.away_until = True, now + REFUSED_AVOID_S
        p = n.parent[s]
        if p >= 0 and self.sw.net.src[n.idx, s] != p:
            self.set_source(n, s, self.sw.nodes[p])
        elif p < 0:
            self.sw.net.src[n.idx, s] = -1
            net = self.sw.net
            if net.want[n.idx, s] and net.got[n.idx, s] < net.need[s] and (n.idx, s) not in self.retrying:
                # the fetcher's worker tries its sources again (fetch.ShardFetcher.fetch: a refresh a second); here
                # every REPLAN_S. Before, a node without a parent whose alternates were full waited for a parent
                # only (seed 1, 1,000 nodes with churn: one never finished)
                self.retrying.add((n.idx, s))
                self.sw.clock.at(now + REPLAN_S, self._retry, n, s)

    def _retry(self, n: Node, s: int) -> None:
        self.retrying.discard((n.idx, s))
        if n.alive and self.sw.net.want[n.idx, s] and self.sw.net.src[n.idx, s] < 0:
            self.pick(n, s)

    def admits(self, t: Node) -> str:
        """Whether alternate ``t`` serves a shard now (MIRROR of relay.ShardServer._get): it holds the whole version
        (the origin does), and a slot is free ("slot") or its upload is spare ("spare": no child of its own is
        being sent anything; such a response yields when one is). "": 503."""
        net = self.sw.net
        if not t.alive or not (t.done == t.done or t.idx == ORIGIN):
            return ""
        if len(self.sw.active(t)) + net.lent[t.idx] < t.slots + t.kept:
            return "slot"
        sending = any(
            net.src[c, s] == t.idx
            and net.want[c, s]
            and self.sw.nodes[c].alive
            and net.got[c, s] < net.need[s] - net.skip[c, s]
            for (c, s) in t.children
        )
        return "spare" if not sending and net.lent[t.idx] < t.slots + t.kept else ""

    def endgame(self, n: Node) -> None:
        """MIRROR of the fetcher's endgame: per stripe done, one stripe still over two shards short (furthest
        behind first) gets a shard from ``fetch.pick_spare``'s source if it admits it; else that source is not
        asked again for SPARE_AGAIN_S, and the endgame looks again then."""
        net, now = self.sw.net, self.sw.clock.now
        n.endgame_at = -1.0
        if not n.alive or not n.fetching or self.sw.k == 1:
            return
        left = net.need - net.skip[n.idx] - net.got[n.idx]
        helpers = int(np.sum(net.got[n.idx] >= net.need))
        retry = False
        for s in np.argsort(-left)[:helpers].tolist():
            if left[s] <= 2 * net.shard or (n.idx, s) in net.side:
                continue
            while (src := pick_spare(n.sources.values(), {}, now, s)) is not None:
                t = self.sw.nodes[self.sw.ids[src.node_id]]
                if admitted := self.admits(t):
                    self.sw.stats.spare_shards += 1
                    self.spare.add((n.idx, s))
                    if admitted == "spare":
                        self.lent_spare.add((n.idx, s))
                    net.start_side(n.idx, s, t.idx, net.shard, now, now + self.sw.rtt(n, t))
                    break
                src.spare_until = now + SPARE_AGAIN_S
                retry = True
        if retry and n.endgame_at < 0:
            n.endgame_at = now + SPARE_AGAIN_S
            self.sw.clock.at(n.endgame_at, self.endgame, n)

    def crossed(self, i: int, s: int) -> None:
        """A stream finished a shard: the source's measured rate, then the next shard's source."""
        n = self.sw.nodes[i]
        t0, b0 = n.mark[s]
        now, got = self.sw.clock.now, float(self.sw.net.got[i, s])
        n.mark[s] = (now, got)
        t = self.sw.net.src[i, s]
        src = n.sources.get(self.sw.nodes[t].nid) if t >= 0 else None
        if src is not None and now > t0:
            rate = (got - b0) / (now - t0)
            src.bps = rate if src.bps == 0 else 0.7 * src.bps + 0.3 * rate
            src.ok, src.failed, src.full = src.ok + 1, 0, False
        self.above(n, s)
        self.pick(n, s)

    def above(self, n: Node, s: int) -> None:
        """MIRROR of fetch.ShardFetcher.fetch's share from the stripe's root two levels up (sources.above_due, once a
        run of ABOVE_EVERY, from a place set by the node's id; refused while the root's kept slot and free slots are
        lent, the next shard asks again): a side transfer of one shard from the root, only once the root holds the
        node's next shard whole (a side transfer here has no cut-through cap; the real root streams a shard it is
        still receiving). As every side transfer here, its bytes are the stripe's last, so the parent's stream stops
        a shard short. In the netns model the nodes two levels down keep within a shard of the root (N=16, seed 0:
        3 such shards of 717 chances), where the real ones fell 2-4 s behind: the model's N=16 is unchanged."""
        net, k = self.sw.net, self.sw.k
        p = n.parent[s]
        if k == 1 or p < 0 or (n.idx, s) in net.side:
            return
        g = self.sw.nodes[p].parent[s]
        if g < 0 or g == ORIGIN:
            return
        t = self.sw.nodes[g]
        pos = int(net.got[n.idx, s] // net.shard)
        if not t.alive or t.kept <= 0 or n.above_run.get(s) == pos // ABOVE_EVERY or not above_due(n.nid, pos):
            return
        left = net.need[s] - net.skip[n.idx, s] - net.got[n.idx, s]
        holds = net.got[g, s] >= min(net.need[s], net.got[n.idx, s] + net.shard)
        if left <= net.shard or not holds or self.sw.depth(t, s) != 1:
            return
        if len(self.sw.active(t)) + net.lent[t.idx] >= t.slots + t.kept:
            return
        n.above_run[s] = pos // ABOVE_EVERY
        self.sw.stats.above_shards += 1
        self.spare.add((n.idx, s))  # it makes no parent (fetch._one: spare)
        net.start_side(n.idx, s, t.idx, net.shard, self.sw.clock.now, self.sw.clock.now + self.sw.rtt(n, t))

    def side_done(self, side: tuple[int, int, int, float]) -> None:
        """A shard from an alternate arrived: what it measured (fetch._one: ok, an EWMA of the rate)."""
        i, s, t, took = side
        spare = (i, s) in self.spare
        self.spare.discard((i, s))
        self.lent_spare.discard((i, s))
        src = self.sw.nodes[i].sources.get(self.sw.nodes[t].nid)
        if src is not None and took > 0:
            rate = self.sw.net.shard / took
            src.bps = rate if src.bps == 0 else 0.7 * src.bps + 0.3 * rate
            src.ok, src.failed, src.full = src.ok + (not spare), 0, False
        self.endgame(self.sw.nodes[i])

    def stripe_done(self, i: int, s: int) -> None:
        n = self.sw.nodes[i]
        if not np.all(self.sw.net.got[i] >= self.sw.net.need):
            self.endgame(n)
            return
        n.done = float(np.nanmax(self.sw.net.done_at[i]))
        n.fetching = False
        self.sw.net.want[i, :] = False
        p = n.parent[n.home]
        if p >= 0 and faster_than_parent(n.sources, self.sw.nodes[p].nid, self.sw.origin.nid, set()) is not None:
            self.sw.stats.slow_parent_moves += 1
        self.sw.publish(n)
