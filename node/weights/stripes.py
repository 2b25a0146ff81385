"""Striped broadcast: each version's shards are split into k stripes, each spread by its own tree (as in
SplitStream), and every node takes children in one stripe only, its home stripe.

A single tree cannot keep every upload busy at a fan-out above 1: a node with two children sends each half its
upload, so the second level receives at half rate, and a chain (fan-out 1) is full rate but as deep as the swarm,
stalled by any slow or departing node above. With k stripes, every node receives all k at once, each at rate
R / k, and uploads its home stripe to about ``upload / (R / k)`` children: with equal links that is k children
(fan-out k) and every upload busy at full rate; a node with ten times the upload serves ten times the children,
and a node slower than a stripe (or unreachable) serves none and is a leaf everywhere. Trees stay logarithmic in
depth. The common rate R is planned from the uploads nodes announce (capped as ``tree.MAX_CLAIMED_BPS``), a share
``SLACK`` below what they could carry on average, so that rounding and an uneven share of nodes between stripes
still leave a slot for everyone. Those announcements are a peer's word: they order and size a node's own plan, and
never the origin's (``origin_slots`` reads the origin's own measured upload and how many receivers there are).

Everything here is pure: the node (follower.py, relay.py) and the broadcast simulator (benchmarks/simulate.py)
run the same functions.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import TypeVar

from intellect_node.weights.tree import MAX_CLAIMED_BPS
from intellect_protocol.messages import NodeRecord

T = TypeVar("T")

DEFAULT_STRIPES = 4
"""Stripes per version, set by the origin (its record carries them). Four keeps a 64 MiB version of 1 MiB shards
at 16 shards a stripe, and a volunteer's fan-out at four children with equal links."""
SLACK = 0.85
"""The rate planned is this share of the average upload: spare slots for rounding and uneven stripes."""
SPARE = 0.05
"""Slots planned beyond what the receivers need between them: nodes come and go, stripes are not all equal."""
MAX_SLOTS = 256
"""Children one node serves at most, whatever it claims (a claim is a peer's word)."""


def stripe_of(index: int, stripes: int) -> int:
    """The stripe of the ``index``-th shard of a manifest: round robin, so every stripe holds an even share."""
    return index % max(1, stripes)


def claim(r: NodeRecord) -> float:
    """What a record says its node uploads (bytes/s), bounded; 0 when it does not say."""
    if r.relay is None:
        return 0.0
    return min(max(r.relay.upload_bps, 0.0), MAX_CLAIMED_BPS)


def planned_rate(
    uploads: Iterable[float], origin_bps: float, receivers: int, stripes: int, origin_slots: int | None = None
) -> float:
    """The per-stripe rate (bytes/s) the swarm can carry: ``SLACK`` of the mean upload over the receivers (the
    origin's included) or of the origin's upload, whichever is lower, over the stripes; lower still where the
    slots it gives (``fanout`` of every upload, the origin's ``max(k, ...)``) fall short of ``1 + SPARE`` times
    what the receivers need (one parent in every stripe each), down to a quarter of it. Unknown uploads (0)
    count as the mean of the known ones (their nodes serve k children: ``fanout``); with none known, as the
    origin's. 0 when nothing at all is known. ``origin_slots``: the children the origin says it serves (its
    record, signed by the run key), when known: it plans them from its own upload alone (``origin_slots``), not
    from the others' claims, so it may serve fewer than its upload would carry at this rate.

    The mean alone over-promises: each node rounds its children down (with uploads from 10 Mbit/s to 1 Gbit/s
    that loses 8% of the upload), and a swarm left with only 1-5% more slots than it needs has stripes short of
    parents as nodes come and go (docs/notes/weights-findings.md, "Spare slots")."""
    ups = list(uploads)
    known = [u for u in ups if u > 0]
    if origin_bps <= 0 and not known:
        return 0.0
    mean = sum(known) / len(known) if known else origin_bps
    origin = origin_bps if origin_bps > 0 else mean
    total = origin + sum(known) + mean * (len(ups) - len(known))
    k = max(1, stripes)
    rate = SLACK * min(total / max(1, receivers), origin) / k
    need = (1 + SPARE) * k * receivers
    unknown = (len(ups) - len(known)) * k

    def slots(r: float) -> int:
        return (
            sum(fanout(u, r, k) for u in known)
            + unknown
            + (origin_fanout(origin, r, k) if origin_slots is None else origin_slots)
        )

    if slots(rate) >= need:
        return rate
    lo, hi = rate / 4, rate
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if slots(mid) >= need else (lo, mid)
    return lo


def fanout(upload_bps: float, stripe_bps: float, stripes: int) -> int:
    """Children a node serves in its home stripe: as many as its upload carries at the stripe rate (planned
    ``SLACK`` low, so equal links give k children even when measured a little low). Unknown rates (0): k
    children, as with equal links."""
    if stripe_bps <= 0 or upload_bps <= 0:
        return max(1, stripes)
    return max(0, min(MAX_SLOTS, math.floor(upload_bps / stripe_bps)))


def origin_fanout(origin_bps: float, stripe_bps: float, stripes: int) -> int:
    """The origin's children: as many as its upload carries at the stripe rate, one per stripe at least, and
    the same number in every stripe (relay.ShardServer._room), so a multiple of ``stripes``: with 5 slots for 4
    stripes one stripe would get two fifths of the origin's upload and the others a fifth each, and the version
    would take 5/4 as long as with 4 (docs/weights.md, "The origin's upload in equal shares")."""
    k = max(1, stripes)
    n = max(k, fanout(origin_bps, stripe_bps, k) if origin_bps > 0 else k)
    return n - n % k


def share(slots: int, stripes: int) -> int:
    """Children the origin takes in each stripe: an equal share of its slots, one at least."""
    return max(1, slots // max(1, stripes))


def has_room(stripes_of_children: list[int], stripe: int, slots: int, stripes: int | None) -> bool:
    """Whether a node with children in ``stripes_of_children`` (one entry per child) takes another in
    ``stripe``. ``stripes``: set for the origin, which serves every stripe and gives each an equal share of its
    slots (a crowd in one stripe cannot shut the others out, nor take more than its share of the origin's
    upload: ``origin_fanout``); None for a relay (its home stripe only)."""
    if stripes is None or len(stripes_of_children) >= slots:
        return len(stripes_of_children) < slots
    return stripes_of_children.count(stripe) < share(slots, stripes)


def to_release(
    children: dict[T, tuple[int, bool, float]],
    stripe: int,
    leaf: bool,
    slots: int,
    stripes: int | None,
    movable: Callable[[T], bool] | None = None,
) -> T | None:
    """Which child gives up its slot to a newcomer in ``stripe`` when there is no room (``has_room``), if any.
    ``children``: child -> (its stripe here, whether it is a leaf there, when last heard from). A newcomer at home
    in the stripe (not ``leaf``) takes a leaf's slot, one of its own stripe first: interior nodes belong high in
    a stripe's tree, leaves below them (with the origin's slot for a stripe taken by a leaf, that stripe's tree
    has no root). At the origin only a child of the same stripe, or one of a stripe over its share (slots planned
    down leave two children in one stripe and none in another), at home or not, a leaf first. ``movable``: the
    children the newcomer may move at all (the origin: none that earned its slot, for one that did not)."""

    def key(c: T) -> tuple[bool, bool, float]:
        return children[c][0] != stripe, not children[c][1], children[c][2]

    def ok(c: T) -> bool:
        return movable is None or movable(c)

    if stripes is not None:
        each = share(slots, stripes)
        count = Counter(x[0] for x in children.values())
        over = [c for c, x in children.items() if count[x[0]] > each and ok(c)]
        if count[stripe] < each and over:
            return min(over, key=key)
    mine = [c for c, x in children.items() if x[1] and not (stripes is not None and x[0] != stripe) and ok(c)]
    return min(mine, key=key) if mine and not leaf else None


def over_share(children: dict[T, tuple[int, bool, float]], slots: int, stripes: int) -> list[T]:
    """Children past their stripe's share of a node's slots (``has_room``; ``stripes`` 1 for a relay, all its
    children in its home stripe), leaves first, then those heard from longest ago: its slots were planned down
    (early on, with few records read, a node plans too many), and a stripe with two children of the origin gets
    its data sent twice. ``children`` as ``to_release``."""
    each = share(slots, stripes)
    out: list[T] = []
    for s in {x[0] for x in children.values()}:
        mine = sorted((c for c, x in children.items() if x[0] == s), key=lambda c: (not children[c][1], children[c][2]))
        out += mine[: max(0, len(mine) - each)]
    return out


def origin_slots(receivers: int, origin_bps: float, stripes: int) -> int:
    """Children the origin serves (``origin_fanout``) at the planned stripe rate for ``receivers`` nodes; no spare:
    a stripe's first hop sets its rate for the whole tree below. Only what the origin knows itself goes in: its
    measured upload, and every other upload counted as unknown (as fast as the origin's, ``planned_rate``). The
    uploads records announce are a peer's word: read here, one record claiming 10 Gbit/s among sixteen of 25 Mbit/s
    would cut a 250 Mbit/s origin from 28 slots to 4 (fewer slots for a few keys to hold), and 64 records claiming
    1 byte/s would make a 25 Mbit/s origin plan 256 children, each at a crawl. An operator whose origin is much faster
    than its volunteers sets its slots (``--relay-slots``)."""
    return origin_fanout(origin_bps, planned_rate([0.0] * receivers, origin_bps, receivers, stripes), stripes)


def announced_home(records: dict[str, NodeRecord], node: str) -> int | None:
    """The stripe ``node``'s record says it takes children in: -1 if it serves none (no relay info), None if
    there is no record of it."""
    r = records.get(node)
    if r is None:
        return None
    return r.relay.stripe if r.relay is not None else -1


def planned(r: NodeRecord, stripes: int) -> bool:
    """Whether ``r`` is the record of a relay that planned its home among ``stripes`` stripes. A node announces a
    home before it has read the origin's record (one stripe, home 0: ``RelayInfo``'s defaults); counted, those
    records made every node that joined at once see stripe 0 as the fullest and all of them chose the same home, so
    the first version crossed one stripe with no parent but the origin and the moves between versions
    (``rehome_moves``) reshaped the whole tree at once (tests/weights/test_relay_tree.py once waited 60 s for it)."""
    return r.relay is not None and r.relay.stripes == max(1, stripes)


def stripe_capacity(records: dict[str, NodeRecord], me: str, stripes: int, rate: float) -> list[float]:
    """Per stripe, the children the nodes at home there can serve (announced slots; else ``fanout`` of their
    claimed upload), leaving out ``me``, the origin, nodes nobody can reach and nodes that have not planned their
    stripes yet (``planned``)."""
    capacity = [0.0] * max(1, stripes)
    for nid, r in records.items():
        if nid == me or r.role == "trainer" or not r.http_url or not planned(r, stripes):
            continue
        assert r.relay is not None
        s = r.relay.stripe
        if 0 <= s < len(capacity):
            capacity[s] += r.relay.slots_total if r.relay.slots_total else fanout(claim(r), rate, stripes)
    return capacity


def choose_home(records: dict[str, NodeRecord], me: str, stripes: int, rate: float) -> int:
    """The home stripe for a joining node: of two stripes picked by a hash of its id, the one with less serving
    capacity in the records (ties: the first). Nodes that join at once see the same, stale records: told to take
    the emptiest stripe, they would all take it; with two choices each, a stripe that looks empty draws about half
    of them, and the moves between versions (``rehome_moves``) even out the rest (docs/weights.md, "Homes spread,
    then stay")."""
    capacity = stripe_capacity(records, me, stripes, rate)
    k = len(capacity)
    first = zlib.crc32(f"{me}/home".encode()) % k
    second = (first + 1 + zlib.crc32(f"{me}/other".encode()) % max(1, k - 1)) % k if k > 1 else first
    return second if capacity[second] < capacity[first] else first


def root_fanout(records: dict[str, NodeRecord], me: str, home: int, stripes: int, rate: float, slots: int) -> int:
    """Children a stripe's root (the origin's child there) serves: one fewer than its upload carries when the
    others at home in the stripe have the slot to spare (``stripe_capacity`` against ``stripe_need``). The origin
    shares its link among the stripes unevenly (TCP), and a root fed faster than a stripe's rate can pass on only
    its upload over its children each: with every slot of the stripe in use there is no slack anywhere below it,
    and what the origin sent ahead waits at the root. With one child fewer it passes on a third more per child
    (docs/notes/weights-findings.md, "A root with a slot to spare")."""
    if slots < 2 or not 0 <= home < max(1, stripes):
        return slots
    roots = 1 + sum(
        1
        for nid, r in records.items()
        if nid != me and r.relay is not None and r.role != "trainer" and r.relay.stripe == home and r.relay.depth == 1
    )
    # every root of the stripe (a fast origin has many) may take one off at once: room for all of them
    spare = stripe_capacity(records, me, stripes, rate)[home] + slots - roots - stripe_need(records, stripes)
    return slots - 1 if spare >= 0 else slots


def stripe_need(records: dict[str, NodeRecord], stripes: int) -> int:
    """Children the nodes at home in a stripe must serve between them: every receiver in the records needs a
    parent in every stripe, and the origin's slots (its record's, spread over the stripes) serve a few."""
    receivers = sum(1 for r in records.values() if r.role != "trainer")
    origin = [r.relay.slots_total for r in records.values() if r.role == "trainer" and r.relay is not None]
    return max(0, receivers - max(1, max(origin, default=0) // max(1, stripes)))


def rehome_moves(records: dict[str, NodeRecord], stripes: int, rate: float, need: int) -> dict[str, int]:
    """Which nodes move their home stripe, and where, so that no stripe is short of ``need`` (``stripe_need``).
    Every node computes the same plan from the same records and carries out its own part: nodes are taken fewest
    children first (in order of a hash of their ids among equals); one moves to the stripe with the least capacity
    if that one is short, and if its own stripe keeps enough without it (or, for a node without children, when not
    every stripe can have enough, at least what the other will have with it). Nothing moves once no stripe is short.

    A node with children moves only when its stripe keeps ``need`` without it: its children re-parent there, and a
    stripe it left short would leave them without a parent. Nodes with children do move: were only childless nodes
    to move, a stripe could stay short for good once every node has children, its receivers taking its shards from
    the origin (sent twice).

    The plan is one for all, not each node's own choice on records a DHT lag old: such choices chase each other
    round the stripes, send every tie to stripe 0 and fill a short stripe one round of record updates at a time.
    (docs/weights.md, "Homes spread, then stay"; docs/notes/weights-findings.md, "Moves by one plan".)"""
    k = max(1, stripes)
    capacity = [0.0] * k
    nodes: list[tuple[int, int, str, int, float]] = []
    for nid, r in records.items():
        if r.relay is None or r.role == "trainer" or not r.http_url or not planned(r, k) or not 0 <= r.relay.stripe < k:
            continue
        c = float(r.relay.slots_total or fanout(claim(r), rate, k))
        capacity[r.relay.stripe] += c
        children = max(0, r.relay.slots_total - r.relay.slots_free)
        nodes.append((children, zlib.crc32(nid.encode()), nid, r.relay.stripe, c))
    moves: dict[str, int] = {}
    for children, _, nid, home, c in sorted(nodes):
        low = min(range(k), key=lambda s: (capacity[s], zlib.crc32(f"{nid}/{s}".encode())))
        if capacity[low] >= need:
            break
        if low == home or c <= 0:
            continue
        if capacity[home] - c >= need or (not children and capacity[home] - c >= capacity[low] + c):
            capacity[home] -= c
            capacity[low] += c
            moves[nid] = low
    return moves


class UploadMeter:
    """A node's upload capacity, from what it really sent: bytes per one-second bucket, and the estimate is the
    median of the last ``SPAN`` buckets in which the node sent all second long **and the link was the limit**
    (data waited to be sent at every write: ``backlogged``). A relay passing a stripe on cut-through sends only as
    fast as the stripe arrives: those seconds measure the stripe, not the link, and counting them would make every
    relay's claim fall to its children times the stripe rate, its slots with it, until stripes are short of parents
    (docs/weights.md, "Fan-out from the measured upload"). A node whose link never was the limit has no
    estimate (0: planned as the others). Pure: the caller passes the clock."""

    SPAN = 8

    def __init__(self) -> None:
        self._second = -1
        self._bytes = 0
        self._busy_all = True
        self._full: deque[int] = deque(maxlen=self.SPAN)
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.SPAN)

    def sent(self, n: int, now: float, busy: bool = True, backlogged: bool = True) -> None:
        """``n`` bytes went out at ``now``; ``busy``: a response was in progress throughout since the last call;
        ``backlogged``: bytes written earlier still waited to be sent when these were written."""
        second = int(now)
        if second != self._second:
            consecutive = second == self._second + 1
            if self._second >= 0 and self._busy_all and consecutive and self._bytes > 0:
                self._full.append(self._bytes)
            if self._second >= 0:
                self._recent.append((self._second, self._bytes))
            # a second counts only if sending went on from the one before: a start mid-second is a partial one
            self._second, self._bytes, self._busy_all = second, 0, busy and consecutive
        self._bytes += n
        self._busy_all = self._busy_all and busy and backlogged

    def idle(self, now: float) -> None:
        """Nothing was being sent at ``now``: the current second does not count as a busy one."""
        if int(now) == self._second:
            self._busy_all = False

    def peak_bps(self, now: float) -> float:
        """The most sent over two whole seconds in a row of the last ``SPAN``, per second (one second alone if
        none follows another; 0 if none): the link's rate soon after it was last the limit, where ``bps`` may
        have no estimate yet (pacing.FairShare). One second alone reads high: acknowledgements come in bursts, and a
        fair share paced from it lets the link's receivers drift apart (docs/notes/weights-findings.md)."""
        recent = [(sec, b) for sec, b in self._recent if sec >= int(now) - self.SPAN]
        pairs = [(a + b) / 2 for (s, a), (t, b) in zip(recent, recent[1:], strict=False) if t == s + 1]
        return float(max(pairs or [b for _, b in recent] or [0]))

    def bps(self) -> float:
        """The median of the busy seconds (the first of a burst also fills kernel buffers: it reads high)."""
        if len(self._full) < self.SPAN // 2:
            return 0.0
        return float(sorted(self._full)[len(self._full) // 2])
