"""The control plane of the broadcast simulator: simulated nodes that choose parents with the project's own code.

What runs as the node runs it (imported): ``stripes.choose_home``, ``announced_home``, ``planned_rate``,
``fanout``, ``claim`` (home stripe and slots), ``tree.parents`` and ``tree.below`` (whom to ask for a slot, and
whom next after a 503), and the timing constants of follower.py and relay.py; the fetching side is fetch.py.
Records are real ``NodeRecord``/``RelayInfo`` objects, published on change and seen by others ``dht_lag`` seconds
later; a departed node's record stays until ``NODE_TTL_S`` after its last publish.

Mirrored here (the decision lives in async code that cannot be imported; each is marked MIRROR below):
attaching (``links.Attachments.choose``: ask in order, an answer per round trip, a silent one costs ``ASK_STAGGER_S``, a
503 puts its children first), admitting (``relay.ShardServer._attach``/``_admit``: rooted, not an ancestor,
slots, a child silent ``CONTESTED_TTL_S`` replaced), leaving a parent (two keep-alives unanswered), the slots
rule (``fanout``, no spare slot; the origin ``origin_fanout``) and the planned rate's inputs. A node at home in a
stripe takes a leaf's slot when none is free, and at the origin a stripe under its share a slot of one over it
(``preempt``: ``stripes.to_release``, as ``relay.ShardServer._make_room``).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Mapping

import numpy as np

from intellect_node.weights import stripes as st
from intellect_node.weights.follower import REHOME_HOLD_S, REHOME_IDLE_S, REHOME_JOIN_S, REHOME_S
from intellect_node.weights.links import (
    ASK_STAGGER_S,
    CHOOSE_BUDGET_S,
    CLIMB_REFUSED_S,
    FAST_KEEPALIVE_S,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT,
    MAX_ATTACH_TRIES,
    REFUSED_AVOID_S,
    SILENT_KEEPALIVES,
    UNREACHABLE_AVOID_S,
)
from intellect_node.weights.relay import BEHIND_SHARDS, CHILD_TTL_S, CONTESTED_TTL_S
from intellect_node.weights.tree import Candidate, below, parents
from intellect_node.weights.tree import _order as tree_order
from intellect_protocol.messages import NodeRecord, RelayInfo
from intellect_protocol.records import NODE_TTL_S

from .fetch import ORIGIN, Fetcher, Node, Stats
from .net import Clock, Net

PLAN_S = 5.0
"""The planned stripe rate is computed again this often (a pass over every record)."""
REPUBLISH_S = 20.0
"""A node republishes its record this often even without a change (well within NODE_TTL_S)."""
DETECT_S = KEEPALIVE_TIMEOUT.total + FAST_KEEPALIVE_S + KEEPALIVE_TIMEOUT.total  # type: ignore[operator]
"""From the first unanswered keep-alive to leaving: SILENT_KEEPALIVES (2) timeouts, the second sent sooner."""
assert SILENT_KEEPALIVES == 2


class Asked(Mapping[str, NodeRecord]):
    """The records one ask hands to ``tree.parents``: as its items, the origin and the first relays of a stripe's
    free-slot index (in the order ``parents`` sorts by), and every record by lookup (the walks up a candidate's
    ancestry). ``parents`` over every record costs O(N) per ask, and at 10,000 nodes the asks made the simulation
    O(N^2) per simulated second; it returns the same first candidates from the head of the order (ties by id)."""

    def __init__(self, head: dict[str, NodeRecord], everyone: dict[str, NodeRecord]) -> None:
        self.head, self.everyone = head, everyone

    def __getitem__(self, nid: str) -> NodeRecord:
        return self.everyone[nid]

    def __contains__(self, nid: object) -> bool:
        return nid in self.everyone

    def __iter__(self) -> Iterator[str]:
        return iter(self.head)

    def __len__(self) -> int:
        return len(self.head)

    def items(self):  # type: ignore[override]
        return self.head.items()

    def values(self):  # type: ignore[override]
        return self.head.values()


class Swarm:
    """The simulated nodes, the DHT view they read, and the glue (attach, keep-alive, news of the version)."""

    def __init__(
        self,
        net: Net,
        clock: Clock,
        stripes: int,
        dht_lag: float,
        rng: random.Random,
        fixed_slots: int | None = None,
        detect_s: float = DETECT_S,
        svc_s: float = 0.0,
        preempt: bool = True,
        spare_min: int = 10**9,
        moves_s: float = 0.0,
    ) -> None:
        self.net, self.clock, self.k, self.dht_lag, self.rng = net, clock, stripes, dht_lag, rng
        self.fixed_slots, self.detect_s, self.svc_s = fixed_slots, detect_s, svc_s
        self.preempt = preempt
        """Not the design yet (see admit): without it small swarms deadlock."""
        self.moves_s = moves_s
        """The home-stripe plan (a sort of every record) is computed again at most this often (0: on every
        change); a node reads the records it plans from up to ``REHOME_S`` old."""
        self.spare_min = spare_min
        """A spare slot for a fan-out of at least this (the design now: none, the default)."""
        self.nodes: list[Node] = []
        self.ids: dict[str, int] = {}
        self.visible: dict[str, NodeRecord] = {}
        self.free_order: list[list[tuple[int, float, str]]] = [[] for _ in range(stripes)]
        """Per stripe, the relays with a free slot there (not the origin), sorted as ``tree.parents`` sorts (then
        by id): what ``candidates`` hands it the head of."""
        self._free_key: dict[str, tuple[int, tuple[int, float, str]]] = {}
        self._moves_at = -1e18
        self.holding: dict[str, NodeRecord] = {}
        self.stats = Stats()
        self.published_at: dict[int, float] = {}
        self.version_out = False
        self.no_parent_since: dict[tuple[int, int], float] = {}
        self._planned = (-1e18, 0.0)
        self._moves: dict[str, int] = {}
        self._moves_dirty = True
        self.fetch = Fetcher(self)
        clock.quiet |= {
            Swarm.republish,
            Swarm.publish,
            Swarm._show,
            Swarm._expire,
            Swarm.choose,
            Swarm._ask,
            Swarm.rehome,
        }

    # ---------------------------------------------------------------- nodes and records
    def add(self, up: float, down: float, reachable: bool, latency: float) -> Node:
        i = len(self.nodes)
        node = Node(
            i,
            f"{i + 1:032x}" if i else "f" * 32,
            up,
            down,
            reachable,
            latency,
            parent=[-1] * self.k,
            choosing=[False] * self.k,
            mark=[(0.0, 0.0)] * self.k,
        )
        self.nodes.append(node)
        self.ids[node.nid] = i
        self.net.up[i], self.net.down[i] = up, down
        return node

    @property
    def origin(self) -> Node:
        return self.nodes[ORIGIN]

    def rtt(self, a: Node, b: Node) -> float:
        return 2 * (a.latency + b.latency) + self.svc_s

    def active(self, t: Node) -> dict[tuple[int, int], float]:
        """A server's children as it counts them: living ones, and departed ones until CHILD_TTL_S (MIRROR)."""
        now = self.clock.now
        return {
            c: (now if self.nodes[c[0]].alive else self.nodes[c[0]].left_at)
            for c in t.children
            if self.nodes[c[0]].alive or now - self.nodes[c[0]].left_at < CHILD_TTL_S
        }

    def depth(self, n: Node, s: int) -> int:
        d, seen = 0, set()
        while n.idx != ORIGIN and n.parent[s] >= 0 and n.idx not in seen:
            seen.add(n.idx)
            n, d = self.nodes[n.parent[s]], d + 1
        return d if n.idx == ORIGIN else -1

    def path(self, n: Node, s: int) -> list[int]:
        out = [n.idx]
        while n.idx != ORIGIN and n.parent[s] >= 0 and len(out) < 1024:
            n = self.nodes[n.parent[s]]
            out.append(n.idx)
        return out

    def record(self, n: Node) -> NodeRecord:
        s = n.home
        rooted = n.idx == ORIGIN or n.parent[s] >= 0
        free = max(0, n.slots - len(self.active(n))) if rooted else 0
        parent = self.nodes[n.parent[s]].nid if n.idx != ORIGIN and n.parent[s] >= 0 else None
        relay = RelayInfo(
            depth=max(0, self.depth(n, s)),
            parent=parent,
            slots_total=n.slots,
            slots_free=free,
            upload_bps=n.up if n.reachable else 0.0,
            stripe=s,
            stripes=self.k,
            versions=[1] if n.done == n.done else [],
            fetching=1 if n.fetching else -1,
        )
        return NodeRecord(
            run_id=self.origin.nid,
            node_id=n.nid,
            role="trainer" if n.idx == ORIGIN else "relay",
            http_url=f"http://n{n.idx}" if n.reachable else None,
            updated=self.clock.now,
            weight_version=1 if n.done == n.done else 0,
            relay=relay,
        )

    def publish(self, n: Node, force: bool = False) -> None:
        """Publish ``n``'s record if it changed (or ``force``): others see it ``dht_lag`` later."""
        if not n.alive:
            return
        s = n.home
        rooted = n.idx == ORIGIN or n.parent[s] >= 0
        key = (
            self.depth(n, s),
            n.parent[s],
            n.slots,
            len(self.active(n)) if rooted else -1,
            n.done == n.done,
            n.fetching,
        )
        if not force and key == n.published:
            return
        n.published = key
        r = self.record(n)
        self.stats.records += 1
        self.published_at[n.idx] = self.clock.now
        self.clock.at(self.clock.now + self.dht_lag, self._show, r)

    def _show(self, r: NodeRecord) -> None:
        nid = r.node_id
        was = self.visible.get(nid)
        if (
            was is None
            or was.relay is None
            or r.relay is None
            or (was.relay.stripe, was.relay.slots_total) != (r.relay.stripe, r.relay.slots_total)
        ):
            self._moves_dirty = True
        self.visible[nid] = r
        assert r.relay is not None
        self._unindex(nid)
        if r.role != "trainer" and r.http_url and r.relay.slots_free > 0:  # the origin: head of every ask
            key = (*tree_order(r), nid)
            bisect.insort(self.free_order[r.relay.stripe], key)
            self._free_key[nid] = (r.relay.stripe, key)
        self.holding.pop(nid, None)
        if 1 in r.relay.versions and r.relay.slots_free > 0 and r.http_url and r.role != "trainer":
            self.holding[nid] = r
            if len(self.holding) > 64:  # holders() takes the best few: keep the best 32 (depth, then speed)
                best = sorted(self.holding.values(), key=lambda x: (x.relay.depth, -x.relay.upload_bps))[:32]  # type: ignore[union-attr]
                self.holding = {x.node_id: x for x in best}
        i = self.ids[nid]
        if not self.nodes[i].alive:
            self.clock.at(self.published_at[i] + NODE_TTL_S, self._expire, i)

    def _expire(self, i: int) -> None:
        n = self.nodes[i]
        if not n.alive and self.clock.now - self.published_at[i] >= NODE_TTL_S - 1e-6:
            for d in (self.visible, self.holding):
                d.pop(n.nid, None)
            self._unindex(n.nid)
            self._moves_dirty = True

    def _unindex(self, nid: str) -> None:
        was = self._free_key.pop(nid, None)
        if was is not None:
            order = self.free_order[was[0]]
            del order[bisect.bisect_left(order, was[1])]

    def candidates(self, n: Node, s: int, avoid: set[str], home: bool) -> list[Candidate]:
        """``tree.parents`` for ``n`` in stripe ``s``, over the head of the stripe's free-slot index: enough relays
        that ``MAX_ATTACH_TRIES`` of them pass its filters (not avoided, not our descendant), or all of them."""
        order, m = self.free_order[s], 2 * MAX_ATTACH_TRIES
        while True:
            head = {self.origin.nid: self.visible[self.origin.nid]} if self.origin.nid in self.visible else {}
            head.update((key[2], self.visible[key[2]]) for key in order[:m])
            out = parents(
                Asked(head, self.visible),
                n.nid,
                self.origin.nid,
                avoid,
                stripe=s if self.k > 1 else None,
                home=home,
                limit=MAX_ATTACH_TRIES,
            )
            if m >= len(order) or sum(c.node_id != self.origin.nid for c in out) >= MAX_ATTACH_TRIES:
                return out
            m *= 4

    def republish(self, n: Node) -> None:
        """The periodic refresh: slots planned again from the records (MIRROR: fanout + 1), record out."""
        if not n.alive:
            return
        self.plan_slots(n)
        self.publish(n)
        self.clock.at(self.clock.now + REPUBLISH_S, self.republish, n)

    def plan_rate(self) -> float:
        """MIRROR: the stripe rate nodes plan with, from the records they read: every relay's claim, unreachable
        nodes counted as receivers only. The same for every node within PLAN_S."""
        if self.clock.now - self._planned[0] < PLAN_S:
            return self._planned[1]
        recs = [r for r in self.visible.values() if r.role != "trainer"]
        origin = self.visible.get(self.origin.nid)
        origin_bps = st.claim(origin) if origin is not None else self.origin.up
        ups = [st.claim(r) for r in recs if r.http_url]
        slots = origin.relay.slots_total if origin is not None and origin.relay is not None else None
        self._planned = (self.clock.now, st.planned_rate(ups, origin_bps, max(1, len(recs)), self.k, slots))
        return self._planned[1]

    def plan_slots(self, n: Node) -> None:
        if self.fixed_slots is not None:
            n.slots = self.fixed_slots if n.reachable else 0
            return
        rate = self.plan_rate()
        n.kept = 0
        if n.idx == ORIGIN:  # relay.ShardServer.origin_info: its own upload and the records' number, no claims
            n.slots = st.origin_slots(sum(r.role != "trainer" for r in self.visible.values()), n.up, self.k)
        else:
            f = st.fanout(n.up, rate, self.k)
            n.slots = f + (f >= self.spare_min) if n.reachable else 0
            if n.slots and self.k > 1 and self.fixed_slots is None and self.depth(n, n.home) == 1:  # follower._slots
                kept = n.slots
                n.slots = st.root_fanout(self.visible, n.nid, n.home, self.k, rate, n.slots)
                n.kept = kept - n.slots  # lent to alternates (relay.ShardServer.kept)
        # relay.ShardServer.shed: children past the slots (at the origin, past their stripe's share) give theirs up
        for c in st.over_share(self._child_info(self.active(n)), n.slots, self.k if n.idx == ORIGIN else 1):
            n.children.pop(c, None)
            self.clock.at(
                self.clock.now + self.rng.random() * KEEPALIVE_S + self.rtt(n, self.nodes[c[0]]),
                self._refused,
                self.nodes[c[0]],
                c[1],
                n,
            )

    # ---------------------------------------------------------------- joining, attaching, leaving
    def join(self, n: Node) -> None:
        n.alive = True
        self.net.alive[n.idx] = True
        if n.idx == ORIGIN:
            self.plan_slots(n)
            self.republish(n)
            return
        n.home = st.choose_home(self.visible, n.nid, self.k, self.plan_rate()) if self.fixed_slots is None else 0
        n.moved_at = self.clock.now - REHOME_HOLD_S + REHOME_JOIN_S  # as follower._plan_stripes
        self.plan_slots(n)
        self.publish(n)  # the node's first record: others choosing a home stripe count it from now (+ the lag)
        self.clock.at(self.clock.now + REPUBLISH_S * self.rng.random(), self.republish, n)
        self.clock.at(self.clock.now + REHOME_S * (0.5 + self.rng.random()), self.rehome, n)
        for s in range(self.k):
            self.no_parent_since[(n.idx, s)] = self.clock.now
            self.choose(n, s)
        if self.version_out:
            self.fetch.begin(n)

    def rehome(self, n: Node) -> None:
        """MIRROR of follower._rehome (the decision: ``stripes.rehome_moves``): between versions (neither the node
        nor a child of it fetching, for REHOME_IDLE_S), not within REHOME_JOIN_S of joining or REHOME_HOLD_S of
        its last move, move the home stripe where the plan says; its children there are refused at their next
        keep-alive."""
        if not n.alive:
            return
        self.clock.at(self.clock.now + REHOME_S * (0.5 + self.rng.random()), self.rehome, n)
        if self.fixed_slots is not None or self.k < 2 or not n.reachable or n.fetching:
            return
        if any(self.nodes[c].fetching for c, _ in n.children):
            n.sent_at = self.clock.now
        if self.clock.now - n.sent_at < REHOME_IDLE_S:
            return
        self.climb(n)
        if self.clock.now - n.moved_at < REHOME_HOLD_S:
            return
        low = self.moves().get(n.nid)
        if low is None or low == n.home:
            return
        old, n.home, n.moved_at = n.home, low, self.clock.now
        self.stats.rehomed += 1
        for c, s in [c for c in n.children if c[1] == old]:
            n.children.pop((c, s))
            self.clock.at(
                self.clock.now + self.rng.random() * KEEPALIVE_S + self.rtt(n, self.nodes[c]),
                self._refused,
                self.nodes[c],
                s,
                n,
            )
        self.publish(n)

    def climb(self, n: Node) -> None:
        """MIRROR of links.Attachments.climb (called where follower.keep_attached calls it, after the home
        decision): a node at home whose parent in its home stripe is not the stripe's root asks its grandparent
        for a slot; a full one gives it a leaf's slot (``admit``), one that refuses is not asked again for
        CLIMB_REFUSED_S. The answer comes a round trip later."""
        s, now = n.home, self.clock.now
        if n.slots <= 0 or n.parent[s] < 0:
            return
        path = self.path(n, s)  # n, its parent, its grandparent, ..., the origin
        if len(path) < 4 or path[-1] != ORIGIN or n.climb_after.get(path[2], -1e18) > now or path[2] in n.avoid:
            return
        t = self.nodes[path[2]]
        if st.announced_home(self.visible, t.nid) != s:
            return
        self.clock.at(now + self.rtt(n, t), self._climbed, n, s, t, n.parent[s])

    def _climbed(self, n: Node, s: int, t: Node, was: int) -> None:
        if not n.alive or n.parent[s] != was or n.home != s:
            return
        status, _ = self.admit(t, n, s)
        if status != 200:
            n.climb_after[t.idx] = self.clock.now + CLIMB_REFUSED_S
            return
        self.nodes[was].children.pop((n.idx, s), None)
        self.publish(self.nodes[was])
        self.stats.climbs += 1
        self.adopt(n, s, t)

    def moves(self) -> dict[str, int]:
        """``stripes.rehome_moves`` over every record, computed again whenever a record's stripe or slots changed
        (every node computes the same plan from the same records; the node reads them REHOME_S old at most)."""
        if self._moves_dirty and self.clock.now - self._moves_at >= self.moves_s:
            self._moves_dirty, self._moves_at = False, self.clock.now
            self._moves = st.rehome_moves(self.visible, self.k, self.plan_rate(), st.stripe_need(self.visible, self.k))
        return self._moves

    def choose(self, n: Node, s: int) -> None:
        """MIRROR of links.Attachments.choose, per stripe: the candidates ``tree.parents`` orders, asked in turn."""
        if not n.alive or n.parent[s] >= 0 or n.choosing[s]:
            return
        n.choosing[s] = True
        now = self.clock.now
        n.avoid = {i: t for i, t in n.avoid.items() if t > now}
        avoid = {self.nodes[i].nid for i in n.avoid}
        queue = self.candidates(n, s, avoid, home=s == n.home and n.reachable)
        self._ask(n, s, queue, set(), now + CHOOSE_BUDGET_S)

    def _ask(self, n: Node, s: int, queue: list[Candidate], tried: set[str], deadline: float) -> None:
        if not n.alive or n.parent[s] >= 0:
            n.choosing[s] = False
            return
        while queue and queue[0].node_id in tried:
            queue.pop(0)
        if not queue or len(tried) >= MAX_ATTACH_TRIES or self.clock.now >= deadline:
            n.choosing[s] = False  # keep_attached asks again at its next round
            self.stats.no_slot_rounds += 1
            self.clock.at(self.clock.now + KEEPALIVE_S, self.choose, n, s)
            return
        c = queue.pop(0)
        tried.add(c.node_id)
        t = self.nodes[self.ids[c.node_id]]
        self.stats.asks += 1
        if t.alive:
            self.clock.at(self.clock.now + self.rtt(n, t), self._answer, n, s, t, queue, tried, deadline)
        else:  # silent: the next candidate is asked after the stagger (this one never answers)
            self.stats.silent += 1
            self.clock.at(self.clock.now + ASK_STAGGER_S, self._ask, n, s, queue, tried, deadline)

    def admit(self, t: Node, n: Node, s: int) -> tuple[int, list[int]]:
        """MIRROR of relay.ShardServer._attach/_admit: 200, 409 (not rooted, we are its ancestor, or a new child
        is ahead of us: _behind) or 503 with its children in the stripe. The origin's slots are shared equally by
        the stripes (_room)."""
        if not t.alive:
            return 0, []
        if t.idx != ORIGIN and (t.home != s or t.parent[s] < 0):
            return 409, []
        if t.idx != ORIGIN and n.idx in self.path(t, s):
            return 409, []
        active = self.active(t)
        if (n.idx, s) in active:
            return 200, []
        held = self.net.got[[t.idx, n.idx], s] // self.net.shard  # shards of the stripe: cut-through, verified soon
        if t.idx != ORIGIN and self.version_out and held[0] + BEHIND_SHARDS < held[1] // 2:
            return 409, []  # relay._behind: it joined late, and would hold the child back
        if active and len(active) >= t.slots:
            silent = min(active, key=lambda c: active[c])
            if self.clock.now - active[silent] >= CONTESTED_TTL_S:
                t.children.pop(silent, None)
                active.pop(silent)
        ok = self._room(t, active, s)
        if not ok and self.preempt:
            # stripes.to_release, as relay.ShardServer._make_room: a node at home in the stripe takes a leaf's slot
            # (it finds a parent below at its next keep-alive; without it, home nodes that came late found their
            # stripe's slots taken by leaves, could not root themselves, so offered none of theirs: netns N=8, 16),
            # and at the origin a stripe under its share takes a slot of one over it
            leaf = not (s == n.home and n.reachable and n.slots > 0)
            c = st.to_release(self._child_info(active), s, leaf, t.slots, self.k if t.idx == ORIGIN else None)
            if c is not None:
                active.pop(c)
                t.children.pop(c, None)
                self.stats.preempted += 1
                self.clock.at(
                    self.clock.now + self.rng.random() * KEEPALIVE_S + self.rtt(t, self.nodes[c[0]]),
                    self._refused,
                    self.nodes[c[0]],
                    c[1],
                    t,
                )
                ok = self._room(t, active, s)  # not when its slots were planned down below its children meanwhile
        if ok:
            t.children = {c: v for c, v in t.children.items() if c in active}
            t.children[(n.idx, s)] = self.clock.now
            self.publish(t)
            return 200, []
        return 503, [c[0] for c in active if c[1] == s]

    def _room(self, t: Node, active: dict[tuple[int, int], float], s: int) -> bool:
        """relay.ShardServer._room: ``stripes.has_room`` (the origin's slots shared equally by the stripes)."""
        return st.has_room([c[1] for c in active], s, t.slots, self.k if t.idx == ORIGIN else None)

    def _child_info(self, active: dict[tuple[int, int], float]) -> dict[tuple[int, int], tuple[int, bool, float]]:
        """As relay.ShardServer._child_info: each child's stripe, whether it is a leaf there, when last heard."""
        return {c: (c[1], not self._interior(*c), v) for c, v in active.items()}

    def _interior(self, c: int, s: int) -> bool:
        n = self.nodes[c]
        return n.reachable and n.home == s and n.slots > 0

    def _refused(self, n: Node, s: int, t: Node) -> None:
        """A keep-alive answered 503 (the slot went to another): links.Attachments.leave, avoiding it
        REFUSED_AVOID_S."""
        if n.alive and n.parent[s] == t.idx and (n.idx, s) not in t.children:
            self.leave_parent(n, s, REFUSED_AVOID_S)

    def _answer(self, n: Node, s: int, t: Node, queue: list[Candidate], tried: set[str], deadline: float) -> None:
        if not n.alive or n.parent[s] >= 0:
            if n.parent[s] != t.idx:
                t.children.pop((n.idx, s), None)
            n.choosing[s] = False
            return
        status, kids = self.admit(t, n, s)
        if status == 200:
            self.adopt(n, s, t)
            n.choosing[s] = False
            return
        self.stats.refused += 1
        if status == 503 and kids:  # only those at home in the stripe take children in it (links.Attachments.choose)
            found = below(self.visible, [self.nodes[i].nid for i in kids], tried | {n.nid})
            queue[:0] = [c for c in found if self.k < 2 or st.announced_home(self.visible, c.node_id) == s]
        self._ask(n, s, queue, tried, deadline)

    def adopt(self, n: Node, s: int, t: Node) -> None:
        n.parent[s] = t.idx
        self.stats.adopted += 1
        since = self.no_parent_since.pop((n.idx, s), None)
        if since is not None and self.version_out:
            self.stats.detached_s += self.clock.now - max(since, 0.0)
        src = n.sources.get(t.nid)
        if src is not None:  # fetch.ShardFetcher.forgive
            src.full, src.failed, src.away_until = False, 0, 0.0
        n.refreshed = -1e9
        if self.net.want[n.idx, s]:
            self.fetch.set_source(n, s, t)
        if s == n.home:
            self.publish(n)

    def leave_parent(self, n: Node, s: int, avoid_s: float) -> None:
        """links.Attachments.leave: drop the parent (avoided for a while) and choose again at once."""
        p = n.parent[s]
        if p < 0:
            return
        n.parent[s] = -1
        self.stats.reparents += 1
        self.no_parent_since[(n.idx, s)] = self.clock.now
        n.avoid[p] = self.clock.now + avoid_s
        self.nodes[p].children.pop((n.idx, s), None)
        if self.net.src[n.idx, s] == p:
            self.net.src[n.idx, s] = -1
            self.net.rate[n.idx, s] = 0.0
        n.refreshed = -1e9
        if s == n.home:
            self.publish(n)
        self.choose(n, s)
        if self.net.want[n.idx, s] and self.net.src[n.idx, s] < 0:
            self.fetch.pick(n, s)

    def depart(self, n: Node) -> None:
        """``n`` vanishes (no goodbye): its flows stop now; who used it notices after the keep-alive delay."""
        n.alive, n.left_at = False, self.clock.now
        self.net.alive[n.idx] = False
        self.net.rate[n.idx, :] = 0.0
        users = np.nonzero(self.net.src == n.idx)
        self.net.rate[users] = 0.0
        sides = [key for key, x in self.net.side.items() if int(x[0]) == n.idx]
        for r, s in [*zip(*users, strict=True), *sides]:
            self.clock.at(
                self.clock.now + self.rng.random() * KEEPALIVE_S + self.detect_s,
                self._noticed,
                self.nodes[int(r)],
                int(s),
                n,
            )
        for (c, s), _ in list(n.children.items()):
            if self.net.src[c, s] != n.idx:
                self.clock.at(
                    self.clock.now + self.rng.random() * KEEPALIVE_S + self.detect_s, self._noticed, self.nodes[c], s, n
                )
        for p in set(n.parent):
            if p >= 0:
                self.clock.at(self.clock.now + CHILD_TTL_S, self.publish, self.nodes[p])

    def _noticed(self, n: Node, s: int, gone: Node) -> None:
        if not n.alive:
            return
        src = n.sources.get(gone.nid)
        if src is not None:
            src.failed += 2
            src.away_until = self.clock.now + UNREACHABLE_AVOID_S
        if n.parent[s] == gone.idx:
            self.leave_parent(n, s, UNREACHABLE_AVOID_S)
        elif self.net.src[n.idx, s] == gone.idx:  # an alternate for a shard: back to the queue, picked again
            self.net.src[n.idx, s] = -1
            self.fetch.pick(n, s)
        side = self.net.side.get((n.idx, s))
        if side is not None and int(side[0]) == gone.idx:
            self.net.cancel_side(n.idx, s)
            self.fetch.spare.discard((n.idx, s))
            self.fetch.lent_spare.discard((n.idx, s))
