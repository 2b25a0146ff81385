"""Where each shard of a version comes from: the sources a fetcher knows (``Source``) and its choices among them
(``pick_source`` for the next shard of a stripe, ``pick_spare`` at the end of a version, ``above_due`` for the share
a stripe's root two levels up serves, ``faster_than_parent`` for a move). Pure: fetch.ShardFetcher applies them."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Source:
    node_id: str
    url: str
    depth: int
    is_parent: bool = False
    """Our parent in some stripe (``parent_of``: which; the origin can be ours in several)."""
    parent_of: frozenset[int] = frozenset()
    bps: float = 0.0
    ok: int = 0
    failed: int = 0
    full: bool = False
    """It answered 503 (no free slot) last time."""
    away_until: float = 0.0
    """Not asked before this time: no slot, not there yet, or unreachable."""
    above_of: frozenset[int] = frozenset()
    """The stripes it is the root of two levels above us in: asked there only for our share (``above_due``)."""
    spare_until: float = 0.0
    """Not asked for a shard outside its stripes (spare upload, ``pick_spare``; as an alternate while our parent
    elsewhere, ``pick_source``) before this time: it had no slot to spare, or not the shard."""
    active: set[asyncio.Timeout] = field(default_factory=set)
    """The deadlines of transfers from it in flight: ``abort_source`` brings them forward to now."""

    def serves(self, stripe: int | None) -> bool:
        """Whether it is our parent for a shard of ``stripe`` (None: any stripe)."""
        return self.is_parent if stripe is None else stripe in self.parent_of

    def score(self, stripe: int | None = None) -> float:
        base = self.bps if self.bps > 0 else 100e6 / (1 + self.depth)
        return base * (self.ok + 1) / (self.ok + self.failed + 1) * (4.0 if self.serves(stripe) else 1.0)


def pick_source(
    sources: Iterable[Source],
    tried: set[str],
    banned: dict[str, float] | set[str],
    now: float,
    probe: bool,
    stripe: int | None = None,
) -> Source | None:
    """The source for one shard of ``stripe``: the best score among those not away or banned and not yet tried for it
    (all tried: any). An alternate never measured does not win over a usable parent on an assumed rate (else a relay can
    park all its workers on untried alternates for many seconds: docs/notes/weights-findings.md); it gets the pick when
    ``probe`` (one in PROBE_EVERY), so a parent slower than an alternate is found out (the follower then moves below the
    faster one)."""
    # a parent in another stripe that had no alternate's slot for this one (spare_until) is not asked again at once;
    # a stripe's root two levels up only for our share of its stripe (``above_due``, the fetcher asks it)
    sources = [
        s
        for s in sources
        if s.node_id not in banned and not s.above_of and (s.serves(stripe) or s.spare_until <= now or not s.is_parent)
    ]
    usable = [s for s in sources if s.away_until <= now]
    if stripe is not None and any(s.serves(stripe) for s in sources):
        # While we have a parent in the stripe (even one waiting for the shard, away a moment), another stripe's
        # parent is a leaf here: a detour through it takes upload its own children need, and every subtree slows
        # (docs/notes/weights-findings.md, "No detour through another stripe's parent").
        # The origin too, when it is our parent in another stripe: a shard it sends twice spends the swarm's
        # scarcest upload twice. This holds while the stripe's parent is away a moment as well, so a 404 does not
        # open every source (docs/notes/stripes-history.md, "The origin sent shards twice"). As anyone's alternate
        # it serves only from a spare slot (relay.py), and that is spare upload well used.
        usable = [s for s in usable if s.serves(stripe) or not s.is_parent]
    if not usable:
        return None
    fresh = [s for s in usable if s.node_id not in tried] or usable
    if any(s.serves(stripe) for s in fresh):
        untried = [s for s in fresh if not s.serves(stripe) and s.bps == 0 and s.failed == 0 and not s.full]
        if untried and probe:
            return untried[0]
        fresh = [s for s in fresh if s.serves(stripe) or s.bps > 0]
    return max(fresh, key=lambda s: s.score(stripe))


def pick_spare(
    sources: Iterable[Source], banned: dict[str, float] | set[str], now: float, stripe: int
) -> Source | None:
    """A source for a shard of ``stripe`` that a worker done with its own stripe fetches beside the stripe's
    parent (which goes on streaming to the stripe's own worker): a node that holds the whole version, or the origin,
    none of our parents (a parent in another stripe may serve a shard it is still receiving itself, through a free
    slot, and so hold a stripe's last shard at its own pace), on its spare upload (relay.py: while a slot is free
    or no child of its own is being sent anything), best score first. None: every one is away or had no spare
    upload a moment ago."""
    usable = [
        s
        for s in sources
        if s.node_id not in banned and not s.is_parent and s.away_until <= now and s.spare_until <= now
    ]
    return max(usable, key=lambda s: s.score(stripe), default=None)


ABOVE_EVERY = 16


def above_due(node_id: str, position: int) -> bool:
    """Whether the shard at ``position`` in its stripe may come from the stripe's root two levels up (which lends
    the slot it keeps: follower._slots) rather than from our parent: one shard in each run of ABOVE_EVERY (the
    fetcher stops asking once one came), due from a place in the run's first three quarters set by our id, so that
    siblings ask apart, and one refused (the kept slot is one response at a time) is asked again at the next. With
    equal links a node with four children sends a whole copy and its acknowledgements on top, more than the origin,
    and its children fall behind it (docs/notes/stripes-history.md, "The nodes with four children fall behind their
    parent"). Due at one place for all, siblings ask at once and half the share is lost to 503s."""
    return position % ABOVE_EVERY >= zlib.crc32(node_id.encode()) % (ABOVE_EVERY * 3 // 4)


SLOW_FACTOR, SLOW_MIN_SHARDS = 2.0, 3


def faster_than_parent(
    sources: dict[str, Source], parent: str, origin: str, banned: dict[str, float] | set[str]
) -> Source | None:
    """An alternate that delivered at least SLOW_FACTOR times the parent's rate, both over SLOW_MIN_SHARDS shards
    or more (the origin excepted: it stays the last resort): the follower moves below it."""
    mine = sources.get(parent)
    if mine is None or mine.ok < SLOW_MIN_SHARDS or mine.bps <= 0:
        return None
    alts = [
        s
        for s in sources.values()
        if s.node_id != parent
        and not s.is_parent
        and s.node_id != origin
        and s.ok >= SLOW_MIN_SHARDS
        and s.node_id not in banned
    ]
    best = max(alts, key=lambda s: s.bps, default=None)
    return best if best is not None and best.bps >= SLOW_FACTOR * mine.bps else None
