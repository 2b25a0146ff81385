"""Where to look for a parent and for alternate sources in the self-organizing relay tree, from DHT records.

Records lag behind the tree, so they only order the places to ask: the parent itself is chosen by attaching
(follower.WeightFollower), and a node takes a child only while it is connected to the origin and never one of
its own ancestors (relay.ShardServer), which keeps the tree free of cycles. Parents to try: relays with a free
upload slot, lowest depth first and faster first at equal depth, that are not (as far as the records tell) this
node's descendants; the origin (the trainer) last. Alternates: nodes that hold the whole version already.
"""

from __future__ import annotations

from dataclasses import dataclass

from intellect_protocol.messages import NodeRecord

MAX_DEPTH = 64


@dataclass(frozen=True)
class Candidate:
    node_id: str
    url: str
    depth: int
    is_parent: bool
    parent_of: frozenset[int] = frozenset()
    """The stripes it is our parent in (stripes.py)."""
    above_of: frozenset[int] = frozenset()
    """The stripes it is the root of two levels above us in (it lends us a slot it keeps: sources.above_due)."""


def _descends_from(records: dict[str, NodeRecord], node: str, ancestor: str) -> bool:
    seen: set[str] = set()
    while node not in seen:
        seen.add(node)
        relay = records[node].relay if node in records else None
        parent = relay.parent if relay is not None else None
        if parent is None:
            return False
        if parent == ancestor:
            return True
        node = parent
    return True  # a cycle in what others claim: treat as unusable


MAX_CLAIMED_BPS = 1.25e9
"""Upload rates a record may claim are read as at most this (10 Gbit/s): a claim orders candidates, it is not
believed past what any volunteer has; what counts afterwards is the rate the fetcher measures."""


def _usable(records: dict[str, NodeRecord], me: str, exclude: set[str] | frozenset[str]) -> list[NodeRecord]:
    """Relays worth asking. Only the origin is at depth 0: a relay claiming it is lying to be chosen first. A
    node holding another run epoch than the trainer's (it has not noticed a restart yet) serves nothing usable."""
    trainers = [r.epoch for r in records.values() if r.role == "trainer" and r.node_id == r.run_id]
    epoch = max(trainers, default=None)
    return [
        r
        for nid, r in records.items()
        if nid != me
        and nid not in exclude
        and r.relay is not None
        and r.http_url
        and r.relay.depth < MAX_DEPTH
        and (r.relay.depth >= 1 or r.role == "trainer")
        and (epoch is None or r.epoch == epoch)
    ]


def _cand(r: NodeRecord, is_parent: bool = False) -> Candidate:
    assert r.relay is not None and r.http_url is not None
    return Candidate(r.node_id, r.http_url, r.relay.depth, is_parent)


def _order(r: NodeRecord) -> tuple[int, float]:
    assert r.relay is not None
    return r.relay.depth, -min(r.relay.upload_bps, MAX_CLAIMED_BPS)


def parents(
    records: dict[str, NodeRecord],
    me: str,
    origin: str,
    exclude: set[str] | frozenset[str] = frozenset(),
    stripe: int | None = None,
    home: bool = True,
    limit: int | None = None,
) -> list[Candidate]:
    """The nodes to ask for a slot, best first: relays with a free slot by depth, then speed; the origin; then,
    for a node at home in ``stripe``, the full relays at home there, by depth. ``stripe``: only relays whose home
    stripe it is (stripes.py). ``home``: whether it is ours too; in another stripe we take no children, so no
    relay there can be our descendant and none is skipped as one. ``limit``: the first this many relays of each
    kind only (a node asks a few dozen at most).

    A full relay gives a leaf's slot to a node at home in its stripe (relay.ShardServer._make_room), so a node
    that moved its home into a stripe whose serving nodes are all full finds its place there: the origin's 503
    names no child that has not earned its slot or received through it, and a child that moved in between
    versions has received nothing yet (without this, a node that moved in can be left without a parent there
    until the next version: docs/notes/weights-findings.md, "The 503 names children that received")."""
    usable = [
        r
        for r in _usable(records, me, exclude)
        if r.node_id != origin
        and r.relay is not None
        and (stripe is None or r.relay.stripe == stripe)
        and not (home and _descends_from(records, r.node_id, me))
    ]
    relays = sorted((r for r in usable if r.relay is not None and r.relay.slots_free > 0), key=_order)
    out = [_cand(r) for r in relays[:limit]]
    if origin in records and origin not in exclude and records[origin].http_url and records[origin].relay:
        out.append(_cand(records[origin]))
    if home and stripe is not None:
        full = sorted((r for r in usable if r.relay is not None and r.relay.slots_free <= 0), key=_order)
        out += [_cand(r) for r in full[:limit]]
    return out


def below(records: dict[str, NodeRecord], children: list[str], tried: set[str]) -> list[Candidate]:
    """The children a full node named in its refusal, as candidates (the free slots are further down)."""
    out = []
    for nid in children:
        r = records.get(nid)
        if nid not in tried and r is not None and r.relay is not None and r.http_url and r.relay.depth < MAX_DEPTH:
            out.append(_cand(r))
    return out


def holders(
    records: dict[str, NodeRecord],
    me: str,
    origin: str,
    version: int,
    exclude: set[str] | frozenset[str] = frozenset(),
    count: int = 2,
) -> list[Candidate]:
    """Alternate sources for ``version``: nodes (not the origin) that hold all of it, by depth, then speed."""
    found = [
        r
        for r in _usable(records, me, exclude)
        if r.node_id != origin and r.relay is not None and version in r.relay.versions and r.relay.slots_free > 0
    ]
    found.sort(key=_order)
    return [_cand(r) for r in found[:count]]


def is_path(path: object) -> bool:
    """A parent's word about its path from the origin: a list of node ids, shorter than the deepest tree we
    accept (a longer one, repeated in this node's next DHT record, would make that record invalid and stop the
    node: docs/notes/weights-findings.md)."""
    return isinstance(path, list) and len(path) < MAX_DEPTH and all(isinstance(x, str) and len(x) == 32 for x in path)
