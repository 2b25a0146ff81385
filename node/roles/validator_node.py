"""The validator role: judge rollout batches as the trainer admits them, in parallel, and gossip signed verdicts.

``intellect-node join --role validator --peers ... --run-id ...`` follows the run's newest weights like any node
(and relays them: it is at home in a stripe, and its children there receive through it), and fetches an older
version only when a batch it judges claims it (``judge``); it keeps the newest ``async_level + 1`` versions it
holds (fewer under ``--keep-versions`` or a disk cap). It listens on the run's gossip topics: producers'
announcements tell it who holds each batch, and the trainer's acknowledgement of an admitted batch (signed by the
run key) names the batch's producer and the validators asked to judge it. A named validator fetches the body by
digest (node/p2p/batches.py), checks it on the exact version it claims (node/judging/validator.py) and publishes a
signed Verdict on the ``verdicts`` topic. The trainer counts verdicts only from validators it was started with
(``intellect-node bootstrap --validator <node id>``) and judges a batch itself when the named ones do not answer
within ``verify.verdict_wait_s``.

Who holds a batch (``Holders``): anyone may announce any digest, so an announcement is only a claim, kept per
signing key. The holder of a batch is the peer of its producer's own claim, the producer being the key the run key's
acknowledgement names (the trainer admits batches only from registered inference keys, so the acknowledgement is
the validator's registry check); a claim by any other key never names a holder, and once the producer is known
such claims are refused. A key's first peer is kept: a replay of the producer's announcement from another peer
does not move it.

Where a body comes from: the holder and the trainer (which holds every batch it admitted), asked at once, each for
at most ``FETCH_SHARE`` of ``verify.verdict_wait_s``; the first body whose SHA-256 is the acknowledged digest wins
and the other request is cancelled. A source that stalls costs at most that share, never the verdict wait.

Work it takes on: only batches the run key acknowledged and named it for, ``JOBS`` queued at most (the oldest
dropped: the trainer judges those itself). Bookkeeping is bounded: ``HOLDERS`` digests, ``CLAIMANTS`` keys each.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from typing import Any

import aiohttp
import torch

from intellect_node.aio import raise_if_cancelled, within
from intellect_node.judging.validator import Validator
from intellect_node.p2p.batches import FETCH_TIMEOUT_S, fetch_batch
from intellect_node.p2p.gossip import LIMITS
from intellect_node.p2p.transport import off_loop_if_large
from intellect_node.policy.model import DTYPES, build_model, build_tokenizer, load_weights, resolve_device, stored_in
from intellect_node.roles.volunteer import POLL_S, Volunteer
from intellect_node.runtime import trim_freed
from intellect_node.weights.files import load_checkpoint
from intellect_protocol.envelope import Rejected, decode_body, kind_of, open_envelope, open_signed, seal
from intellect_protocol.identity import node_id_of
from intellect_protocol.messages import BatchAck, BatchAnnounce, Role, RolloutBatch, RunSpec, SubmitReply, Verdict

logger = logging.getLogger(__name__)
VERSION_WAIT_S = 30.0
"""How long a batch's judging may wait for the version it claims: its fetch (after any fetch under way), tried
again while it fails. Past it the batch is refused ``version_unavailable`` and the trainer judges it itself."""
WATCH_S = 0.5
JOBS = 256
UNASKED_ACKS, UNASKED_S = 32, 60.0
"""A validator that heard this many acknowledgements in a row naming other judges (or none), the last within
UNASKED_S, says it is not asked (the trainer names each validator it trusts and sees in turn)."""
HOLDERS = 4096
"""Batch digests whose claims (and producers) are remembered, the newest."""
CLAIMANTS = 4
"""Keys remembered as announcing one digest: an honest batch has one (its producer); the rest are echoes."""
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 1.0
"""A source that answered busy or dropped the stream is asked again after this pause, doubling up to the second
figure, until its fetch deadline: a server refuses past its rate per peer (batches.RATE, 10 a second), and a
validator that catches up after a pause (a version it waited for) asks faster than that; giving up at the first
refusal left batches unjudged, and the trainer waited its whole verdict wait before judging them itself."""
FETCH_SHARE = 0.25
"""Each source of a body gets this share of ``verify.verdict_wait_s`` (15 s of the default 60, at most
FETCH_TIMEOUT_S): the sources are asked at once, so a stalling one costs at most this, and at least three quarters
of the wait is left for the version to arrive and the model to judge before the trainer judges the batch itself.
The largest batch (16 MiB) fits in 15 s at about 1 MB/s; a typical one is a few hundred KB."""


class Holders:
    """Who claims to hold each batch, by digest and signing key; the holder is the producer's claim (module doc)."""

    def __init__(self) -> None:
        self.claims: OrderedDict[str, dict[str, str]] = OrderedDict()
        """Digest -> {announcing key: its first peer}, at most CLAIMANTS keys, the newest HOLDERS digests."""
        self.producers: OrderedDict[str, str] = OrderedDict()
        """Digest -> its producer, as the run key's acknowledgement names it; the newest HOLDERS."""

    def claim(self, digest: str, node_id: str, peer: str) -> str:
        """Record ``node_id``'s announcement of ``digest`` from ``peer``; returns what it was ('producer': the
        holder; 'claim': the producer is not known yet; 'repeat': the key's first peer is kept). Raises Rejected
        'not_producer' once another key is known to be the producer, 'claimants_full' past CLAIMANTS keys."""
        producer = self.producers.get(digest)
        if producer is not None and node_id != producer:
            raise Rejected("not_producer", f"batch {digest[:12]} is {producer}'s")
        claims = self.claims.get(digest)
        if claims is None:
            claims = self.claims[digest] = {}
            while len(self.claims) > HOLDERS:
                self.claims.popitem(last=False)
        if node_id in claims:
            return "repeat"
        if len(claims) >= CLAIMANTS:
            raise Rejected("claimants_full", f"{CLAIMANTS} keys already announced batch {digest[:12]}")
        claims[node_id] = peer
        return "producer" if producer is not None else "claim"

    def produced_by(self, digest: str, node_id: str) -> list[tuple[str, str]]:
        """The run key named ``node_id`` the producer of ``digest``: the other keys' claims are dropped and
        returned (key, peer), and refused from now on."""
        self.producers[digest] = node_id
        self.producers.move_to_end(digest)
        while len(self.producers) > HOLDERS:
            self.producers.popitem(last=False)
        claims = self.claims.get(digest, {})
        dropped = [(k, p) for k, p in claims.items() if k != node_id]
        for k, _ in dropped:
            del claims[k]
        return dropped

    def holder(self, digest: str) -> str | None:
        """The peer of the producer's own announcement of ``digest``, once the producer is known and announced it."""
        producer = self.producers.get(digest)
        return self.claims.get(digest, {}).get(producer) if producer is not None else None


class ValidatorNode(Volunteer):
    role: Role = "validator"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.validator: Validator | None = None
        self.loaded = -1
        self._lock = asyncio.Lock()
        self.judged = 0
        self.refused = 0
        self.holders = Holders()
        self.seen: OrderedDict[str, bool] = OrderedDict()
        self.jobs: asyncio.Queue[tuple[BatchAck, str]] = asyncio.Queue(JOBS)
        self.acks_at = -math.inf
        """When the trainer's last acknowledgement was heard (time.monotonic())."""
        self.unasked = 0
        """Acknowledgements heard in a row that named other judges, or none."""
        self.trainer_at = (-1, -1)
        """The trainer's epoch and newest version, as its record said last (``work``)."""

    def working(self) -> dict[str, Any]:
        """Not working while the trainer acknowledges batches (one heard within ``UNASKED_S``) and the last
        ``UNASKED_ACKS`` named other judges only, or none: the trainer asks, in turn, only the validators it was
        started with that it sees in the run, and says nothing to the others."""
        if time.monotonic() - self.acks_at < UNASKED_S and self.unasked >= UNASKED_ACKS:
            return {
                "ok": False,
                "doing": f"not asked to judge: the trainer's last {self.unasked} acknowledgements named other judges "
                "or none. It asks only the validators it was started with: its operator adds --validator "
                f"{self.identity.node_id} to `intellect-node bootstrap` (a restart keeps the run)",
            }
        return {"ok": True, "doing": f"judging batches: {self.judged} judged, version {self.loaded} loaded"}

    def status(self) -> dict[str, Any]:
        return {**super().status(), "loaded_version": self.loaded, "judged": self.judged, "refused": self.refused}

    def reject(self, e: Rejected, peer: str) -> SubmitReply:
        self.refused += 1
        self.metrics.inc("node_validator_requests_refused_total", label=e.reason)
        logger.info("refused validation request peer=%s reason=%s detail=%s", peer, e.reason, e.detail)
        return SubmitReply(ok=False, reason=e.reason, detail=e.detail[:500])

    async def _load(self, version: int) -> None:
        """The model on ``version``'s weights, read while no fetch runs (a fetch prunes older versions)."""
        assert self.follower is not None and self.validator is not None
        if self.loaded == version:
            return
        async with self.follower.held(version) as manifest:
            if manifest is None:
                raise Rejected("version_unavailable", f"version {version} is not held here")
            model = self.validator.model
            await asyncio.to_thread(load_weights, model, load_checkpoint(self.store.folder(version), manifest))
        self.loaded = version

    def _judge(self, batch: RolloutBatch, data: bytes, full: bool = False) -> Verdict:
        assert self.validator is not None and self.loaded == batch.version
        try:
            return self.validator.check(batch, full=full).verdict(batch, data)
        finally:
            trim_freed()

    async def _on_announce(self, data: bytes, peer: str) -> None:
        """A claim to hold a batch: it names the holder only when its key is the batch's producer (``Holders``)."""
        try:
            signed = open_signed(data, BatchAnnounce)
            a = signed.message
            if signed.signer_id != a.node_id or a.run_id != self.run_id:
                raise Rejected("signer_mismatch", "an announcement of another node's batch")
            outcome = self.holders.claim(a.batch_sha256, a.node_id, peer)
        except Rejected as e:  # the gossip layer logs it at debug with the peer
            self.metrics.inc("node_validator_announcements_total", label=e.reason)
            raise
        described = "batch announcements heard, by outcome: producer, claim, repeat, or why refused"
        self.metrics.inc("node_validator_announcements_total", label=outcome, help=described)

    async def _on_ack(self, data: bytes, peer: str) -> None:
        if kind_of(data, LIMITS["verdicts"]) != BatchAck.KIND:
            return  # a verdict (ours or another validator's)
        signed = open_signed(data, BatchAck)
        ack = signed.message
        if signed.signer_id != self.run_id or ack.run_id != self.run_id:
            raise Rejected("foreign_ack", f"an acknowledgement signed by {signed.signer_id}")
        for node_id, by in self.holders.produced_by(ack.batch_sha256, ack.node_id):
            self.metrics.inc("node_validator_announcements_total", label="not_producer")
            logger.debug(
                "refused an announcement peer=%s node=%s batch=%s reason=not_producer producer=%s",
                by,
                node_id,
                ack.batch_sha256[:12],
                ack.node_id,
            )
        self.acks_at = time.monotonic()
        self.unasked = 0 if self.identity.node_id in ack.judges else self.unasked + 1
        if self.identity.node_id not in ack.judges or ack.batch_sha256 in self.seen:
            return
        self.seen[ack.batch_sha256] = True
        while len(self.seen) > HOLDERS:
            self.seen.popitem(last=False)
        if self.jobs.full():
            self.jobs.get_nowait()
            self.metrics.inc("node_validator_jobs_dropped_total", help="judging requests dropped: too many queued")
        self.jobs.put_nowait((ack, peer))

    def _sources(self, ack: BatchAck, trainer_peer: str) -> dict[str, str]:
        """Peers to ask for an acknowledged batch, with what they are: its producer's holder, and the trainer: the
        peer in the trainer's signed DHT record, or before that is read the acknowledgement's sender (anyone may
        re-publish a signed acknowledgement; a wrong sender costs one request of at most the fetch deadline)."""
        sources = {peer: "trainer" for peer in (self._trainer_peers() or [trainer_peer])}
        holder = self.holders.holder(ack.batch_sha256)
        if holder is not None:
            sources.setdefault(holder, "producer")
        return sources

    def _trainer_peers(self) -> list[str]:
        return [m.rsplit("/p2p/", 1)[-1] for m in self._trainer_maddrs[:1] if "/p2p/" in m]

    def fetch_deadline(self) -> float:
        """How long one source may take to deliver a body (FETCH_SHARE)."""
        assert self.spec is not None
        return min(FETCH_TIMEOUT_S, FETCH_SHARE * self.spec.verify.verdict_wait_s)

    async def _fetch(self, ack: BatchAck, trainer_peer: str) -> bytes:
        """The acknowledged batch's body from whichever source serves it first (module doc); fetch_batch checks
        that its SHA-256 is the digest. Rejected 'unavailable' when no source served it in time."""
        assert self.p2p is not None
        digest, deadline = ack.batch_sha256, self.fetch_deadline()
        asks = {
            asyncio.ensure_future(self._fetch_from(peer, digest, deadline)): (peer, source)
            for peer, source in self._sources(ack, trainer_peer).items()
        }
        pending = set(asks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for ask in done:
                    peer, source = asks[ask]
                    try:
                        body = ask.result()
                    except (ConnectionError, TimeoutError, Rejected) as e:
                        reason = getattr(e, "reason", "timeout" if isinstance(e, TimeoutError) else "unreachable")
                        self.metrics.inc("node_validator_fetch_failures_total", label=reason)
                        logger.debug("could not fetch batch=%s peer=%s source=%s: %r", digest[:12], peer, source, e)
                        continue
                    if body is None:
                        self.metrics.inc("node_validator_fetch_failures_total", label="missing")
                        continue
                    self.metrics.inc(
                        "node_validator_fetches_total",
                        label=source,
                        help="batch bodies fetched, by the source that served first",
                    )
                    return body
        finally:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        raise Rejected("unavailable", f"nobody served batch {digest[:12]} (each source asked for {deadline:.0f}s)")

    async def _fetch_from(self, peer: str, digest: str, deadline: float) -> bytes | None:
        """The batch from one source within ``deadline`` seconds, asked again after a pause (RETRY_FIRST_S) while it
        answers busy or drops the stream (ConnectionError). None (it does not hold it), a wrong body and a
        timeout are final."""
        assert self.p2p is not None
        until = time.monotonic() + deadline
        pause = RETRY_FIRST_S
        while True:
            try:
                left = until - time.monotonic()
                return await within(fetch_batch(self.p2p, self.identity, self.run_id, peer, digest), max(0.0, left))
            except ConnectionError:
                if time.monotonic() + pause >= until:
                    raise
                self.metrics.inc("node_validator_fetch_retries_total", help="batch fetches asked again (busy)")
                await asyncio.sleep(pause)
                pause = min(2 * pause, RETRY_MAX_S)

    async def judge(self, data: bytes, full: bool = False) -> Verdict:
        """A signed verdict about exactly ``data``, a producer's batch; Rejected when it cannot be judged here."""
        signer, body = await off_loop_if_large(len(data), open_envelope, data, RolloutBatch)
        batch = (await off_loop_if_large(len(body), decode_body, signer, body, RolloutBatch)).message
        if batch.run_id != self.run_id:
            raise Rejected("wrong_run", f"batch for run {batch.run_id}")
        if batch.node_id != node_id_of(signer):
            raise Rejected("signer_mismatch", "batch not signed by its producer")
        if self.spec is None or batch.epoch != self.spec.epoch:
            raise Rejected("wrong_epoch", f"batch of run epoch {batch.epoch}; this validator follows another")
        await self._hold(batch.version, self.spec)
        async with self._lock:  # one model, one batch at a time
            if self.spec is None or batch.epoch != self.spec.epoch:  # the run started over while it waited
                raise Rejected("wrong_epoch", f"batch of run epoch {batch.epoch}; this validator follows another")
            started = time.monotonic()
            await self._load(batch.version)
            verdict = await asyncio.to_thread(self._judge, batch, data, full)
        self.judged += 1
        self.metrics.inc("node_validator_batches_total", label="ok" if verdict.ok else verdict.reason)
        self.metrics.inc("node_validator_seconds_total", time.monotonic() - started)
        self.metrics.observe("node_validation_seconds", time.monotonic() - started, help="a batch judged")
        logger.info(
            "verdict node=%s version=%d batch=%d ok=%s reason=%s",
            batch.node_id,
            batch.version,
            batch.batch_index,
            verdict.ok,
            verdict.reason,
        )
        return verdict

    async def _hold(self, version: int, spec: RunSpec) -> None:
        """Have ``version`` here to judge a batch on it, within VERSION_WAIT_S: the work loop fetches only the
        newest (the children in this node's stripe wait for it), so an older one is fetched now, after any fetch
        under way, and tried again while it fails. Refused ``version_unavailable``, with nothing fetched, once no
        rollout may claim it (more than ``async_level`` behind the newest known), and when this node prunes it as
        it arrives (``--keep-versions`` or the disk cap); ``wrong_epoch`` when the run starts over meanwhile."""
        assert self.follower is not None
        deadline = time.monotonic() + VERSION_WAIT_S
        while version not in self.store.complete_versions():
            if self.spec is None or self.spec.epoch != spec.epoch:
                raise Rejected("wrong_epoch", f"the run was started over while version {version} was awaited")
            epoch, announced = self.trainer_at
            newest = max(announced if epoch == spec.epoch else -1, self.store.newest())
            if version < newest - spec.train.async_level:
                raise Rejected("version_unavailable", f"version {version} is older than any a rollout may claim")
            left = deadline - time.monotonic()
            if left <= 0:
                raise Rejected("version_unavailable", f"version {version} did not arrive in {VERSION_WAIT_S:.0f}s")
            try:
                await within(self.follower.sync(version), left)
            except (TimeoutError, Rejected, aiohttp.ClientError, OSError) as e:
                raise_if_cancelled()
                reason = getattr(e, "reason", "timeout" if isinstance(e, TimeoutError) else "network")
                self.metrics.inc("node_weights_fetch_failures_total", label=reason)
                logger.debug("could not fetch version %d to judge a batch: %r", version, e)
                await asyncio.sleep(min(WATCH_S, max(0.0, deadline - time.monotonic())))
                continue
            if version not in self.store.complete_versions():  # fetched, and pruned at once: it would be again
                raise Rejected("version_unavailable", f"version {version} is older than the versions kept here")

    async def judge_forever(self) -> None:
        while True:
            ack, trainer_peer = await self.jobs.get()
            try:
                verdict = await self.judge(await self._fetch(ack, trainer_peer), ack.full)
                assert self.gossip is not None
                await self.gossip.publish("verdicts", seal(self.identity, verdict))
            except Rejected as e:
                raise_if_cancelled()
                self.reject(e, trainer_peer)
            except (OSError, TimeoutError) as e:  # our daemon: the trainer judges it itself
                raise_if_cancelled()
                logger.warning("could not publish a verdict: %r", e)
            except Exception:  # a bug judging one batch must not end the loop: the trainer judges that one itself
                self.metrics.inc("node_validator_errors_total", help="batches this validator failed to judge")
                logger.exception("judging batch %s failed", ack.batch_sha256[:12])

    def _validator(self, spec: RunSpec, tokenizer: Any) -> Validator:
        model = build_model(spec.model, tokenizer).to(resolve_device(self.cfg.device))
        return Validator(spec, tokenizer, stored_in(model, DTYPES[spec.model.dtype]))  # half the memory, same forward

    async def work(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        assert self.follower is not None
        torch.set_num_threads(self.cfg.threads)
        tokenizer = build_tokenizer(spec.model)
        self.validator = self._validator(spec, tokenizer)
        assert self.gossip is not None
        self.gossip.subscribe("rollouts", self._on_announce)
        self.gossip.subscribe("verdicts", self._on_ack)
        worker = asyncio.ensure_future(self.judge_forever())
        try:
            while True:
                trainer = await self.trainer()
                if trainer is not None:
                    if await self.follow_epoch(trainer):  # started over: a new spec, new weights
                        assert self.spec is not None
                        spec = self.spec
                        async with self._lock:
                            tokenizer = build_tokenizer(spec.model)
                            self.validator = self._validator(spec, tokenizer)
                            self.loaded = -1
                if trainer is None or trainer.epoch != spec.epoch:
                    await asyncio.sleep(POLL_S)
                    continue
                self.trainer_at = (trainer.epoch, trainer.weight_version)
                if trainer.weight_version <= self.version:
                    await asyncio.sleep(POLL_S)
                    continue
                # the newest only: the children in this node's stripe wait for it, and walking through every
                # version a rollout may claim kept them 4-6 s behind after each burst of the trainer's versions
                # (the red team's swarm); judging fetches an older version when a batch claims it (_hold)
                try:
                    await self.follower.sync(trainer.weight_version)
                except (TimeoutError, Rejected, aiohttp.ClientError, OSError) as e:
                    self.metrics.inc("node_weights_fetch_failures_total", label=getattr(e, "reason", "network"))
                    self.fetch_failed(trainer.weight_version, repr(e))
                    await asyncio.sleep(POLL_S)
        finally:
            worker.cancel()
