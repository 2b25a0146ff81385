"""Keeping a node's weights in step with the trainer, through the relay trees; shared by inference and relay.

Each version's shards travel in k stripes, each by its own tree (stripes.py; the origin's record says k). A node
takes children in one stripe, its home stripe, chosen at join where serving capacity is lowest, and announces
how many children it can serve there from its measured upload. ``keep_attached`` keeps the node in every stripe's
tree (links.py): per stripe it chooses a parent by attaching (``POST /relay/attach?stripe=s``) to the candidates
``tree.parents`` orders from fresh DHT records, holds the slot with a keep-alive that also tells it the parent's
path from the origin, and leaves a parent that refuses it, cannot be reached, has lost its own way to the origin
for ``UNROOTED_GRACE_S``, or turns out to hang below it (a cycle). ``sync(v)`` announces that the node is
receiving ``v``, fetches it through ``fetch.ShardFetcher``, each stripe's shards from that stripe's parent
(alternates: nodes that hold the whole version; the origin last), keeps the newest ``keep`` versions the disk
budget allows, and serves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from intellect_node.p2p.dht import Membership
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.auth import CHILD_HEADER, TOKEN_HEADER
from intellect_node.weights.fetch import ShardFetcher, read_limited
from intellect_node.weights.files import verify_manifest
from intellect_node.weights.links import (
    KEEPALIVE_S,
    RECORDS_MAX_AGE_S,
    REFUSED_AVOID_S,
    ROOTED_RECORDS_AGE_S,
    Attachments,
    Link,
)
from intellect_node.weights.relay import LONG_POLL_S, VERSION_HEADER, ShardServer
from intellect_node.weights.store import WeightStore
from intellect_node.weights.stripes import (
    announced_home,
    choose_home,
    claim,
    fanout,
    planned_rate,
    rehome_moves,
    root_fanout,
    stripe_capacity,
    stripe_need,
)
from intellect_node.weights.tree import MAX_DEPTH, Candidate, holders
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
from intellect_protocol.messages import Manifest, NodeRecord, RelayInfo
from intellect_protocol.records import NODE_TTL_S

logger = logging.getLogger(__name__)
MEMBER_REFRESH_S = 2.0
REHOME_S = 3.0
"""About how often a node without children looks whether another stripe needs its upload more."""
REHOME_IDLE_S = 3.0
"""A node moves its home only after sending no shard for this long: between versions, never in the middle of one."""
REHOME_HOLD_S = 10.0
"""After a move, a node stays this long: the records others decide on show the move a DHT lag later (a record goes
out within volunteer.PUBLISH_MIN_S and is read at most REHOME_S old). Not longer: the plan every node computes names the
movers, and one still holding blocks the fix: the node the plan names is often the one that just moved (it has the
fewest children), and a stripe stays short while it waits (docs/notes/weights-findings.md)."""
REHOME_JOIN_S = 5.0
"""Nor does it move this soon after joining (nodes joining at once miss each other's records for a moment)."""


class WeightFollower:
    """Keeps the node's weights in step (module docstring); its place in the relay trees is ``attachments``
    (links.Attachments), which it builds, hands what it needs, and drives."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        membership: Membership,
        store: WeightStore,
        metrics: Metrics,
        server: ShardServer | None,
        keep: int,
        max_bytes: int | None,
        publish: Callable[[], Awaitable[object]],
    ) -> None:
        self.identity = identity
        self.node_id = identity.node_id
        self.run_id = run_id
        self.membership = membership
        self.store = store
        self.metrics = metrics
        self.server = server
        self.keep = keep
        self.max_bytes = max_bytes
        self.publish = publish
        self.fetching = -1
        """The version being fetched (-1: none)."""
        self._planned = False
        self._moved_at = -1e9
        self.auto_slots = False
        """Whether the server's slots follow the measured upload (stripes.fanout) rather than a set number."""
        self._seen: dict[str, tuple[float, NodeRecord]] = {}
        """The newest record read of every node, kept for a record's lifetime: one DHT read that misses a
        node (timeouts under load return partial results) must not make this node drop a working parent."""
        self.fetcher: ShardFetcher | None = None
        self._read_at = -1e9
        self._tasks: set[asyncio.Future[None]] = set()
        self.announced = -1
        """The newest version the parent has told us of (its manifest carries the run key's signature)."""
        self.news = asyncio.Event()
        """Set when ``announced`` grows."""
        self._syncing = asyncio.Lock()
        """Held by the one ``sync`` under way."""
        self.disk_full_until = 0.0
        """Until then (monotonic) the node announces no free slot: its disk could not take the last version."""
        self.attachments = Attachments(
            identity,
            run_id,
            metrics,
            store,
            read_records=self._records,
            plan_stripes=self._plan_stripes,
            fetching=lambda: self.fetching,
            moved_at=lambda: self._moved_at,
            background=self._background,
            publish_soon=self._publish_soon,
        )
        """The parent in each stripe (links.Attachments): chosen, held and left there."""

    def start(self, session: aiohttp.ClientSession) -> None:
        self.fetcher = ShardFetcher(session, self.store, self.node_id, self.metrics)
        self.fetcher.token_for = self.attachments.token_for
        self._set_stripes(len(self.links))
        self.attachments.start(session, self.fetcher)

    def _set_stripes(self, k: int) -> None:
        """Stripes per version, for the fetcher and for the server: the server tells a child in another stripe (an
        alternate there, answered at once) from a child in the shard's stripe (answered when the shard arrives).
        A server that thought there was one stripe gave every child a long poll for every shard: two nodes that
        are each other's parents in stripes a version has no shard in held each other's only fetch for the whole
        poll (a version took 10 s to load while the trainer published one every 0.3 s)."""
        if self.fetcher is not None:
            self.fetcher.stripes = k
        if self.server is not None:
            self.server.stripes = k

    @property
    def links(self) -> list[Link]:
        """One parent per stripe (links.Attachments owns them)."""
        return self.attachments.links

    @property
    def home_link(self) -> Link:
        return self.attachments.home_link

    @property
    def home(self) -> int:
        """The stripe this node takes children in (-1: none, it serves no one)."""
        return self.home_link.stripe if self.home_link.home else -1

    @property
    def _parent(self) -> Candidate | None:
        return self.home_link.parent

    @property
    def parent(self) -> str | None:
        return self._parent.node_id if self._parent is not None else None

    @property
    def depth(self) -> int:
        return self.home_link.depth

    @property
    def path(self) -> list[str]:
        return self.home_link.path

    def home_of(self, node: str) -> int | None:
        """The stripe ``node``'s newest record says it takes children in (stripes.announced_home)."""
        seen = self._seen.get(node)
        return announced_home({node: seen[1]}, node) if seen is not None else None

    def parents(self) -> dict[int, str | None]:
        """Per stripe, the parent's node id."""
        return {x.stripe: x.parent.node_id if x.parent else None for x in self.links}

    def _plan_stripes(self, records: dict[str, NodeRecord]) -> None:
        """Once the origin's record is known, before any parent is chosen: one link per stripe it announces, and
        the home stripe where serving capacity is lowest (a node that serves no one has none)."""
        origin = records.get(self.run_id)
        if self._planned or origin is None or origin.relay is None:
            return
        self._planned = True
        k = origin.relay.stripes
        if k == len(self.links) or any(x.parent is not None for x in self.links):
            return
        home = choose_home(records, self.node_id, k, self._rate(records)) if self.server is not None else -1
        self.attachments.links = [Link(s, s == home) for s in range(k)]
        self._moved_at = time.monotonic() - REHOME_HOLD_S + REHOME_JOIN_S  # its records miss others just joined
        self._set_stripes(k)
        logger.info("stripes=%d home=%d", k, home)

    def _rate(self, records: dict[str, NodeRecord]) -> float:
        """The planned per-stripe rate (stripes.planned_rate) from the records' upload claims and the origin's
        slots (its record: the run key's word)."""
        origin = records.get(self.run_id)
        ups = [claim(r) for n, r in records.items() if n != self.run_id and r.relay is not None]
        receivers = sum(1 for n in records if n != self.run_id)
        slots = origin.relay.slots_total if origin is not None and origin.relay is not None else None
        return planned_rate(ups, claim(origin) if origin else 0.0, receivers, len(self.links), slots)

    def _slots(self) -> int:
        """Children this node can serve in its home stripe: its upload over the planned stripe rate (stripes.py;
        no spare slot: the shallowest nodes fill first, and one child too many there slows the whole stripe by that
        share); or the number the operator set."""
        assert self.server is not None
        if not self.auto_slots:
            return self.server.slots
        mine = self.server.upload_bps() or self.server.upload_limit_bps
        records = {n: r for n, (_, r) in self._seen.items()}
        rate = self._rate(records)
        upload = fanout(mine, rate, len(self.links))
        self.server.slots = upload
        if self.depth == 1 and len(self.links) > 1:  # a stripe's root: the slot it keeps is lent to the level below
            self.server.slots = root_fanout(records, self.node_id, self.home, len(self.links), rate, upload)
        self.server.kept = upload - self.server.slots
        self.server.shed()
        return self.server.slots

    def relay_info(self) -> RelayInfo | None:
        """What the node's record says of it as a relay. A node not yet rooted in its home stripe still says which
        stripe that is (at depth MAX_DEPTH: never a candidate, no free slot): without it, the origin could not
        tell it from a leaf, would not give it a leaf's slot, and a stripe whose slots leaves hold would never root
        (tests/weights/test_relay_tree.py)."""
        if self.server is None:
            return None
        slots = self._slots()
        return RelayInfo(
            depth=self.depth if self.depth >= 0 else MAX_DEPTH,
            parent=self.parent,
            slots_total=slots,
            # no children while cut off from the origin, or while our disk cannot take new versions
            slots_free=self.server.slots_free() if self.path and time.monotonic() > self.disk_full_until else 0,
            upload_bps=self.server.upload_bps(),
            versions=self.store.complete_versions()[-16:],
            fetching=self.fetching,
            stripe=max(0, self.home),
            stripes=len(self.links),
        )

    async def _records(self, max_age: float = 0.0) -> dict[str, NodeRecord]:
        """Every node's newest record; from the last read if at most ``max_age`` seconds old (DHT reads are slow)."""
        now = time.monotonic()
        if now - self._read_at <= max_age:
            return {n: r for n, (_, r) in self._seen.items()}
        self._read_at = now
        try:
            fresh = await self.membership.get_nodes()
        except Exception as e:  # timeouts, daemon errors: plan with what was read before; the next call reads again
            self.metrics.inc("node_dht_read_failures_total")
            logger.debug("could not read the node records: %r", e)
            fresh = {}
        for nid, record in fresh.items():
            self._seen[nid] = (now, record)
        self._seen = {n: (t, r) for n, (t, r) in self._seen.items() if now - t < NODE_TTL_S}
        return {n: r for n, (_, r) in self._seen.items()}

    async def is_member(self, node_id: str) -> bool:
        """Whether ``node_id`` has a valid record in the run (relay slots are for members only): known within
        NODE_TTL_S, at once (a read of all records per keep-alive would be most of a relay's libp2p bytes); an
        unknown id costs at most one DHT read per MEMBER_REFRESH_S, whoever asks."""
        seen = self._seen.get(node_id)
        return (seen is not None and time.monotonic() - seen[0] < NODE_TTL_S) or node_id in await self._records(
            max_age=MEMBER_REFRESH_S
        )

    async def _find(self, exclude: set[str]) -> list[Candidate]:
        """The fetcher's sources (see fetch.SourceFinder): each stripe's parent first (chosen now if there is
        none, or if the fetcher saw it fail), then up to two nodes that hold the whole version, the origin last."""
        for link in self.links:
            if link.parent is not None and link.parent.node_id in exclude:
                await self.attachments.drop_parent("it failed to serve", REFUSED_AVOID_S, link)
        # records read a few seconds ago will do even without a parent: after leaving one (a partition, say) a
        # fresh DHT read can take many seconds while part of the DHT does not answer. With a parent in every
        # stripe, any will do (they name alternates only), read again in the background: a read here would hold up
        # each version's first request at every level of the tree (docs/notes/stripes-history.md).
        rooted = self._planned and all(link.parent is not None for link in self.links)
        records = await self._records(max_age=float("inf") if rooted else RECORDS_MAX_AGE_S)
        if rooted and time.monotonic() - self._read_at > ROOTED_RECORDS_AGE_S:
            self._background(self._records(max_age=ROOTED_RECORDS_AGE_S))
        self._plan_stripes(records)
        orphans = [link for link in self.links if link.parent is None]
        if orphans:
            await asyncio.gather(*(self.attachments.choose(records, exclude, link) for link in orphans))
        mine: dict[str, Candidate] = {}
        for link in self.links:
            if link.parent is not None:
                c = mine.get(link.parent.node_id, link.parent)
                mine[c.node_id] = Candidate(c.node_id, c.url, c.depth, True, c.parent_of | {link.stripe})
        sources = sorted(mine.values(), key=lambda c: min(c.parent_of))
        skip = self.attachments.avoiding() | exclude | set(mine)
        for link in self.links:  # a stripe's root two levels up serves us a share of the stripe (sources.above_due)
            r = records.get(link.path[1]) if len(link.path) == 4 else None
            if r is not None and r.http_url and r.node_id not in skip and r.relay is not None and r.relay.depth == 1:
                sources.append(Candidate(r.node_id, r.http_url, 1, False, above_of=frozenset({link.stripe})))
                skip.add(r.node_id)
        sources += holders(records, self.node_id, self.run_id, self.fetching, skip) if self.fetching >= 0 else []
        origin = records.get(self.run_id)
        if origin is not None and origin.http_url and self.run_id not in skip:
            sources.append(Candidate(self.run_id, origin.http_url, 0, False))
        return sources

    def _background(self, work: Awaitable[object]) -> None:
        async def run() -> None:
            await work

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _publish_soon(self) -> None:
        self._background(self.publish())

    async def keep_attached(self, session: aiohttp.ClientSession) -> None:
        """Once the stripes are known (the origin's record), hold a parent in each (links.Attachments.keep_link);
        between versions, move its home to a stripe with less serving capacity (nodes that join at once all see the
        same records, and choose alike: _rehome), and move up in its home stripe's tree (links.Attachments.climb)."""
        while not self._planned:
            self._plan_stripes(await self._records(max_age=RECORDS_MAX_AGE_S))
            if not self._planned:
                await asyncio.sleep(KEEPALIVE_S)
        async with asyncio.TaskGroup() as tasks:
            for link in self.links:
                tasks.create_task(self.attachments.keep_link(session, link))
            while True:
                await asyncio.sleep(REHOME_S * (0.5 + random.random()))
                if not self._between_versions():  # both moves wait for it: no read of every record for nothing
                    continue
                try:
                    records = await self._records(max_age=REHOME_S)
                    self._rehome(records)
                    if self._between_versions():
                        await self.attachments.climb(records)
                except Exception:  # a bug here must not take the node down with it: logged, counted, tried again
                    self.metrics.inc("node_errors_total", label="rehome")
                    logger.exception("moving home or up in the relay tree failed; trying again")

    def _between_versions(self) -> bool:
        """A serving node that fetches nothing and has sent no shard for REHOME_IDLE_S."""
        return (
            self.server is not None
            and self.home >= 0
            and len(self.links) > 1
            and self.fetching < 0
            and self.server.idle_s() >= REHOME_IDLE_S
        )

    def _rehome(self, records: dict[str, NodeRecord]) -> None:
        """Between versions (this node fetches nothing and has sent no shard for REHOME_IDLE_S), move its home to
        a stripe whose nodes cannot serve every receiver, as the plan every node computes alike says
        (``stripes.rehome_moves``); not within REHOME_JOIN_S of joining or REHOME_HOLD_S of its last move (its
        record must reach the others first). Its children there are refused at their next keep-alive and choose
        again; in the middle of a version (say, it finished before them) that would move its whole subtree, so it
        waits."""
        if not self._between_versions() or time.monotonic() - self._moved_at < REHOME_HOLD_S:
            return
        rate = self._rate(records)
        low = rehome_moves(records, len(self.links), rate, stripe_need(records, len(self.links))).get(self.node_id)
        if low is not None and low != self.home:
            old = self.home_link
            old.home, self.links[low].home = False, True
            self._moved_at = time.monotonic()
            capacity = stripe_capacity(records, self.node_id, len(self.links), rate)
            logger.info("home stripe %d -> %d (others' capacity %s)", old.stripe, low, [round(c) for c in capacity])
            self.metrics.inc("node_relay_rehomed_total", help="moves of this node's home stripe to an emptier one")
            self._publish_soon()

    async def sync(self, version: int) -> Manifest:
        """Hold a verified copy of ``version``; returns its manifest. One fetch at a time: a caller waits for the
        one under way (an inference node's generation loop for its background follower: inference.py), then
        finds its version here or fetches it."""
        if self.fetcher is None:
            raise RuntimeError("WeightFollower.start() has not run")
        async with self._syncing:
            return await self._sync(version)

    @contextlib.asynccontextmanager
    async def newest(self, at_least: int) -> AsyncIterator[tuple[int, Manifest]]:
        """Hold the newest version: ``at_least``, or a newer one already here (``receive_announced``). Yields it and
        its manifest; until the block ends no fetch runs, so none prunes it (the caller reads its files there)."""
        if self.fetcher is None:
            raise RuntimeError("WeightFollower.start() has not run")
        async with self._syncing:
            version = max(at_least, max(self.store.complete_versions(), default=-1))
            yield version, await self._sync(version)

    @contextlib.asynccontextmanager
    async def held(self, version: int) -> AsyncIterator[Manifest | None]:
        """``version``'s manifest when it is held here (None when not), with no fetch running until the block ends,
        so none prunes it while the caller reads its files (a validator loading the version a batch claims)."""
        async with self._syncing:
            yield self.store.manifest(version) if version in self.store.complete_versions() else None

    async def _sync(self, version: int) -> Manifest:
        assert self.fetcher is not None
        if version in self.store.complete_versions():
            manifest = self.store.manifest(version)
            if manifest is not None:
                return manifest
        self.fetching = version
        self._publish_soon()  # in the background: a DHT store must not delay the first request
        try:
            manifest = await self.fetcher.fetch(version, self._find)
        finally:
            self.fetching = -1
        self.store.prune(self.keep, self.max_bytes)
        self.metrics.inc("node_weights_versions_received_total")
        self.metrics.set("node_weights_versions_held", len(self.store.complete_versions()))
        self._publish_soon()
        await self.attachments.leave_slow_parent()
        return manifest

    async def receive_announced(self) -> None:
        """Receive each version the parents announce (``watch_parent``) as it comes: for a node whose own work asks
        for a version only now and then (an inference node, between batches), whose children in its home stripe
        receive through it. A failure is counted; the next news, or the node's own ``sync``, tries again."""
        while True:
            await self.news.wait()
            self.news.clear()
            target = self.announced
            if target <= max(self.store.complete_versions(), default=-1):
                continue
            try:
                await self.sync(target)
            except (TimeoutError, Rejected, aiohttp.ClientError) as e:
                self.metrics.inc("node_weights_fetch_failures_total", label=getattr(e, "reason", "network"))
                logger.debug("could not receive announced version %d: %r", target, e)
                await asyncio.sleep(KEEPALIVE_S)
            except OSError as e:  # our disk: the node's own loop says what to do about it, and tries again
                self.metrics.inc("node_weights_fetch_failures_total", label="local_disk")
                logger.debug("could not store announced version %d: %r", target, e)
                await asyncio.sleep(KEEPALIVE_S)
            except Exception:  # a bug here must not end the receiving unseen: logged, counted, tried again
                self.metrics.inc("node_errors_total", label="receive_announced")
                logger.exception("receiving announced version %d failed; going on", target)
                await asyncio.sleep(KEEPALIVE_S)

    async def watch_parent(self, session: aiohttp.ClientSession) -> None:
        """Learn of new versions from the parent as they start arriving there (``GET /relay/next``, a long
        poll), so news travels down the tree as fast as the data, not at each node's next look at the DHT. Only
        a manifest signed by the run key counts: a parent cannot make us chase a version that does not exist."""
        while True:
            c = self._parent or next((x.parent for x in self.links if x.parent is not None), None)
            if c is None:
                await asyncio.sleep(0.2)
                continue
            after = max(self.announced, self.store.newest())
            asked = time.monotonic()
            version = -1
            try:
                headers = {CHILD_HEADER: self.node_id, TOKEN_HEADER: self.attachments.token_for(c.node_id)}
                async with session.get(
                    f"{c.url}/relay/next",
                    params={"after": str(after)},
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=LONG_POLL_S + 5),
                ) as resp:
                    if resp.status == 204:
                        if time.monotonic() - asked < LONG_POLL_S / 2:
                            await asyncio.sleep(KEEPALIVE_S)  # it did not wait: do not ask again at once
                        continue
                    if resp.status != 200:
                        await asyncio.sleep(KEEPALIVE_S)  # an older node without /relay/next: the DHT will do
                        continue
                    version = int(resp.headers.get(VERSION_HEADER, "-1"))
                    data = await read_limited(resp, Channel.MANIFEST.value)
                    verify_manifest(data, self.run_id, version, self.store.epoch)
            except Rejected as e:  # a parent that passes on a forged or broken manifest: counted, not believed
                self.metrics.inc("node_relay_news_rejected_total", label=e.reason, help="version news not believed")
                logger.warning("news from parent %s not believed: %s", c.node_id[:8], e)
                await asyncio.sleep(KEEPALIVE_S)
                continue
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                logger.debug("no news from parent %s: %r", c.node_id[:8], e)
                await asyncio.sleep(KEEPALIVE_S)
                continue
            if version > self.announced:
                self.announced = version
                self.news.set()
            else:  # news we had: the parent answers at once from now on; ask again when it can have changed
                await asyncio.sleep(KEEPALIVE_S)
