"""The trainer's view of who is in the run: the nodes' signed DHT records, looked up with bounded cost.

A batch from an unknown key triggers a DHT read, but a flood of unknown keys must cost the DHT only a few reads
a second, and a new node's first batch must still get one: hence per-key and global spacing, one read at a time,
a cap on lookups under way, and one lookup per key however many of its requests wait for it. Besides, the trainer
reads every record once every ``REGISTRY_PERIOD_S`` (the origin's slot rules go by who names whom as parent).
Trusted validators (``--validator``) are found here too, in turn.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter

from intellect_node.p2p.dht import Membership
from intellect_protocol.messages import NodeRecord
from intellect_protocol.records import CLOCK_SKEW_S, NODE_TTL_S

logger = logging.getLogger(__name__)
REGISTRY_REFRESH_S = 1.0
"""An unknown signer triggers a fresh DHT lookup at most this often per node id ..."""
REGISTRY_MIN_INTERVAL_S = 0.2
"""... and all unknown signers together at most this often, or ``READ_SHARE`` of the time, if that is rarer."""
PATIENT_REFRESH_S = 2.0
"""A request that can wait (a relay slot, an audit download: its node asks again) triggers a read only when the
last one is older than this: a stranger's signed slot request costs a key generation and a signature, while the
read it bought cost the trainer's DHT about as much CPU (the red team's made-up ids: 1.0-1.2 CPU-s of ours per
CPU-s of theirs). A relay follower's own members check waits as long (weights/follower.py MEMBER_REFRESH_S)."""
READ_SHARE = 0.1
"""At most this share of the time goes to reads that unknown signers trigger: a read of the ``nodes`` key costs
in proportion to the records in it, so a flood of announcements from keys whose records went stale (each one an
unknown signer again) would otherwise buy a whole read every REGISTRY_MIN_INTERVAL_S however large the key grew."""
MAX_TRACKED_LOOKUPS = 10_000
MAX_REGISTRY_WAITERS = 4
"""Lookups for unknown keys under way at once; a request that would start another is refused at once."""
MAX_SHARING = 2
"""Further requests of one key that wait for its lookup under way; more are refused at once (as unknown: a signed
batch from a key the trainer has not read is asked again). Each waits holding a stream slot of the trainer's."""
VALIDATOR_REFRESH_S = 5.0
REGISTRY_PERIOD_S = 10.0
"""The trainer reads every record at least this often: the origin's slots go to the relays that trusted nodes name
as their parent (weights/earned.py), and a record that stopped naming one must count soon."""


class NodeRegistry:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.records: dict[str, NodeRecord] = {}
        """The run's ``nodes`` key as last read, by node id."""
        self._lookup_at: dict[str, float] = {}
        self._registry_at = -math.inf
        self._read_at = -math.inf
        """When the last read of the records (of any kind) began."""
        self._spacing = REGISTRY_MIN_INTERVAL_S
        """Between two reads unknown signers trigger: the last such read's duration over READ_SHARE, at least
        REGISTRY_MIN_INTERVAL_S."""
        self._validators_at = -math.inf
        self._lock = asyncio.Lock()
        self._waiters = 0
        self._pending: dict[str, asyncio.Future[NodeRecord | None]] = {}
        """Lookups under way, by the key they are for (MAX_REGISTRY_WAITERS at most): a second request from the
        same key waits for the same answer."""
        self._sharing: Counter[str] = Counter()
        """Per key with a lookup under way, the further requests waiting for it (MAX_SHARING at most)."""
        self._turn = 0

    async def registered(self, node_id: str, patient: bool = False) -> NodeRecord | None:
        """The node's record; an unknown key triggers a DHT lookup, at most once a second per key and one
        lookup at a time for all keys together, spaced at least REGISTRY_MIN_INTERVAL_S apart (a flood of
        unknown keys costs the DHT at most a few reads a second, and a new node's first batch still gets one).
        ``patient``: a request whose node asks again, which buys a read only once PATIENT_REFRESH_S passed since
        the last one."""
        record = self.records.get(node_id)
        if record is not None:
            return record
        pending = self._pending.get(node_id)
        if pending is not None:  # this key's lookup is under way: its answer is ours too (a producer announces a
            # batch and pushes it at once: the push was refused as unknown), for a few requests of a key at most
            # (each holds one of the trainer's stream slots while it waits) and none that can ask again
            if patient or self._sharing[node_id] >= MAX_SHARING:
                return None
            self._sharing[node_id] += 1
            try:
                return await asyncio.shield(pending)
            finally:
                self._sharing[node_id] -= 1
                if self._sharing[node_id] <= 0:
                    del self._sharing[node_id]
        if time.monotonic() - self._lookup_at.get(node_id, -math.inf) <= REGISTRY_REFRESH_S:
            return None
        if patient and (self._lock.locked() or time.monotonic() - self._read_at < PATIENT_REFRESH_S):
            return None  # a read is under way or was just made: it asks again
        if len(self._lookup_at) > MAX_TRACKED_LOOKUPS:
            self._lookup_at.clear()
        self._lookup_at[node_id] = time.monotonic()
        if self._waiters >= MAX_REGISTRY_WAITERS:  # a flood of unknown keys: do not queue behind it
            return None
        self._waiters += 1
        lookup = asyncio.ensure_future(self._lookup(node_id))
        self._pending[node_id] = lookup

        def done(_: object) -> None:
            self._waiters -= 1
            del self._pending[node_id]

        lookup.add_done_callback(done)
        return await asyncio.shield(lookup)

    async def _lookup(self, node_id: str) -> NodeRecord | None:
        async with self._lock:
            record = self.records.get(node_id)  # a lookup that finished while we waited may have found it
            if record is not None:
                return record
            wait = self._registry_at + self._spacing - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._registry_at = time.monotonic()
            await self.refresh()
            self._spacing = max(REGISTRY_MIN_INTERVAL_S, (time.monotonic() - self._registry_at) / READ_SHARE)
            return self.records.get(node_id)

    async def refresh(self) -> None:
        """Merge a fresh read into what is known: a read that misses nodes (a partial answer under load, or a
        DHT that does not answer) never empties a working registry; a record leaves only once it is stale."""
        self._read_at = time.monotonic()
        try:
            fresh = await self.membership.get_nodes()
        except Exception as e:  # a DHT that times out, fails or hands us something we cannot use
            logger.warning("could not refresh the node registry from the DHT: %r", e)
            fresh = {}
        merged = dict(self.records)
        for node_id, record in fresh.items():
            known = merged.get(node_id)
            if known is None or record.updated >= known.updated:
                merged[node_id] = record
        oldest = time.time() - NODE_TTL_S - CLOCK_SKEW_S
        self.records = {n: r for n, r in merged.items() if r.updated >= oldest}

    async def refresh_forever(self) -> None:
        """Read the records now (a restarted trainer knows nobody: its relays' keep-alives would be refused until a
        read) and again every REGISTRY_PERIOD_S (one DHT read; ``refresh`` never raises)."""
        while True:
            await self.refresh()
            await asyncio.sleep(REGISTRY_PERIOD_S)

    async def validators(self, trusted: list[str]) -> list[NodeRecord]:
        """Registered validator nodes among ``trusted``, in turn (a different one first at each call)."""
        if time.monotonic() - self._validators_at > VALIDATOR_REFRESH_S:
            self._validators_at = time.monotonic()
            await self.refresh()
        found = [r for r in self.records.values() if r.node_id in trusted and r.role == "validator"]
        self._turn += 1
        return found[self._turn % len(found) :] + found[: self._turn % len(found)] if found else []

    def peer_addresses(self, exclude: str, limit: int = 8) -> list[str]:
        """A first multiaddr of each known node but ``exclude``: peers to rejoin the DHT through after a restart."""
        return [r.p2p_maddrs[0] for r in self.records.values() if r.p2p_maddrs and r.node_id != exclude][:limit]
