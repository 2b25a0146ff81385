"""Who keeps a relay slot: a child holds one only while it receives through it, and at the origin a node that
earned its place comes before one that did not.

Idle children (``Feeding``, one per shard server, driven by relay.ShardServer on each slot request and each chunk
sent): a child slot owes a fetch from the moment this node holds something of the slot's stripe that the child
has not been sent: a version with a shard of that stripe held here, of which the slot has been sent nothing yet;
or, for a new slot, the version the child says it is fetching, when it says it holds fewer of that stripe's shards
than this node. Any shard byte sent to the slot pays the debt. A slot that has owed for ``FEED_GRACE_S`` is idle:
nothing reaches its subtree through it, and it goes to the next node that asks for a slot and has something to
fetch here (relay.ShardServer._make_room). Keep-alives keep a slot from timing out, never from that. A child that
already holds the newest version when it attaches (between versions, re-parenting) owes nothing until the next
version begins here, so a node that only sends keep-alives holds a slot against other askers until the next
version arrives here, plus ``FEED_GRACE_S``, and no longer. An honest child fetches a version within a second or
two of its parent's news (``/relay/next``); an inference node busy generating fetches after its batch, and is
idle meanwhile: its slot goes to an asker only if there is no free one.

Earned slots at the origin (``Earned``, which the trainer hands to its ShardServer): a node earned a slot if the
trainer trusts its key (past probation and not banned, roles/admission.py), or if a trusted node vouches for it.
Each trusted node that holds a version of the run's epoch vouches for exactly one node: the origin's child it
hangs from, found by following the ``parent`` its own signed record names, then the parents named by the records
above it, up to the node whose parent is the origin. Relay-role nodes never produce batches: a relay near the
origin earns its slot by the trusted receivers below it. The witness is a trusted key, which cost
``probation_batches`` batches the trainer judged itself, so a liar gets one vouched key per trusted key that names
it and never more: keys chained below each other in made-up records get only the top of the chain vouched; a
parent that stops serving loses its trusted children (they leave a parent that fails to serve, follower.py) and
its standing with them, within a record refresh. Upload figures and depths in records count for nothing here.

At the origin (relay.ShardServer._make_room), an earned node that finds no free slot takes one from a child that has not
earned its own; a node that has not earned one takes a free slot (so a new swarm, where nobody has earned anything yet,
forms as without this rule), an idle one, or one the tree's usual rules give it among children that have not earned
theirs either (stripes.to_release); else it is sent down the tree: the 503 names the children that hold no idle slot and
earned their place or received shards through it. A node that only holds a slot is never named; a relay that fetched
through its slot is, earned or not: in a swarm of relays alone nobody earns anything, and a node at home in a stripe
whose nodes are all full finds the leaf slot it may take only through those names (a 503 that names nobody leaves it
never rooted in its home stripe: docs/notes/weights-findings.md).

``vouched`` and ``Feeding`` are pure (the caller passes the clock); ``Earned`` caches ``vouched`` for
``VOUCH_REFRESH_S``: O(records x depth) at most once a second, however many slot requests ask.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable

from intellect_node.weights.tree import MAX_DEPTH
from intellect_protocol.messages import NodeRecord

FEED_GRACE_S = 20.0
"""How long a child slot may owe a fetch (see the module docstring) before it counts as idle."""
VOUCH_REFRESH_S = 1.0
"""Who is vouched for is worked out again at most this often (and whenever the records are read again)."""


def _holds(r: NodeRecord | None, epoch: int) -> bool:
    return r is not None and r.epoch == epoch and r.weight_version >= 0


def vouched(records: dict[str, NodeRecord], trusted: Callable[[str], bool], origin: str, epoch: int) -> set[str]:
    """The nodes trusted nodes vouch for: for each trusted node holding a version of ``epoch``, the origin's child
    on its path from the origin by the records' ``parent`` fields (every record on the way holding a version of
    ``epoch``, none named twice, at most ``MAX_DEPTH`` hops). A trusted node that is itself the origin's child,
    or whose path does not reach the origin, vouches for nobody."""
    out: set[str] = set()
    for nid, r in records.items():
        if nid == origin or not _holds(r, epoch) or not trusted(nid):
            continue
        node, seen = nid, {nid}
        for _ in range(MAX_DEPTH):
            relay = records[node].relay
            parent = relay.parent if relay is not None else None
            if parent == origin:
                if node != nid:
                    out.add(node)
                break
            if parent is None or parent in seen or not _holds(records.get(parent), epoch):
                break
            seen.add(parent)
            node = parent
    return out


class Earned:
    """Whether a node earned a slot at the origin: ``trusted`` (the trainer's: past probation, not banned), or
    vouched for (``vouched``) by the records ``records`` returns, the run epoch ``epoch`` returns."""

    def __init__(
        self,
        trusted: Callable[[str], bool],
        records: Callable[[], dict[str, NodeRecord]],
        origin: str,
        epoch: Callable[[], int],
    ) -> None:
        self.trusted = trusted
        self.records = records
        self.origin = origin
        self.epoch = epoch
        self._vouched: set[str] = set()
        self._read: dict[str, NodeRecord] | None = None
        self._at = -1e9

    def __call__(self, node_id: str) -> bool:
        if self.trusted(node_id):
            return True
        records, now = self.records(), time.monotonic()
        if records is not self._read or now - self._at >= VOUCH_REFRESH_S:
            self._vouched = vouched(records, self.trusted, self.origin, self.epoch())
            self._read, self._at = records, now
        return node_id in self._vouched


class Feeding:
    """Which child slots (``node_id/stripe``) of one shard server owe a fetch, and since when (module docstring)."""

    def __init__(self) -> None:
        self._owed: dict[str, float] = {}
        """Slot -> since when it owes a fetch."""
        self._fed: dict[str, int] = {}
        """Slot -> the newest version of which it was sent a byte."""
        self._noted: dict[int, int] = {}
        """Stripe -> the newest version seen begun here with a shard of that stripe (slots then owe it)."""
        self._epoch: int | None = None

    def epoch(self, epoch: int | None) -> None:
        """The store holds run epoch ``epoch``: versions of another count from 0 again, so what was noted is void."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._noted.clear()
            self._fed.clear()

    def attached(self, slot: str, lacks: bool, now: float) -> None:
        """A new slot; ``lacks``: the child says it holds fewer shards of its stripe than this node does."""
        if lacks:
            self._owed.setdefault(slot, now)

    def began(self, stripe: int, version: int, slots: Iterable[str], now: float) -> None:
        """``version`` has a shard of ``stripe`` here: each of ``slots`` (the stripe's) that has been sent
        nothing of it owes a fetch from now, once per version and stripe."""
        if version <= self._noted.get(stripe, -1):
            return
        self._noted[stripe] = version
        for slot in slots:
            if self._fed.get(slot, -1) < version:
                self._owed.setdefault(slot, now)

    def noted(self, stripe: int) -> int:
        return self._noted.get(stripe, -1)

    def fed(self, slot: str, version: int) -> None:
        """A shard byte of ``version`` went to ``slot``."""
        self._owed.pop(slot, None)
        if self._fed.get(slot, -1) < version:
            self._fed[slot] = version

    def keep(self, slots: Container[str]) -> None:
        """Forget every slot but ``slots`` (those that expired)."""
        self._owed = {c: t for c, t in self._owed.items() if c in slots}
        self._fed = {c: v for c, v in self._fed.items() if c in slots}

    def forget(self, slot: str) -> None:
        self._owed.pop(slot, None)
        self._fed.pop(slot, None)

    def was_fed(self, slot: str) -> bool:
        """Whether a shard byte ever went to ``slot`` (of this epoch, while it held the slot)."""
        return slot in self._fed

    def idle_s(self, slot: str, now: float) -> float:
        """How long past ``FEED_GRACE_S`` the slot has owed a fetch (negative or 0: not idle)."""
        since = self._owed.get(slot)
        return -1.0 if since is None else now - since - FEED_GRACE_S

    def idle(self, slot: str, now: float) -> bool:
        return self.idle_s(slot, now) >= 0.0
