"""The validator role: judge rollout batches as the trainer admits them, in parallel, and gossip signed verdicts.

``intellect-node join --role validator --peers ... --run-id ...`` follows the run's weights like any node (and
relays them) and keeps the last ``async_level + 1`` versions. It listens on the run's gossip topics: producers'
announcements tell it who holds each batch, and the trainer's acknowledgement of an admitted batch (signed by the
run key) names the validators asked to judge it. A named validator fetches the body by digest (from the
producer, else from the trainer; node/p2p/batches.py), checks it on the exact version it claims
(node/judging/validator.py) and publishes a signed Verdict on the ``verdicts`` topic. The trainer counts verdicts
only from validators it was started with (``intellect-node bootstrap --validator <node id>``) and judges a batch
itself when the named ones do not answer within ``verify.verdict_wait_s``.

Work it takes on: only batches the run key acknowledged and named it for, ``JOBS`` queued at most (the oldest
dropped: the trainer judges those itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import aiohttp
import torch

from intellect_node.aio import raise_if_cancelled
from intellect_node.judging.validator import Validator
from intellect_node.p2p.batches import fetch_batch
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
WATCH_S = 0.5
JOBS = 256
HOLDERS = 4096


class ValidatorNode(Volunteer):
    role: Role = "validator"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.validator: Validator | None = None
        self.loaded = -1
        self._lock = asyncio.Lock()
        self.judged = 0
        self.refused = 0
        self.holders: OrderedDict[str, str] = OrderedDict()
        """Batch digest -> the peer that announced it (its producer), the newest HOLDERS."""
        self.seen: OrderedDict[str, bool] = OrderedDict()
        self.jobs: asyncio.Queue[tuple[BatchAck, str]] = asyncio.Queue(JOBS)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "loaded_version": self.loaded, "judged": self.judged, "refused": self.refused}

    def reject(self, e: Rejected, peer: str) -> SubmitReply:
        self.refused += 1
        self.metrics.inc("node_validator_requests_refused_total", label=e.reason)
        logger.info("refused validation request peer=%s reason=%s detail=%s", peer, e.reason, e.detail)
        return SubmitReply(ok=False, reason=e.reason, detail=e.detail[:500])

    def _judge(self, batch: RolloutBatch, data: bytes, full: bool = False) -> Verdict:
        assert self.validator is not None
        if self.loaded != batch.version:
            manifest = self.store.manifest(batch.version)
            if manifest is None or batch.version not in self.store.complete_versions():
                raise Rejected("version_unavailable", f"version {batch.version} is not held here")
            load_weights(self.validator.model, load_checkpoint(self.store.folder(batch.version), manifest))
            self.loaded = batch.version
        try:
            return self.validator.check(batch, full=full).verdict(batch, data)
        finally:
            trim_freed()

    async def _on_announce(self, data: bytes, peer: str) -> None:
        """Who holds which batch: the producer's peer, to fetch the body from when we are asked to judge it."""
        signed = open_signed(data, BatchAnnounce)
        if signed.signer_id != signed.message.node_id or signed.message.run_id != self.run_id:
            raise Rejected("signer_mismatch", "an announcement of another node's batch")
        self.holders[signed.message.batch_sha256] = peer
        while len(self.holders) > HOLDERS:
            self.holders.popitem(last=False)

    async def _on_ack(self, data: bytes, peer: str) -> None:
        if kind_of(data, LIMITS["verdicts"]) != BatchAck.KIND:
            return  # a verdict (ours or another validator's)
        signed = open_signed(data, BatchAck)
        ack = signed.message
        if signed.signer_id != self.run_id or ack.run_id != self.run_id:
            raise Rejected("foreign_ack", f"an acknowledgement signed by {signed.signer_id}")
        if self.identity.node_id not in ack.judges or ack.batch_sha256 in self.seen:
            return
        self.seen[ack.batch_sha256] = True
        while len(self.seen) > HOLDERS:
            self.seen.popitem(last=False)
        if self.jobs.full():
            self.jobs.get_nowait()
            self.metrics.inc("node_validator_jobs_dropped_total", help="judging requests dropped: too many queued")
        self.jobs.put_nowait((ack, peer))

    async def _fetch(self, ack: BatchAck, trainer_peer: str) -> bytes:
        assert self.p2p is not None
        for peer in dict.fromkeys(p for p in (self.holders.get(ack.batch_sha256), trainer_peer) if p):
            try:
                body = await fetch_batch(self.p2p, self.identity, self.run_id, peer, ack.batch_sha256)
            except (ConnectionError, TimeoutError, Rejected) as e:
                self.metrics.inc("node_validator_fetch_failures_total", label=getattr(e, "reason", "unreachable"))
                logger.debug("could not fetch batch %s from %s: %r", ack.batch_sha256[:12], peer, e)
                continue
            if body is not None:
                return body
        raise Rejected("unavailable", f"nobody served batch {ack.batch_sha256[:12]}")

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
        deadline = time.monotonic() + 30.0
        while batch.version not in self.store.complete_versions() and time.monotonic() < deadline:
            if batch.version < min(self.store.complete_versions(), default=-1):
                break  # pruned: it will not come back
            await asyncio.sleep(WATCH_S)  # the version may still be on its way down the tree
        async with self._lock:  # one model, one batch at a time
            started = time.monotonic()
            verdict = await asyncio.to_thread(self._judge, batch, data, full)
        self.judged += 1
        self.metrics.inc("node_validator_batches_total", label="ok" if verdict.ok else verdict.reason)
        self.metrics.inc("node_validator_seconds_total", time.monotonic() - started)
        self.metrics.observe("node_validation_seconds", time.monotonic() - started, help="a batch judged")
        logger.info("verdict node=%s version=%d batch=%d ok=%s reason=%s", batch.node_id, batch.version,
                    batch.batch_index, verdict.ok, verdict.reason)  # fmt: skip
        return verdict

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
                newest = max(self.store.complete_versions(), default=-1)
                if trainer is None or trainer.epoch != spec.epoch or trainer.weight_version <= newest:
                    await asyncio.sleep(POLL_S)
                    continue
                # every version rollouts may still claim, not only the newest (relays keep that many)
                first = max(newest + 1, trainer.weight_version - spec.train.async_level)
                for version in range(first, trainer.weight_version + 1):
                    try:
                        await self.follower.sync(version)
                    except (TimeoutError, Rejected, aiohttp.ClientError, OSError) as e:
                        self.metrics.inc("node_weights_fetch_failures_total", label=getattr(e, "reason", "network"))
                        logger.warning("could not fetch version %d: %r", version, e)
                        await asyncio.sleep(POLL_S)
        finally:
            worker.cancel()
