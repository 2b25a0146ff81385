"""Keeping a node's weights in step with the trainer, through the relay tree; shared by inference and relay.

``keep_attached`` keeps the node in the relay tree: it chooses a parent by attaching (``POST /relay/attach``) to
the candidates ``tree.parents`` orders from fresh DHT records, holds the slot with a keep-alive that also tells it
the parent's path from the origin, and leaves a parent that refuses it, cannot be reached, has lost its own way
to the origin for ``UNROOTED_GRACE_S``, or turns out to hang below it (a cycle). ``sync(v)`` announces that the
node is receiving ``v``, fetches it through ``fetch.ShardFetcher`` from the parent (alternates: nodes that hold
the whole version; the origin last), keeps the newest ``keep`` versions the disk budget allows, serves them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from intellect_node.aio import within
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.auth import CHILD_HEADER, TOKEN_HEADER, server_clock_offset, signed_headers
from intellect_node.weights.fetch import ShardFetcher, faster_than_parent, read_limited
from intellect_node.weights.files import verify_manifest
from intellect_node.weights.relay import LONG_POLL_S, MAX_PATH, VERSION_HEADER, ShardServer
from intellect_node.weights.store import WeightStore
from intellect_node.weights.tree import Candidate, below, holders, is_path, parents
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
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
RECORDS_MAX_AGE_S = 5.0
"""Sources are planned from records read up to this long ago (alternates only need to be roughly right)."""
SILENT_KEEPALIVES = 2
"""Keep-alives in a row without a usable answer after which a node leaves its parent."""
FAST_ROUNDS, FAST_KEEPALIVE_S = 6, 0.5
ATTACH_TIMEOUT = aiohttp.ClientTimeout(total=3, connect=1)
KEEPALIVE_TIMEOUT = aiohttp.ClientTimeout(total=1.5, connect=1)
"""Two keep-alives in a row unanswered in this long (a cut-off parent sends no reset): the node leaves, ~3-4 s."""
ASK_STAGGER_S = 0.5
CHOOSE_BUDGET_S = 10.0
"""At most this long asking for a slot in one go (a fetch waits for it); the next round asks again."""
ATTACH_BODY_LIMIT = 64 * 1024
MEMBER_REFRESH_S = 2.0
CLOCK_TOLERANCE_S = 5.0


class WeightFollower:
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
        self.token = ""
        """What the parent named us with when it gave us the slot (sent on shard and news requests)."""
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
        self._read_at = -1e9
        self._avoid: dict[str, float] = {}
        """Nodes not to ask for a slot before the time given (we just left them)."""
        self._choosing = asyncio.Lock()
        self._tasks: set[asyncio.Future[None]] = set()
        self.changed = asyncio.Event()
        """Set when the parent changes (keep_attached then checks the new parent's path at once)."""
        self.announced = -1
        """The newest version the parent has told us of (its manifest carries the run key's signature)."""
        self.news = asyncio.Event()
        """Set when ``announced`` grows."""
        self._clock: dict[str, float] = {}
        """How far each node we attach to has its clock ahead of ours (only when over CLOCK_TOLERANCE_S)."""
        self.disk_full_until = 0.0
        """Until then (monotonic) the node announces no free slot: its disk could not take the last version."""

    def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.fetcher = ShardFetcher(session, self.store, self.node_id, self.metrics)
        self.fetcher.token_for = lambda node: self.token if self.parent == node else ""

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
            # no children while cut off from the origin, or while our disk cannot take new versions
            slots_free=self.server.slots_free() if self.path and time.monotonic() > self.disk_full_until else 0,
            upload_bps=self.server.upload_bps(),
            versions=self.store.complete_versions()[-16:],
            fetching=self.fetching,
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
        NODE_TTL_S, at once (reading all records per keepalive was most of a relay's libp2p bytes); an unknown id
        costs at most one DHT read per MEMBER_REFRESH_S, whoever asks."""
        seen = self._seen.get(node_id)
        return (seen is not None and time.monotonic() - seen[0] < NODE_TTL_S) or node_id in await self._records(
            max_age=MEMBER_REFRESH_S)  # fmt: skip

    def _avoiding(self) -> set[str]:
        now = time.monotonic()
        self._avoid = {n: t for n, t in self._avoid.items() if t > now}
        return set(self._avoid)

    async def _find(self, exclude: set[str]) -> list[Candidate]:
        """The fetcher's sources (see fetch.SourceFinder): the parent first (chosen now if there is none, or if
        the fetcher saw it fail), then up to two nodes that hold the whole version, the origin last."""
        if self._parent is not None and self._parent.node_id in exclude:
            await self._drop_parent("it failed to serve", avoid_s=REFUSED_AVOID_S)
        # records read a few seconds ago will do even without a parent: after leaving one (a partition, say) a
        # fresh DHT read can take many seconds while part of the DHT does not answer
        records = await self._records(max_age=RECORDS_MAX_AGE_S)
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
        """Attach, then choose: ask the candidates for a slot, best first; a full node names its children, asked
        next (the free slots are further down). A candidate silent for ``ASK_STAGGER_S`` (cut off, its request
        would wait out the timeout) does not hold up the next: both are in flight, the first slot given wins."""
        async with self._choosing:
            if self._parent is not None or self.session is None:
                return
            tried: set[str] = set()
            queue = parents(records, self.node_id, self.run_id, exclude | self._avoiding())
            deadline = time.monotonic() + CHOOSE_BUDGET_S
            asking: dict[asyncio.Task[tuple[int | None, object]], Candidate] = {}
            try:
                while (queue or asking) and time.monotonic() < deadline:
                    while queue and queue[0].node_id in tried:
                        queue.pop(0)
                    more = bool(queue) and len(tried) < MAX_ATTACH_TRIES
                    if more:
                        c = queue.pop(0)
                        tried.add(c.node_id)
                        asking[asyncio.ensure_future(self._post_attach(c))] = c
                    elif not asking:
                        break
                    wait = ASK_STAGGER_S if queue and len(tried) < MAX_ATTACH_TRIES else deadline - time.monotonic()
                    done, _ = await asyncio.wait(asking, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        c = asking.pop(task)
                        status, body = task.result()
                        if status == 200 and self._parent is None and self._adopt(c, body):
                            continue
                        if status is None or (status == 200 and self._parent and self._parent.node_id != c.node_id):
                            self._detach_soon(c)  # a slot we may hold (timed out) or no longer need (another won)
                        if status == 503 and isinstance(body, dict) and isinstance(body.get("children"), list):
                            names = [x for x in body["children"][:64] if isinstance(x, str)]
                            queue[:0] = below(records, names, tried | exclude | {self.node_id})
                    if self._parent is not None:
                        return
            finally:
                for task, c in asking.items():  # still waiting on slower candidates: they may give a slot
                    task.cancel()
                    self._detach_soon(c)

    def _adopt(self, c: Candidate, body: object) -> bool:
        """Take ``c`` as the parent if its answer shows a path from the origin without us in it."""
        path = body.get("path") if isinstance(body, dict) else None
        token = body.get("token") if isinstance(body, dict) else None
        if not (is_path(path) and path and path[0] == self.run_id and self.node_id not in path
                and isinstance(token, str) and len(token) <= 64):  # fmt: skip
            self._detach_soon(c)
            return False
        self.token = token
        was = self._parent_was
        self._parent = Candidate(c.node_id, c.url, len(path) - 1, True)
        self.path = [*path, self.node_id]
        self.depth = len(path)
        self._unrooted_since = None
        self._unreachable = 0
        if self.fetcher is not None:  # refused as an alternate a moment ago (full, say): as our parent it serves us
            self.fetcher.forgive(c.node_id)
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
        if self.fetcher is not None:  # what is in flight from it stops now, not at its deadline
            self.fetcher.abort_source(c.node_id)
        self._detach_soon(c)
        self._publish_soon()

    async def _leave(self, why: str, avoid_s: float) -> None:
        """Drop the parent (see keep_attached), choose a new one now, and let a running fetch pick it up."""
        await self._drop_parent(why, avoid_s)
        records = await self._records(max_age=RECORDS_MAX_AGE_S)
        await self._choose(records, self.fetcher._excluded() if self.fetcher is not None else set())
        if self.fetcher is not None:
            await self.fetcher.refresh_now()

    def _background(self, work: Awaitable[object]) -> None:
        async def run() -> None:
            await work

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _detach_soon(self, c: Candidate) -> None:
        """Give the slot back at once (best effort; it frees itself after the child TTL otherwise)."""
        if self.session is None:
            return
        session = self.session
        headers = signed_headers(self.identity, "DELETE", "/relay/attach", c.node_id, self._clock.get(c.node_id, 0.0))

        async def detach() -> None:
            try:
                async with session.delete(f"{c.url}/relay/attach", headers=headers, timeout=ATTACH_TIMEOUT):
                    pass
            except (aiohttp.ClientError, TimeoutError):
                pass

        self._background(detach())

    def _publish_soon(self) -> None:
        self._background(self.publish())

    async def _post_attach(
        self, c: Candidate, timeout: aiohttp.ClientTimeout = ATTACH_TIMEOUT
    ) -> tuple[int | None, object]:
        """POST /relay/attach, signed: (status, JSON body or None), (None, None) when the node cannot be reached.
        The body is a peer's word: bounded in size, and anything that is not plain JSON counts as no body."""
        assert self.session is not None
        headers = signed_headers(self.identity, "POST", "/relay/attach", c.node_id, self._clock.get(c.node_id, 0.0))
        try:
            async with self.session.post(f"{c.url}/relay/attach", headers=headers, timeout=timeout) as resp:
                offset = server_clock_offset(resp.headers.get("Date"))
                if offset is not None:  # a clock far from the parent's would fail its time window: sign in its time
                    self._clock[c.node_id] = offset if abs(offset) > CLOCK_TOLERANCE_S else 0.0
                    if len(self._clock) > 4096:
                        self._clock.clear()
                body: object = None
                if resp.status in (200, 409, 503):
                    try:
                        body = json.loads(await read_limited(resp, ATTACH_BODY_LIMIT))
                    except (ValueError, RecursionError, Rejected):
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
        self._publish_soon()  # in the background: a DHT store must not delay the first request
        try:
            manifest = await self.fetcher.fetch(version, self._find)
        finally:
            self.fetching = -1
        self.store.prune(self.keep, self.max_bytes)
        self.metrics.inc("node_weights_versions_received_total")
        self.metrics.set("node_weights_versions_held", len(self.store.complete_versions()))
        self._publish_soon()
        await self._leave_slow_parent()
        return manifest

    def _faster_holder(self) -> Candidate | None:
        """An alternate that delivered at least SLOW_FACTOR times the parent's rate, both over SLOW_MIN_SHARDS
        shards or more in the last fetch (the origin excepted: it stays the last resort)."""
        f, c = self.fetcher, self._parent
        if f is None or c is None:
            return None
        best = faster_than_parent(f.sources, c.node_id, self.run_id, f.banned)
        return Candidate(best.node_id, best.url, best.depth, True) if best is not None else None

    async def _leave_slow_parent(self) -> None:
        """Move below a node that proved much faster than the parent, if it has a slot for us."""
        c, old = self._faster_holder(), self._parent
        if c is None or old is None or self.fetcher is None:
            return
        old_id = old.node_id
        was, now = self.fetcher.sources[old_id].bps, self.fetcher.sources[c.node_id].bps
        status, body = await self._post_attach(c)
        if status != 200 or self._parent is not old:
            if status == 200:
                self._detach_soon(c)
            return
        self._parent_was = old_id
        if self._adopt(c, body):
            logger.info("left slow parent %s (%.1f MB/s) for %s (%.1f MB/s)", old_id, was / 1e6, c.node_id,
                        now / 1e6)  # fmt: skip
            self.metrics.inc("node_relay_slow_parent_moves_total", help="moves from a parent much slower than another")
            self._detach_soon(old)

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
            if fast > 0 or self._unreachable:  # just moved, or the last keep-alive went unanswered: ask sooner
                fast = max(0, fast - 1)
                await asyncio.sleep(FAST_KEEPALIVE_S)
            else:
                try:
                    await within(self.changed.wait(), KEEPALIVE_S)
                    continue
                except TimeoutError:
                    pass
            try:
                if self._parent is None:
                    await self._choose(await self._records(), self.fetcher._excluded() if self.fetcher else set())
                    if self._parent is not None and self.fetcher is not None:
                        await self.fetcher.refresh_now()
                else:
                    await self.attach_once(session)
            except Exception:  # a bug here must not take the node down with it: logged, counted, tried again
                self.metrics.inc("node_errors_total", label="keep_attached")
                logger.exception("keeping the relay tree attachment failed; trying again")

    async def attach_once(self, session: aiohttp.ClientSession) -> None:
        """One keep-alive: hold the slot, learn the parent's depth and path, leave a cycle or a parent that
        lost its way to the origin."""
        c = self._parent
        if c is None:
            return
        status, body = await self._post_attach(c, KEEPALIVE_TIMEOUT)
        if c is not self._parent:  # changed meanwhile: do not keep a second slot there
            if status == 200 and (self._parent is None or self._parent.node_id != c.node_id):
                self._detach_soon(c)
            return
        path = body.get("path") if isinstance(body, dict) else None
        reason = body.get("reason") if isinstance(body, dict) else None
        if status == 409 and reason == "ancestor":  # it found us in its own path: a cycle, as below
            status, path = 200, [self.node_id]
        elif status in (409, 503):  # the slot went to another node, or it lost its own way: choose again
            await self._leave(f"it refused us ({status} {reason or ''})".strip(), avoid_s=REFUSED_AVOID_S)
            return
        if status != 200 or not is_path(path):
            # unreachable, or an answer that holds no slot for us: two in a row and we look elsewhere
            self._unreachable += 1
            if self._unreachable >= SILENT_KEEPALIVES:
                await self._leave(f"no usable keep-alive answer ({status})", avoid_s=UNREACHABLE_AVOID_S)
            return
        self._unreachable = 0
        assert isinstance(path, list)
        token = body.get("token") if isinstance(body, dict) else None
        if isinstance(token, str) and len(token) <= 64:
            self.token = token
        if self.node_id in path:  # our parent descends from us: nothing can reach us through it
            at = path.index(self.node_id)
            logger.warning("cycle in the relay tree through %s", "->".join(p[:8] for p in path[at:]))
            self.metrics.inc("node_relay_cycles_left_total", help="times this node found itself below its own child")
            await self._leave("cycle", avoid_s=CYCLE_AVOID_S)
            return
        if not path or path[0] != self.run_id:  # the parent lost its way to the origin: it may find it again
            self.path = []
            now = time.monotonic()
            self._unrooted_since = self._unrooted_since or now
            if now - self._unrooted_since > UNROOTED_GRACE_S:
                await self._leave("not connected to the origin", avoid_s=REFUSED_AVOID_S)
            return
        self._unrooted_since = None
        self.path = [*path[-MAX_PATH:], self.node_id]
        assert c is not None
        if self.depth != len(path) or c.depth != len(path) - 1:
            self.depth = len(path)  # the parent moved in the tree: so did we
            self._parent = Candidate(c.node_id, c.url, len(path) - 1, True)
            self._publish_soon()

    async def watch_parent(self, session: aiohttp.ClientSession) -> None:
        """Learn of new versions from the parent as they start arriving there (``GET /relay/next``, a long
        poll), so news travels down the tree as fast as the data, not at each node's next look at the DHT. Only
        a manifest signed by the run key counts: a parent cannot make us chase a version that does not exist."""
        while True:
            c = self._parent
            if c is None:
                await asyncio.sleep(0.2)
                continue
            after = max(self.announced, self.store.newest())
            asked = time.monotonic()
            version = -1
            try:
                headers = {CHILD_HEADER: self.node_id, TOKEN_HEADER: self.token}
                async with session.get(
                    f"{c.url}/relay/next", params={"after": str(after)}, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=LONG_POLL_S + 5),
                ) as resp:  # fmt: skip
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
