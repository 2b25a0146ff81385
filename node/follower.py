"""Keeping a node's weights in step with the trainer, through the relay tree; shared by inference and relay.

``sync(v)`` announces that the node is receiving ``v`` (so children can pick it at once), fetches it through
``fetch.ShardFetcher`` with sources planned by ``tree.plan`` from fresh DHT records, then keeps only the newest
``keep`` versions within the disk budget. Everything this node holds, it serves (unless started with
``--no-relay``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from intellect_node.dht import Membership
from intellect_node.fetch import ShardFetcher, Source
from intellect_node.metrics import Metrics
from intellect_node.relay import CHILD_HEADER, CHILD_TTL_S, MAX_PATH, ShardServer
from intellect_node.store import WeightStore
from intellect_node.tree import Candidate, plan
from intellect_protocol.messages import Manifest, NodeRecord, RelayInfo
from intellect_protocol.records import NODE_TTL_S

logger = logging.getLogger(__name__)
KEEPALIVE_S = CHILD_TTL_S / 3
CYCLE_AVOID_S = 30.0
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

    def start(self, session: aiohttp.ClientSession) -> None:
        self.fetcher = ShardFetcher(session, self.store, self.node_id, self.metrics)

    @property
    def parent(self) -> str | None:
        return self.fetcher.parent if self.fetcher is not None else None

    def relay_info(self) -> RelayInfo | None:
        if self.server is None or self.depth < 0:
            return None
        return RelayInfo(
            depth=self.depth,
            parent=self.parent,
            slots_total=self.server.slots,
            slots_free=self.server.slots_free(),
            upload_bps=self.server.upload_bps(),
            versions=self.store.complete_versions()[-16:],
            fetching=self.fetching,
        )

    async def _find(self, exclude: set[str]) -> list[Candidate]:
        now = time.monotonic()
        for nid, record in (await self.membership.get_nodes()).items():
            self._seen[nid] = (now, record)
        self._seen = {n: (t, r) for n, (t, r) in self._seen.items() if now - t < NODE_TTL_S}
        records = {n: r for n, (_, r) in self._seen.items()}
        version = self.fetching
        parent, sources = plan(records, self.node_id, self.run_id, version, self.parent, exclude)
        if parent is not None and self.depth != parent.depth + 1:
            self.depth = parent.depth + 1
            await self.publish()
        return sources

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

    async def _leave_cycle(self, f: ShardFetcher, src: Source, path: list[str]) -> None:
        """Our parent descends from us (both chose each other, or a longer loop): nothing can reach us through
        it. Treat it as failed for a while and choose again."""
        at = path.index(self.node_id)
        logger.warning("cycle in the relay tree through %s: leaving parent %s", "->".join(p[:8] for p in path[at:]),
                       src.node_id)  # fmt: skip
        self.metrics.inc("node_relay_cycles_left_total", help="times this node found itself below its own child")
        src.failed = max(src.failed, 2)
        src.away_until = time.monotonic() + CYCLE_AVOID_S
        self.path = []
        await f.refresh_now()

    async def keep_attached(self, session: aiohttp.ClientSession) -> None:
        """Hold this node's slot at its parent, so the tree stays as it is; right after a change of parent, ask
        every half second for a few rounds: a cycle (two nodes that chose each other at once) shows in the
        parent's path within three rounds, and is left before a version has to go through it."""
        fast = 0
        while True:
            f = self.fetcher
            if f is not None and f.parent_changed.is_set():
                f.parent_changed.clear()
                fast = FAST_ROUNDS
            if fast > 0:
                fast -= 1
                await asyncio.sleep(FAST_KEEPALIVE_S)
            elif f is not None:
                try:
                    await asyncio.wait_for(f.parent_changed.wait(), KEEPALIVE_S)
                    continue
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(KEEPALIVE_S)
            await self.attach_once(session)

    async def attach_once(self, session: aiohttp.ClientSession) -> None:
        """One keep-alive: hold the slot, learn the parent's depth and path, leave a cycle."""
        f = self.fetcher
        if f is None or f.parent is None or f.parent not in f.sources:
            return
        src = f.sources[f.parent]
        body: object = None
        try:
            async with session.post(
                f"{src.url}/relay/attach", headers={CHILD_HEADER: self.node_id}, timeout=ATTACH_TIMEOUT
            ) as resp:
                refused = resp.status == 503
                if not refused and resp.status == 200:
                    body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            src.failed += 1
            return
        if refused:  # the slot went to another node: choose again now, not when the next version is out
            logger.info("parent %s has no slot for us: choosing again", src.node_id)
            src.full, src.away_until = True, time.monotonic() + 2.0
            await f.refresh_now()
            return
        if resp.status != 200:
            return
        depth = body.get("depth") if isinstance(body, dict) else None
        path = body.get("path") if isinstance(body, dict) else None
        if isinstance(path, list) and self.node_id in path:
            await self._leave_cycle(f, src, path)
            return
        if isinstance(path, list) and all(isinstance(x, str) for x in path):
            self.path = [*path[-MAX_PATH:], self.node_id]
        if isinstance(depth, int) and 0 <= depth < 1024 and self.depth != depth + 1:
            self.depth = depth + 1  # the parent moved in the tree: so did we
            await self.publish()
