"""Keeping a node's weights in step with the trainer, through the relay tree; shared by inference and relay.

``keep_attached`` keeps the node in the relay tree: it chooses a parent by attaching (``POST /relay/attach``) to
the candidates ``tree.parents`` orders from fresh DHT records, holds the slot with a keep-alive that also tells it
the parent's path from the origin, and leaves a parent that refuses it, cannot be reached, has lost its own way
to the origin for ``UNROOTED_GRACE_S``, or turns out to hang below it (a cycle). ``sync(v)`` announces that the
node is receiving ``v``, fetches it through ``fetch.ShardFetcher`` from the parent (alternates: nodes that hold
the whole version; the origin last), then keeps only the newest ``keep`` versions within the disk budget.
Everything this node holds, it serves (unless started with ``--no-relay``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from intellect_node.dht import Membership
from intellect_node.fetch import ShardFetcher
from intellect_node.metrics import Metrics
from intellect_node.relay import CHILD_HEADER, MAX_PATH, ShardServer
from intellect_node.store import WeightStore
from intellect_node.tree import Candidate, below, holders, parents
from intellect_protocol.messages import Manifest, NodeRecord, RelayInfo
from intellect_protocol.records import NODE_TTL_S

logger = logging.getLogger(__name__)
KEEPALIVE_S = 1.0
"""Keep-alive period: also how fast a change of path travels one level down the tree (well under CHILD_TTL_S)."""
CYCLE_AVOID_S = 30.0
REFUSED_AVOID_S = 2.0
UNREACHABLE_AVOID_S = 10.0
UNROOTED_GRACE_S = 5.0
"""How long a parent may be cut off from the origin (re-parenting itself) before its child looks elsewhere."""
MAX_ATTACH_TRIES = 24
FAST_ROUNDS = 6
FAST_KEEPALIVE_S = 0.5
ATTACH_TIMEOUT = aiohttp.ClientTimeout(total=5)


class WeightFollower:
    def __init__(
        self,
        node_id: str,
        run_id: str,
        membership: Membership,
        store: WeightStore,
        metrics: Metrics,
        server: ShardServer | None,
        keep: int,
        max_bytes: int | None,
        publish: Callable[[], Awaitable[object]],
    ) -> None:
        self.node_id = node_id
        self.run_id = run_id
        self.membership = membership
        self.store = store
        self.metrics = metrics
        self.server = server
        self.keep = keep
        self.max_bytes = max_bytes
        self.publish = publish
        self.depth = -1
        self.fetching = -1
        self.path: list[str] = []
        """Node ids from the origin down to this node, as the parent last told it."""
        self._seen: dict[str, tuple[float, NodeRecord]] = {}
        """The newest record read of every node, kept for a record's lifetime: one DHT read that misses a
        node (timeouts under load return partial results) must not make this node drop a working parent."""
        self.fetcher: ShardFetcher | None = None
        self.session: aiohttp.ClientSession | None = None
        self._parent: Candidate | None = None
        self._parent_was: str | None = None
        self._unrooted_since: float | None = None
        self._unreachable = 0
        self._avoid: dict[str, float] = {}
        """Nodes not to ask for a slot before the time given (we just left them)."""
        self._choosing = asyncio.Lock()
        self._tasks: set[asyncio.Future[None]] = set()
        self.changed = asyncio.Event()
        """Set when the parent changes (keep_attached then checks the new parent's path at once)."""

    def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.fetcher = ShardFetcher(session, self.store, self.node_id, self.metrics)

    @property
    def parent(self) -> str | None:
        return self._parent.node_id if self._parent is not None else None

    def relay_info(self) -> RelayInfo | None:
        if self.server is None or self.depth < 0:
            return None
        return RelayInfo(
            depth=self.depth,
            parent=self.parent,
            slots_total=self.server.slots,
            slots_free=self.server.slots_free() if self.path else 0,  # no children while cut off from the origin
            upload_bps=self.server.upload_bps(),
            versions=self.store.complete_versions()[-16:],
            fetching=self.fetching,
        )

    async def _records(self) -> dict[str, NodeRecord]:
        now = time.monotonic()
        try:
            fresh = await self.membership.get_nodes()
        except (TimeoutError, OSError) as e:  # plan with what was read before; the next call reads again
            self.metrics.inc("node_dht_read_failures_total")
            logger.debug("could not read the node records: %r", e)
            fresh = {}
        for nid, record in fresh.items():
            self._seen[nid] = (now, record)
        self._seen = {n: (t, r) for n, (t, r) in self._seen.items() if now - t < NODE_TTL_S}
        return {n: r for n, (_, r) in self._seen.items()}

    def _avoiding(self) -> set[str]:
        now = time.monotonic()
        self._avoid = {n: t for n, t in self._avoid.items() if t > now}
        return set(self._avoid)

    async def _find(self, exclude: set[str]) -> list[Candidate]:
        """The fetcher's sources (see fetch.SourceFinder): the parent first (chosen now if there is none, or if
        the fetcher saw it fail), then up to two nodes that hold the whole version, the origin last."""
        records = await self._records()
        if self._parent is not None and self._parent.node_id in exclude:
            await self._drop_parent("it failed to serve", avoid_s=REFUSED_AVOID_S)
        if self._parent is None:
            await self._choose(records, exclude)
        sources = [self._parent] if self._parent is not None else []
        skip = self._avoiding() | exclude | {c.node_id for c in sources}
        sources += holders(records, self.node_id, self.run_id, self.fetching, skip) if self.fetching >= 0 else []
        origin = records.get(self.run_id)
        if origin is not None and origin.http_url and self.run_id not in skip:
            sources.append(Candidate(self.run_id, origin.http_url, 0, False))
        return sources

    async def _choose(self, records: dict[str, NodeRecord], exclude: set[str]) -> None:
        """Attach, then choose: ask the candidates for a slot, best first, and take the first that gives one.
        A full node names its children, and they are asked next (the free slots are further down)."""
        async with self._choosing:
            if self._parent is not None or self.session is None:
                return
            tried: set[str] = set()
            queue = parents(records, self.node_id, self.run_id, exclude | self._avoiding())
            while queue and len(tried) < MAX_ATTACH_TRIES:
                c = queue.pop(0)
                if c.node_id in tried:
                    continue
                tried.add(c.node_id)
                status, body = await self._post_attach(c.url)
                if status == 200 and self._adopt(c, body):
                    return
                if status == 503 and isinstance(body, dict) and isinstance(body.get("children"), list):
                    names = [x for x in body["children"][:64] if isinstance(x, str)]
                    queue[:0] = below(records, names, tried | exclude | {self.node_id})

    def _adopt(self, c: Candidate, body: object) -> bool:
        """Take ``c`` as the parent if its answer shows a path from the origin without us in it."""
        path = body.get("path") if isinstance(body, dict) else None
        if not (isinstance(path, list) and path and all(isinstance(x, str) for x in path) and path[0] == self.run_id
                and self.node_id not in path and len(path) <= MAX_PATH):  # fmt: skip
            self._detach_soon(c.url)
            return False
        was = self._parent_was
        self._parent = Candidate(c.node_id, c.url, len(path) - 1, True)
        self.path = [*path, self.node_id]
        self.depth = len(path)
        self._unrooted_since = None
        logger.info("parent=%s depth=%d (was %s)", c.node_id, self.depth, was)
        if was is not None:
            self.metrics.inc("node_relay_reparents_total")
        self.changed.set()
        self._publish_soon()
        return True

    async def _drop_parent(self, why: str, avoid_s: float) -> None:
        c = self._parent
        if c is None:
            return
        logger.info("leaving parent %s: %s", c.node_id, why)
        self._parent_was = c.node_id
        self._parent = None
        self.path = []
        self._avoid[c.node_id] = time.monotonic() + avoid_s
        self._detach_soon(c.url)
        self._publish_soon()

    def _detach_soon(self, url: str) -> None:
        """Give the slot back at once (best effort; it frees itself after the child TTL otherwise)."""
        if self.session is None:
            return
        session = self.session

        async def detach() -> None:
            try:
                async with session.delete(f"{url}/relay/attach", headers={CHILD_HEADER: self.node_id},
                                          timeout=ATTACH_TIMEOUT):  # fmt: skip
                    pass
            except (aiohttp.ClientError, TimeoutError):
                pass

        task = asyncio.ensure_future(detach())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _publish_soon(self) -> None:
        async def publish() -> None:
            await self.publish()

        task = asyncio.ensure_future(publish())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post_attach(self, url: str) -> tuple[int | None, object]:
        """POST /relay/attach: (status, JSON body), (None, None) when the node cannot be reached."""
        assert self.session is not None
        try:
            async with self.session.post(
                f"{url}/relay/attach", headers={CHILD_HEADER: self.node_id}, timeout=ATTACH_TIMEOUT
            ) as resp:
                body: object = None
                if resp.status in (200, 503):
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError:
                        body = None
                return resp.status, body
        except (aiohttp.ClientError, TimeoutError):
            return None, None

    async def sync(self, version: int) -> Manifest:
        """Hold a verified copy of ``version``; returns its manifest."""
        if self.fetcher is None:
            raise RuntimeError("WeightFollower.start() has not run")
        if version in self.store.complete_versions():
            manifest = self.store.manifest(version)
            if manifest is not None:
                return manifest
        self.fetching = version
        await self.publish()
        try:
            manifest = await self.fetcher.fetch(version, self._find)
        finally:
            self.fetching = -1
        self.store.prune(self.keep, self.max_bytes)
        self.metrics.inc("node_weights_versions_received_total")
        self.metrics.set("node_weights_versions_held", len(self.store.complete_versions()))
        await self.publish()
        return manifest

    async def keep_attached(self, session: aiohttp.ClientSession) -> None:
        """Hold this node's slot at its parent, so the tree stays as it is between versions, and find a parent
        when there is none. Right after a change of parent ask every half second for a few rounds: a cycle (two
        nodes that re-parented below each other at once) shows in the parent's path, and is left before a
        version has to go through it."""
        fast = 0
        while True:
            if self.changed.is_set():
                self.changed.clear()
                fast = FAST_ROUNDS
            if fast > 0:
                fast -= 1
                await asyncio.sleep(FAST_KEEPALIVE_S)
            else:
                try:
                    await asyncio.wait_for(self.changed.wait(), KEEPALIVE_S)
                    continue
                except TimeoutError:
                    pass
            if self._parent is None:
                await self._choose(await self._records(), self.fetcher._excluded() if self.fetcher else set())
                if self._parent is not None and self.fetcher is not None:
                    await self.fetcher.refresh_now()
            else:
                await self.attach_once(session)

    async def attach_once(self, session: aiohttp.ClientSession) -> None:
        """One keep-alive: hold the slot, learn the parent's depth and path, leave a cycle or a parent that
        lost its way to the origin."""
        c = self._parent
        if c is None:
            return
        status, body = await self._post_attach(c.url)
        if c is not self._parent:
            return  # changed meanwhile
        if status is None:
            self._unreachable += 1
            if self._unreachable >= 3:
                await self._drop_parent("unreachable", avoid_s=UNREACHABLE_AVOID_S)
                await self._refetch()
            return
        self._unreachable = 0
        if status in (409, 503):  # the slot went to another node, or we are above it now: choose again
            await self._drop_parent(f"it refused us ({status})", avoid_s=REFUSED_AVOID_S)
            await self._refetch()
            return
        if status != 200:
            return
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, list) or not all(isinstance(x, str) for x in path):
            return
        if self.node_id in path:  # our parent descends from us: nothing can reach us through it
            at = path.index(self.node_id)
            logger.warning("cycle in the relay tree through %s", "->".join(p[:8] for p in path[at:]))
            self.metrics.inc("node_relay_cycles_left_total", help="times this node found itself below its own child")
            await self._drop_parent("cycle", avoid_s=CYCLE_AVOID_S)
            await self._refetch()
            return
        if not path or path[0] != self.run_id:  # the parent lost its way to the origin: it may find it again
            self.path = []
            now = time.monotonic()
            self._unrooted_since = self._unrooted_since or now
            if now - self._unrooted_since > UNROOTED_GRACE_S:
                await self._drop_parent("not connected to the origin", avoid_s=REFUSED_AVOID_S)
                await self._refetch()
            return
        self._unrooted_since = None
        self.path = [*path[-MAX_PATH:], self.node_id]
        assert c is not None
        if self.depth != len(path) or c.depth != len(path) - 1:
            self.depth = len(path)  # the parent moved in the tree: so did we
            self._parent = Candidate(c.node_id, c.url, len(path) - 1, True)
            await self.publish()

    async def _refetch(self) -> None:
        """After a change of parent: choose a new one now, and let a running fetch pick up the change."""
        await self._choose(await self._records(), set())
        if self.fetcher is not None:
            await self.fetcher.refresh_now()
