"""The relay role: a bandwidth-only node. It follows every new version the trainer announces and serves it.

It loads no model and needs no GPU: `intellect-node join --role relay --peers ... --run-id ...`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from intellect_node.aio import within
from intellect_node.roles.volunteer import POLL_S, Volunteer
from intellect_node.weights.follower import WeightFollower
from intellect_protocol.envelope import Rejected
from intellect_protocol.messages import NodeRecord, Role, RunSpec

logger = logging.getLogger(__name__)
DISK_RETRY_S = 5.0
WATCH_S = 1.0
"""How often a relay reads the trainer's record: relays are many, and each read is a DHT lookup. A relay with a
parent usually hears of a new version from it first (follower.watch_parent)."""


class RelayNode(Volunteer):
    role: Role = "relay"

    async def work(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        assert self.follower is not None
        if self.server is None:
            raise SystemExit("a relay that does not relay has nothing to do: drop --no-relay")
        self._reading: asyncio.Future[NodeRecord | None] | None = None
        try:
            await self._follow(self.follower)
        finally:
            if self._reading is not None:
                self._reading.cancel()

    async def _follow(self, f: WeightFollower) -> None:
        failed_news = -1
        while True:
            f.news.clear()
            # news from the parent (a signed manifest), unless fetching that very version failed: then the DHT
            target = f.announced if f.announced > max(self.version, failed_news) else -1
            if target < 0:
                # The trainer's record from the DHT, but never ahead of the parent's news: a read can take a second
                # on a busy DHT, and news that waits for one holds back a whole subtree's start (docs/weights.md,
                # "Each version starts at once").
                self._reading = self._reading or asyncio.ensure_future(self.trainer())
                news = asyncio.ensure_future(f.news.wait())
                await asyncio.wait({self._reading, news}, timeout=WATCH_S, return_when=asyncio.FIRST_COMPLETED)
                news.cancel()
                if not self._reading.done():
                    continue  # news, or a slow read that goes on meanwhile
                trainer, self._reading = self._reading.result(), None
                if trainer is not None and await self.follow_epoch(trainer):
                    failed_news = -1
                if trainer is not None and trainer.epoch == self.store.epoch and trainer.weight_version > self.version:
                    target = trainer.weight_version
            if target < 0:
                try:
                    await within(f.news.wait(), WATCH_S)
                except TimeoutError:
                    pass
                continue
            try:
                await f.sync(target)
                logger.info(
                    "holding version=%d depth=%d parent=%s", self.version, self.follower.depth, self.follower.parent
                )
                print(f"HOLDING {self.version} at={time.time():.6f}", flush=True)
            except (TimeoutError, Rejected, aiohttp.ClientError) as e:
                self.metrics.inc("node_weights_fetch_failures_total", label=getattr(e, "reason", "network"))
                self.fetch_failed(target, e)
                if target == f.announced:
                    failed_news = target
                await asyncio.sleep(POLL_S)
            except OSError as e:  # our disk is full: stop taking children, keep serving what is whole, try later
                self.metrics.inc("node_weights_fetch_failures_total", label="local_disk")
                logger.error(
                    "cannot store version %d: %r; relaying paused, free disk space under %s or lower --max-disk-gb",
                    target,
                    e,
                    self.store.root,
                )
                f.disk_full_until = time.monotonic() + DISK_RETRY_S
                self._publish_soon.set()
                await asyncio.sleep(DISK_RETRY_S)
