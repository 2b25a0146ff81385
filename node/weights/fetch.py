"""Receiving a checkpoint: shards in parallel from several sources, each verified before it is kept.

Per shard the fetcher picks the usable source with the best score (measured throughput times success rate, the
parent preferred), resumes a partial shard with HTTP Range, and checks size and SHA-256 against the signed
manifest. A source that serves bad bytes is banned for ``ban_s`` and the shard is fetched elsewhere; a source
that is unreachable is set aside and the tree is asked for new sources (a re-parent). A 404 or 503 is not a
fault: the source does not have the shard yet, or has no free slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.auth import CHILD_HEADER, TOKEN_HEADER
from intellect_node.weights.files import MANIFEST_NAME, verify_manifest
from intellect_node.weights.pacing import VERIFIED_HEADER
from intellect_node.weights.progress import Progress
from intellect_node.weights.relay import LONG_POLL_S, MANIFEST_POLL_S
from intellect_node.weights.sources import ABOVE_EVERY, Source, above_due, pick_source, pick_spare
from intellect_node.weights.store import WeightStore
from intellect_node.weights.stripes import stripe_of
from intellect_node.weights.tree import Candidate
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected
from intellect_protocol.messages import Manifest, ShardEntry

logger = logging.getLogger(__name__)
_CHUNK = 1 << 20
_PIECE = 64 * 1024
SHARD_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5, sock_read=LONG_POLL_S + 10)
REFRESH_S = 1.0
SPARE_AGAIN_S, SPARE_SLACK_S = 1.0, 2.0
"""A source with no spare upload a moment ago (``pick_spare``) is asked again after the first; an alternate's shard
(no long poll) must start within the second, then come at half our slowest parent's rate (``_deadline``)."""
REPLAN_S = 5.0
"""While shards flow, the sources are planned again this often (new holders of the version, a moved parent)."""
PROBE_EVERY = 8
"""One pick in this many may go to an alternate not yet measured, so a faster source than the parent is found."""
MANIFEST_WAIT_S = 6.0
STALL_S = 30.0
"""No shard verified for this long: give up on the version (sources may have moved past it and dropped it);
the caller asks the trainer's record again and fetches the newest version instead."""
MIN_SHARD_BPS = 64 * 1024
"""A shard must arrive at this rate at least, over its whole transfer (a parent that trickles a byte now and then
never trips a per-read timeout): past ``SHARD_SLACK_S + size / MIN_SHARD_BPS`` the transfer is cut and the
source blamed."""
SHARD_SLACK_S = LONG_POLL_S + 10.0
"""Room for a shard that is still arriving at the source (a long poll) before the rate applies."""
BODY_SLACK_S = 5.0
"""Once the response has begun (the long poll is over), the rest of the shard gets this plus its size at
``MIN_SHARD_BPS``: a parent trickling a 1 MiB shard is cut after 21 s, within the stall budget (``STALL_S``), where
the whole slack would let it hold the shard past it."""
MANIFEST_BODY_S = BODY_SLACK_S + Channel.MANIFEST.value / MIN_SHARD_BPS
"""The same for a manifest's body, at its largest."""
SLOW_PARENT_AVOID_S = 60.0
"""A parent (not the origin) whose shard was cut for coming too slowly is left at once and not chosen, nor asked,
again for this long: it sent less than ``MIN_SHARD_BPS`` over a whole shard. Were it left only at a second cut, or
chosen again after a few seconds as the best place its record offers, a parent sending a byte a second could keep a
newcomer from every version."""


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or Rejected('oversized') as soon as it passes ``limit`` bytes."""
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            raise Rejected("oversized", f"more than {limit} bytes")
    return bytes(body)


SourceFinder = Callable[[set[str]], Awaitable[list[Candidate]]]
"""Given node ids seen failing, the sources to use, the parent first: see follower.WeightFollower._find."""


class ShardFetcher:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        store: WeightStore,
        node_id: str,
        metrics: Metrics,
        parallel: int = 4,
        ban_s: float = 300.0,
        stall_s: float = STALL_S,
    ) -> None:
        self.session = session
        self.store = store
        self.node_id = node_id
        self.metrics = metrics
        self.parallel = parallel
        self.ban_s = ban_s
        self.stall_s = stall_s
        self.banned: dict[str, float] = {}
        self.sources: dict[str, Source] = {}
        self._find: SourceFinder | None = None
        self._refreshed = 0.0
        self._picks = 0
        self.stripes = 1
        """Stripes of the versions it fetches (stripes.py): shard i belongs to stripe i mod this."""
        self.token_for: Callable[[str], str] = lambda node_id: ""
        """The token a source gave us with a slot (our parent's), sent with our requests to it."""
        self.strikes: dict[str, int] = {}
        """Per source: shards it passed through unverified that then failed verification."""
        self.slow: dict[str, float] = {}
        """Parents left for sending a shard too slowly, until when they are not used (``SLOW_PARENT_AVOID_S``)."""
        self._lacking: dict[str, set[str]] = {}
        """Per shard of the version being fetched, the parents that will not have it (``_one``)."""

    def _excluded(self) -> set[str]:
        """Sources not to use now, as parents or at all: banned for bad bytes, or too slow as a parent."""
        now = time.monotonic()
        self.banned = {n: t for n, t in self.banned.items() if t > now}
        self.slow = {n: t for n, t in self.slow.items() if t > now}
        return set(self.banned) | set(self.slow)

    def abort_source(self, node_id: str) -> None:
        """Cut every transfer from ``node_id`` now (the follower left it: a partition that drops packets would
        otherwise hold them until their deadline); the shards go back to the queue for other sources."""
        src = self.sources.get(node_id)
        if src is None:
            return
        now = asyncio.get_running_loop().time()
        for limit in list(src.active):
            limit.reschedule(now)

    def forgive(self, node_id: str) -> None:
        """``node_id`` just gave us a slot (it is our new parent): what it answered as an alternate (no free slot,
        unreachable) no longer holds. A ban for bad bytes stays."""
        src = self.sources.get(node_id)
        if src is not None:
            src.full, src.failed, src.away_until = False, 0, 0.0

    async def refresh_now(self) -> None:
        """Re-plan the sources at once (the follower found a reason the current parent cannot serve)."""
        await self._refresh(force=True)

    async def _refresh(self, force: bool = False) -> None:
        if self._find is None or (not force and time.monotonic() - self._refreshed < REFRESH_S):
            return
        self._refreshed = time.monotonic()
        now = time.monotonic()
        # Unreachable twice, or out of slots (503): plan around them until they have had time to recover.
        down = {n for n, s in self.sources.items() if (s.failed >= 2 or s.full) and s.away_until > now}
        plan = await self._find(self._excluded() | down)
        fresh: dict[str, Source] = {}
        for c in plan:
            src = self.sources.get(c.node_id) or Source(c.node_id, c.url, c.depth)
            src.url, src.depth, src.is_parent, src.parent_of, src.above_of = (
                c.url,
                c.depth,
                c.is_parent,
                c.parent_of,
                c.above_of,
            )
            fresh[c.node_id] = src
        self.sources = fresh

    def _pick(self, tried: set[str], stripe: int | None = None, lacking: set[str] | None = None) -> Source | None:
        """``lacking``: parents that answered they will not have the shard; it is picked as if we had none in its
        stripe, and from them again only when no other source is usable (a parent that does not know us yet, its
        slot just taken, answers as a stranger: at once)."""
        self._picks += 1
        probe, now = self._picks % PROBE_EVERY == 0, time.monotonic()
        if lacking:
            others = [s for s in self.sources.values() if s.node_id not in lacking]
            src = pick_source(others, tried, self.banned, now, probe, stripe)
            if src is not None:
                return src
        return pick_source(self.sources.values(), tried, self.banned, now, probe, stripe)

    async def _manifest(self, version: int, deadline: float) -> bytes:
        while time.monotonic() < deadline:
            await self._refresh()
            for src in sorted(self.sources.values(), key=lambda s: not s.is_parent):
                if src.node_id in self.banned or src.node_id in self.slow:
                    continue
                due, begun = asyncio.get_running_loop().time() + MANIFEST_POLL_S + 10, False
                try:  # under a deadline the follower can bring forward (abort_source): a parent cut off by a
                    # partition that drops packets would hold the request for the whole read timeout
                    async with (
                        asyncio.timeout(due) as limit,
                        _tracked(src.active, limit),
                        self.session.get(f"{src.url}/weights/{version}/{MANIFEST_NAME}") as resp,
                    ):
                        if resp.status == 200:  # it has it: the body, small, comes at once, or it stalls us
                            begun, due = True, min(due, asyncio.get_running_loop().time() + MANIFEST_BODY_S)
                            limit.reschedule(min(due, limit.when() or due))
                            data = await read_limited(resp, Channel.MANIFEST.value)
                            verify_manifest(data, self.store.run_id, version, self.store.epoch)
                            return data
                except (TimeoutError, aiohttp.ClientError):
                    src.failed += 1
                    if begun and limit.expired() and (limit.when() or 0.0) >= due and src.is_parent:
                        self._leave_slow(src, f"the manifest of version {version}")
                        await self._refresh(force=True)
                except Rejected as e:
                    if e.reason == "wrong_epoch":  # a node still on the run's previous start: not a liar, just behind
                        src.failed += 1
                        continue
                    # a forged or broken manifest: never acted on, its source banned
                    logger.warning("banned source=%s: manifest of version %d: %s", src.node_id, version, e)
                    self.metrics.inc("node_relay_bans_total")
                    self.banned[src.node_id] = time.monotonic() + self.ban_s
            await asyncio.sleep(0.1)
        raise Rejected("no_source", f"no source had the manifest of version {version}")

    async def fetch(self, version: int, find: SourceFinder, timeout: float = 3600.0) -> Manifest:
        """Receive ``version`` into the store; returns its manifest once every shard is verified."""
        self._find = find
        self._lacking = {}
        await self._refresh(force=True)
        deadline = time.monotonic() + timeout
        data = await self._manifest(version, min(deadline, time.monotonic() + MANIFEST_WAIT_S))
        manifest, missing = self.store.begin(version, data)
        progress = Progress(version, manifest.total_size)
        progress.add(manifest.total_size - sum(s.size for s in missing))
        # Shards go in manifest order within each stripe, a failed one back to its place: a relay receives in
        # order, so its children, asking in the same order, find each shard as soon as it can exist (pipelining).
        # Each stripe has its own workers (its own parent); one whose stripe is done helps the one furthest behind.
        k = max(1, self.stripes)
        order = {s.name: i for i, s in enumerate(manifest.shards)}
        heaps: list[list[tuple[int, ShardEntry]]] = [[] for _ in range(k)]
        for shard in missing:
            heaps[stripe_of(order[shard.name], k)].append((order[shard.name], shard))
        for heap in heaps:
            heapq.heapify(heap)
        tried: dict[str, set[str]] = {}
        lent: dict[int, int] = {}
        """Per stripe, the last run of ABOVE_EVERY of its shards in which the root above us sent our share."""
        last_progress = time.monotonic()

        async def worker(mine: int) -> None:
            nonlocal last_progress
            while any(heaps):
                stripe = mine if heaps[mine] else max(range(k), key=lambda s: len(heaps[s]))
                pending = heaps[stripe]
                if time.monotonic() > deadline:
                    raise Rejected("timeout", f"version {version} not complete after {timeout:.0f}s")
                if time.monotonic() - last_progress > self.stall_s:
                    raise Rejected("stalled", f"no shard of version {version} arrived in {self.stall_s:.0f}s")
                if time.monotonic() - self._refreshed > REPLAN_S:
                    await self._refresh()
                    continue  # another worker may have taken the last shard meanwhile
                # The endgame: a worker done with its own stripe takes the last shard of one behind from a node with
                # spare upload (pick_spare) while that stripe's worker goes on with the parent from the front; only
                # while none has any does it ask the parent too (splitting its upload with our siblings').
                src: Source | None
                spare = (
                    pick_spare(self.sources.values(), self.banned, time.monotonic(), stripe)
                    if k > 1 and stripe != mine and len(pending) > 1
                    else None
                )
                if spare is not None:
                    index, shard = max(pending)
                    pending.remove((index, shard))
                    heapq.heapify(pending)
                    src = spare
                else:
                    index, shard = heapq.heappop(pending)
                    # our share of each run of the stripe from the root above: from our place on, once a run
                    if (
                        stripe == mine
                        and lent.get(stripe) != index // k // ABOVE_EVERY
                        and above_due(self.node_id, index // k)
                    ):
                        spare = next(
                            (
                                s
                                for s in self.sources.values()
                                if stripe in s.above_of
                                and s.node_id not in self.banned
                                and max(s.away_until, s.spare_until) <= time.monotonic()
                            ),
                            None,
                        )
                    src = spare or self._pick(
                        tried.setdefault(shard.name, set()), stripe if k > 1 else None, self._lacking.get(shard.name)
                    )
                if src is None:
                    heapq.heappush(pending, (index, shard))
                    await self._refresh()
                    await asyncio.sleep(0.05)
                    continue
                tried.setdefault(shard.name, set()).add(src.node_id)
                if await self._one(version, shard, src, spare is not None, stripe if k > 1 else None):
                    if stripe in src.above_of:
                        lent[stripe] = index // k // ABOVE_EVERY
                    progress.add(shard.size)
                    last_progress = time.monotonic()
                else:
                    heapq.heappush(pending, (index, shard))

        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())), asyncio.TaskGroup() as tasks:
                # one worker per stripe: two connections per child at a parent let TCP share its upload unevenly
                # (one stripe at a fraction of the others' rate, its subtree last: docs/notes/weights-findings.md)
                workers = self.parallel if k == 1 else k
                for i in range(min(workers, max(1, len(missing)))):
                    tasks.create_task(worker(i % k))
        except BaseException as e:
            self.store.abandon(version)
            if isinstance(e, BaseExceptionGroup):
                rejected, _ = e.split(Rejected)
                if rejected is not None:  # callers handle one Rejected, as from the manifest phase
                    raise rejected.exceptions[0] from None
                local, _ = e.split(OSError)  # our disk (full, or out of file handles): the caller sheds load
                if local is not None:
                    raise _first(local) from None
            if isinstance(e, TimeoutError):
                raise Rejected("timeout", f"version {version} not complete after {timeout:.0f}s") from None
            raise
        # whole even when the caller gives up now (a deadline): a rename half done would leave the version neither
        # served nor pruned until it is asked for again
        await asyncio.shield(self.store.finish(version))
        return manifest

    async def _one(
        self, version: int, shard: ShardEntry, src: Source, spare: bool = False, stripe: int | None = None
    ) -> bool:
        """Fetch one shard (of ``stripe``) from ``src``; True once it is verified and kept. ``spare``: on its spare
        upload (``pick_spare``), where a refusal or a response cut short says nothing of it as a parent."""
        part = self.store.part_path(version, shard.name)
        have = part.stat().st_size if part.exists() else 0
        if have >= shard.size:
            part.unlink(missing_ok=True)
            have = 0
        digest = hashlib.sha256()
        if have:
            with open(part, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
        headers = {CHILD_HEADER: self.node_id}
        token = self.token_for(src.node_id)
        if token:
            headers[TOKEN_HEADER] = token
        if have:
            headers["Range"] = f"bytes={have}-"
        url = f"{src.url}/weights/{version}/{shard.name}"
        started = time.monotonic()
        received = 0
        whole_from_src = have == 0
        # our own deadline for the transfer (abort_source may bring it forward: no fault of the source, then)
        due = asyncio.get_running_loop().time() + self._deadline(shard.size - have, src, stripe)
        try:
            async with (
                asyncio.timeout(due) as limit,
                _tracked(src.active, limit),
                self.session.get(url, headers=headers, timeout=SHARD_TIMEOUT) as resp,
            ):
                if resp.status in (404, 503):
                    logger.debug(
                        "shard=%s source=%s answered %d after %.3fs",
                        shard.name,
                        src.node_id[:8],
                        resp.status,
                        time.monotonic() - started,
                    )
                    if spare or (src.is_parent and not src.serves(stripe)):  # or our parent elsewhere only: marked
                        src.spare_until = time.monotonic() + SPARE_AGAIN_S  # full, it was dropped as that parent too
                        return False
                    src.full = resp.status == 503
                    src.away_until = time.monotonic() + (2.0 if src.full else 0.2)
                    if resp.status == 404 and src.serves(stripe) and time.monotonic() - started < LONG_POLL_S / 2:
                        # our parent answered at once, without a long poll: it holds or receives a newer version, or
                        # dropped this one (relay.py), and will not have this shard. Another source sends it, as if
                        # we had no parent in the stripe (else we would ask it again and again and the version stall)
                        self._lacking.setdefault(shard.name, set()).add(src.node_id)
                    if resp.status == 404 and time.monotonic() - started > LONG_POLL_S / 2:
                        # It waited a long poll and still had nothing: a parent that is stuck itself (say,
                        # cut off from the DHT) counts as failing, so twice of this moves us elsewhere.
                        src.failed += 1
                    if src.full and src.is_parent:
                        await self._refresh(force=True)
                    return False
                if resp.status == 200 and have:
                    have, digest, whole_from_src = 0, hashlib.sha256(), True  # the source ignored the Range
                elif resp.status not in (200, 206):
                    src.failed += 1
                    return False
                vouched = resp.headers.get(VERIFIED_HEADER, "1") != "0"
                # the response has begun: no long poll is left to wait for, the rest comes at the rate at least
                due = min(due, asyncio.get_running_loop().time() + self._deadline(shard.size - have, src, stripe, True))
                limit.reschedule(min(due, limit.when() or due))
                self.store.part_opened(version, shard.name, have, shard.size)
                with open(part, "r+b" if have else "wb") as f:
                    f.seek(have)
                    f.truncate()
                    # Pieces of _PIECE bytes: one write, flush and wake-up of cut-through readers per piece,
                    # not per TCP segment (a shaped link delivers a few kB at a time).
                    while have + received < shard.size:
                        want = min(_PIECE, shard.size - have - received)
                        try:
                            piece = await resp.content.readexactly(want)
                        except asyncio.IncompleteReadError as e:
                            piece = e.partial
                        if piece:
                            digest.update(piece)
                            f.write(piece)
                            f.flush()  # children reading this .part (cut-through) see the bytes now
                            received += len(piece)
                            self.store.part_grew(version, shard.name, have + received)
                            self.metrics.inc("node_relay_bytes_received_total", len(piece))
                        if len(piece) < want:
                            raise ConnectionError(f"the response ended after {have + received} of {shard.size} bytes")
                    if await resp.content.read(1):
                        return self._bad(version, shard, src, whole_from_src, vouched, "longer than the manifest says")
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            self.store.part_closed(version, shard.name, verified=False)
            if isinstance(e, TimeoutError):  # too slow (a whole-shard rate deadline, or silence): blamed
                src.failed += 1
                src.away_until = time.monotonic() + min(30.0, 5.0 * src.failed)
                self.metrics.inc("node_weights_slow_sources_total", help="shard transfers cut for being too slow")
                # our own rate deadline (not abort_source's, nor a connect or read timeout): it served too little
                if limit.expired() and (limit.when() or 0.0) >= due and src.serves(stripe):
                    self._leave_slow(src, f"shard {shard.name}")
            elif received:  # cut short after progress (say, its own upstream failed mid cut-through): resume soon
                src.away_until = time.monotonic() + 0.2
                if spare:  # a child of its own needed the upload: resumed from the parent or elsewhere
                    src.spare_until = time.monotonic() + SPARE_AGAIN_S
            else:
                src.failed += 1
                src.away_until = time.monotonic() + min(5.0, 0.5 * src.failed)
            logger.debug(
                "shard %s from %s failed: %r (kept %d bytes for resume)", shard.name, src.node_id, e, have + received
            )
            await self._refresh(force=src.is_parent)
            return False
        except BaseException:
            self.store.part_closed(version, shard.name, verified=False)
            raise
        if have + received != shard.size or digest.hexdigest() != shard.sha256:
            return self._bad(version, shard, src, whole_from_src, vouched, "hash mismatch")
        try:
            await self.store.mark_verified(version, shard.name)
        finally:  # cut-through readers end with the whole shard either way (its bytes matched the manifest)
            self.store.part_closed(version, shard.name, verified=True)
        logger.debug(
            "shard=%s source=%s bytes=%d waited_and_received_s=%.3f",
            shard.name,
            src.node_id[:8],
            received,
            time.monotonic() - started,
        )
        src.ok += not spare  # spare upload does not make a parent (faster_than_parent)
        src.failed = 0
        src.full = False
        elapsed = time.monotonic() - started
        if received >= _CHUNK and elapsed > 0:
            rate = received / elapsed
            src.bps = rate if src.bps == 0 else 0.7 * src.bps + 0.3 * rate
        return True

    def _leave_slow(self, src: Source, what: str) -> None:
        """``src``, our parent, sent ``what`` slower than MIN_SHARD_BPS: it is not used for SLOW_PARENT_AVOID_S (the
        re-plan that follows leaves it), unless it is the origin, the last resort."""
        if src.node_id == self.store.run_id:
            return
        logger.info(
            "leaving parent=%s for %.0fs: %s came slower than %d B/s",
            src.node_id,
            SLOW_PARENT_AVOID_S,
            what,
            MIN_SHARD_BPS,
        )
        self.metrics.inc("node_weights_slow_parents_left_total", help="parents left for sending too slowly")
        self.slow[src.node_id] = time.monotonic() + SLOW_PARENT_AVOID_S

    def _deadline(self, size: int, src: Source, stripe: int | None, begun: bool = False) -> float:
        """Seconds a transfer of ``size`` bytes may take; from an alternate beside our parent in the stripe (a probe,
        the endgame: no long poll) at half our slowest parent's rate at least (else a trickler holds a 64 MiB shard
        17 min: docs/weights.md, "Spare upload and the endgame").
        ``begun``: the rest of a response that has begun (``BODY_SLACK_S``, no long poll left)."""
        alternate = not src.serves(stripe) and any(s.serves(stripe) for s in self.sources.values())
        rates = [s.bps for s in self.sources.values() if s.is_parent and s.bps > 0] if alternate else []
        slack = SPARE_SLACK_S if alternate else BODY_SLACK_S if begun else SHARD_SLACK_S
        return slack + size / max(MIN_SHARD_BPS, min(rates, default=0) / 2)

    def _bad(self, version: int, shard: ShardEntry, src: Source, whole: bool, vouched: bool, why: str) -> bool:
        """Bad bytes: banned at once if the source vouched for them (it had verified the shard) and sent all of
        them; bytes it passed through unverified (cut-through) earn a strike, and a second strike bans."""
        self.store.part_closed(version, shard.name, verified=False)
        self.store.part_path(version, shard.name).unlink(missing_ok=True)
        if whole and not vouched:
            self.strikes[src.node_id] = strikes = self.strikes.get(src.node_id, 0) + 1
            logger.info(
                "source=%s relayed unverified bytes of %s that failed: %s (strike %d)",
                src.node_id,
                shard.name,
                why,
                strikes,
            )
        # only a source that sent every byte of the shard is to blame
        if whole and (vouched or self.strikes.get(src.node_id, 0) >= 2):
            if self.banned.get(src.node_id, 0.0) <= time.monotonic():  # count a ban once, not per shard in flight
                self.metrics.inc("node_relay_bans_total", help="sources banned for serving bad bytes")
                logger.warning("banned source=%s for %.0fs: shard %s %s", src.node_id, self.ban_s, shard.name, why)
            self.banned[src.node_id] = time.monotonic() + self.ban_s
        return False


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


@contextlib.asynccontextmanager
async def _tracked(active: set[asyncio.Timeout], limit: asyncio.Timeout) -> AsyncIterator[None]:
    active.add(limit)
    try:
        yield
    finally:
        active.discard(limit)
