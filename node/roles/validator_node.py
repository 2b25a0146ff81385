"""The validator role: judge rollout batches for the trainer and sign the verdicts.

``intellect-node join --role validator --peers ... --run-id ...`` follows the run's weights like any node (and
relays them), keeps the last ``async_level + 1`` versions, and answers the trainer on
``intellect-node/<run>/validate/v1``: the producer's signed batch in, a signed Verdict out (node/judging/validator.py
does the checking on the exact version the batch claims). The trainer takes verdicts only from validators it
was started with (``intellect-node bootstrap --validator <node id>``) and validates itself when none answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import torch

from intellect_node.judging.validator import Validator
from intellect_node.p2p.transport import RolloutServer, off_loop_if_large, validate_protocol
from intellect_node.policy.model import build_model, build_tokenizer, load_weights, resolve_device
from intellect_node.roles.volunteer import POLL_S, Volunteer
from intellect_node.weights.files import load_checkpoint
from intellect_protocol.envelope import Rejected, decode_body, open_envelope
from intellect_protocol.identity import node_id_of
from intellect_protocol.messages import Role, RolloutBatch, RunSpec, SubmitReply, Verdict

logger = logging.getLogger(__name__)
WATCH_S = 0.5


class ValidatorNode(Volunteer):
    role: Role = "validator"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.validator: Validator | None = None
        self.loaded = -1
        self._lock = asyncio.Lock()
        self.judged = 0
        self.refused = 0
        self.trainer_peers: set[str] = set()
        """libp2p peer ids of the run's trainer (from its signed record): the only peer it judges for."""

    def status(self) -> dict[str, Any]:
        return {**super().status(), "loaded_version": self.loaded, "judged": self.judged, "refused": self.refused}

    def reject(self, e: Rejected, peer: str) -> SubmitReply:
        self.refused += 1
        self.metrics.inc("node_validator_requests_refused_total", label=e.reason)
        logger.info("refused validation request peer=%s reason=%s detail=%s", peer, e.reason, e.detail)
        return SubmitReply(ok=False, reason=e.reason, detail=e.detail[:500])

    def _judge(self, batch: RolloutBatch, data: bytes) -> Verdict:
        assert self.validator is not None
        if self.loaded != batch.version:
            manifest = self.store.manifest(batch.version)
            if manifest is None or batch.version not in self.store.complete_versions():
                raise Rejected("version_unavailable", f"version {batch.version} is not held here")
            load_weights(self.validator.model, load_checkpoint(self.store.folder(batch.version), manifest))
            self.loaded = batch.version
        return self.validator.check(batch).verdict(batch, data)

    async def on_request(self, data: bytes, peer: str) -> Verdict | SubmitReply:
        try:
            if peer not in self.trainer_peers:
                raise Rejected("not_trainer", "this validator judges batches for the run's trainer only")
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
                verdict = await asyncio.to_thread(self._judge, batch, data)
        except Rejected as e:
            return self.reject(e, peer)
        self.judged += 1
        self.metrics.inc("node_validator_batches_total", label="ok" if verdict.ok else verdict.reason)
        self.metrics.inc("node_validator_seconds_total", time.monotonic() - started)
        logger.info("verdict node=%s version=%d batch=%d ok=%s reason=%s", batch.node_id, batch.version,
                    batch.batch_index, verdict.ok, verdict.reason)  # fmt: skip
        return verdict

    def _validator(self, spec: RunSpec, tokenizer: Any) -> Validator:
        return Validator(spec, tokenizer, build_model(spec.model, tokenizer).to(resolve_device(self.cfg.device)))

    async def work(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        assert self.follower is not None
        torch.set_num_threads(self.cfg.threads)
        tokenizer = build_tokenizer(spec.model)
        self.validator = self._validator(spec, tokenizer)
        p2p = await self.membership.replicate_p2p()
        server = RolloutServer(
            p2p, self.identity, self.run_id, self.on_request, self.reject, protocol=validate_protocol
        )  # fmt: skip
        await server.start()
        try:
            while True:
                trainer = await self.trainer()
                if trainer is not None:
                    self.trainer_peers = {m.rsplit("/p2p/", 1)[-1] for m in trainer.p2p_maddrs if "/p2p/" in m}
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
            await server.close()
