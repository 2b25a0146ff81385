"""Choosing where to fetch weights from: the self-organizing relay tree, as a pure function of DHT records.

A node keeps its parent while the parent is alive (a stable tree). Otherwise it takes the relay with a free
upload slot and the lowest depth, faster relays first, that holds or is receiving the version, and is not one
of its own descendants; the origin (the trainer) only as the last resort. Its depth is its parent's plus one.
Besides the parent it keeps a few alternates, so a dead, slow or lying parent costs only a switch.
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


def _serves(record: NodeRecord, version: int) -> bool:
    """Holds ``version``, is receiving it, or holds the one before (it follows the run and is about to):
    a child may attach at once, and its requests wait at the parent until the version starts arriving."""
    relay = record.relay
    return relay is not None and (
        version in relay.versions or relay.fetching == version or record.weight_version >= version - 1
    )


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


def plan(
    records: dict[str, NodeRecord],
    me: str,
    origin: str,
    version: int,
    parent: str | None,
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
    alternates: int = 2,
) -> tuple[Candidate | None, list[Candidate]]:
    """The parent to use for ``version`` and the sources to try, best first (the parent first).

    The current parent is kept unless this node saw it fail (``exclude``: banned, unreachable, out of slots) or
    its depth shows a cycle (in a cycle depths grow with every republish until they pass ``MAX_DEPTH``); what
    other records claim about its ancestry
    lags behind a re-shaping tree and is not reason enough to leave it. A new parent is never a descendant.
    """
    usable: dict[str, NodeRecord] = {}
    for nid, r in records.items():
        if nid == me or nid in exclude or r.relay is None or not r.http_url or r.relay.depth >= MAX_DEPTH:
            continue
        if nid not in (origin, parent) and _descends_from(records, nid, me):
            continue
        usable[nid] = r

    def cand(r: NodeRecord, is_parent: bool) -> Candidate:
        assert r.relay is not None and r.http_url is not None
        return Candidate(r.node_id, r.http_url, r.relay.depth, is_parent)

    chosen: NodeRecord | None = None
    if parent is not None and parent in usable and (parent == origin or usable[parent].relay is not None):
        chosen = usable[parent]
    if chosen is None:
        relays = [
            r
            for nid, r in usable.items()
            if nid != origin and _serves(r, version) and r.relay is not None and r.relay.slots_free > 0
        ]
        relays.sort(key=lambda r: (r.relay.depth if r.relay else 0, -(r.relay.upload_bps if r.relay else 0.0)))
        if relays:
            chosen = relays[0]
        elif origin in usable:
            chosen = usable[origin]
    others = [
        r
        for nid, r in usable.items()
        if chosen is not None and nid not in (chosen.node_id, origin) and _serves(r, version)
        and r.relay is not None and r.relay.slots_free > 0
    ]  # fmt: skip
    others.sort(key=lambda r: (r.relay.depth if r.relay else 0, -(r.relay.upload_bps if r.relay else 0.0)))
    sources = [cand(chosen, True)] if chosen is not None else []
    sources += [cand(r, False) for r in others[:alternates]]
    if origin in usable and (chosen is None or chosen.node_id != origin):
        sources.append(cand(usable[origin], False))
    return (sources[0] if chosen is not None else None), sources
