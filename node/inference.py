"""The inference role: follow the newest signed policy, generate the assigned rollouts, deliver them.

Loop: read the trainer's record from the DHT; if it announces a newer version, download it (manifest signed by
the run key, every shard hash-checked), swap it in; derive the batch's tasks from (run seed, node id, version,
batch index); sample a group per task; sign the batch and send it to the trainer over libp2p. Generation runs
in a thread, so the node keeps answering /health and the DHT while it works. When the trainer reports a full
backlog, the node waits for the next version instead of producing rollouts that would go stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import torch

from intellect_node import __version__
from intellect_node.config import NodeConfig
from intellect_node.dht import Membership
from intellect_node.generate import sample_groups
from intellect_node.keys import load_or_create
from intellect_node.metrics import Metrics
from intellect_node.model import build_model, build_tokenizer, encode_prompt, load_weights
from intellect_node.runtime import announce
from intellect_node.status import HttpServer
from intellect_node.transport import submit
from intellect_node.weights import HTTP_TIMEOUT, fetch_checkpoint, load_checkpoint, prune
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.messages import NodeRecord, RolloutBatch, RolloutGroup, RunSpec
from intellect_protocol.tasks import assigned_task, assignment_seed

logger = logging.getLogger(__name__)
POLL_S = 0.25
"""How often to look for a new version while there is nothing to generate."""


class InferenceNode:
    def __init__(self, node: NodeConfig) -> None:
        if node.run_id is None:
            raise SystemExit("join needs --run-id: copy the whole line that `intellect-node bootstrap` printed")
        if not node.peers:
            raise SystemExit("join needs --peers <multiaddr>: copy the line that `intellect-node bootstrap` printed")
        self.cfg = node
        self.run_id: str = node.run_id
        self.identity = load_or_create(node.data_dir / "node.key")
        self.metrics = Metrics()
        self.membership = Membership(self.identity, self.run_id, self.metrics)
        self.weights_root = node.data_dir / "weights" / self.run_id
        self.http = HttpServer(self.metrics, self.status, None)
        self.spec: RunSpec | None = None
        self.version = -1
        self.batch_index = 0
        self.versions_loaded: list[int] = []
        self.batches_sent = 0
        self.batches_accepted = 0
        self.rejections: dict[str, int] = {}
        self.status_url = ""
        self.maddrs: list[str] = []

    def record(self) -> NodeRecord:
        return NodeRecord(
            run_id=self.run_id,
            node_id=self.identity.node_id,
            role="inference",
            p2p_maddrs=self.maddrs[:8],
            http_url=self.status_url,
            weight_version=self.version,
            updated=time.time(),
            software=f"intellect-node/{__version__}",
        )

    def status(self) -> dict[str, Any]:
        return {
            "role": "inference",
            "node_id": self.identity.node_id,
            "run_id": self.run_id,
            "weight_version": self.version,
            "versions_loaded": self.versions_loaded,
            "batches_sent": self.batches_sent,
            "batches_accepted": self.batches_accepted,
            "rejections": self.rejections,
        }

    async def _wait_for_spec(self) -> RunSpec:
        deadline = time.monotonic() + self.cfg.join_timeout_s
        while time.monotonic() < deadline:
            spec = await self.membership.get_spec()
            if spec is not None:
                return spec
            await asyncio.sleep(POLL_S)
        raise SystemExit(
            f"no run {self.run_id} found in the DHT within {self.cfg.join_timeout_s:.0f}s; check --run-id and "
            "--peers against the line the trainer printed, and that the trainer is still running"
        )

    async def _trainer(self) -> NodeRecord | None:
        record = (await self.membership.get_nodes()).get(self.run_id)
        return record if record is not None and record.role == "trainer" else None

    async def _update_weights(self, session: aiohttp.ClientSession, trainer: NodeRecord, model: Any) -> None:
        if trainer.weight_version == self.version or trainer.weight_version < 0 or not trainer.http_url:
            return
        if trainer.weight_version < self.version:
            logger.warning(
                "the trainer announces version %d, older than ours (%d): it restarted; following it",
                trainer.weight_version,
                self.version,
            )
        started = time.monotonic()
        manifest, folder = await fetch_checkpoint(
            session, trainer.http_url, self.run_id, trainer.weight_version, self.weights_root
        )
        tensors = await asyncio.to_thread(load_checkpoint, folder, manifest)
        await asyncio.to_thread(load_weights, model, tensors)
        self.version = manifest.version
        self.batch_index = 0
        self.versions_loaded.append(self.version)
        prune(self.weights_root, keep=1)
        self.metrics.inc("node_weights_bytes_downloaded_total", manifest.total_size)
        self.metrics.set("node_inference_weight_version", self.version)
        logger.info(
            "loaded version=%d bytes=%d seconds=%.2f", self.version, manifest.total_size, time.monotonic() - started
        )
        await self.membership.publish_record(self.record())

    def _generate(self, spec: RunSpec, model: Any, tokenizer: Any) -> RolloutBatch:
        n = spec.task.tasks_per_batch
        tasks = [
            assigned_task(spec.seed, self.identity.node_id, self.version, self.batch_index, s, spec.task.max_operand)
            for s in range(n)
        ]
        prompts = [encode_prompt(tokenizer, t.prompt) for t in tasks]
        generator = torch.Generator().manual_seed(
            assignment_seed(spec.seed, self.identity.node_id, self.version, self.batch_index, -1) % 2**63
        )
        groups = sample_groups(
            model,
            prompts,
            group_size=spec.sampling.group_size,
            max_new_tokens=spec.sampling.max_new_tokens,
            temperature=spec.sampling.temperature,
            eos_id=int(tokenizer.eos_token_id),
            pad_id=int(tokenizer.pad_token_id),
            generator=generator,
        )
        return RolloutBatch(
            run_id=self.run_id,
            node_id=self.identity.node_id,
            version=self.version,
            batch_index=self.batch_index,
            groups=[
                RolloutGroup(
                    slot=s,
                    prompt_ids=prompts[s],
                    completions=[c.tokens for c in group],
                    logprobs=[c.logprobs for c in group],
                )
                for s, group in enumerate(groups)
            ],
        )

    async def work_forever(self, spec: RunSpec, p2p: Any) -> None:
        tokenizer = build_tokenizer(spec.model)
        model = build_model(spec.model, tokenizer)
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
            paused_at: int | None = None  # the version at which the trainer said it had enough rollouts
            while True:
                trainer = await self._trainer()
                if trainer is None or not trainer.p2p_maddrs:
                    await asyncio.sleep(POLL_S)
                    continue
                try:
                    await self._update_weights(session, trainer, model)
                except (TimeoutError, Rejected, aiohttp.ClientError) as e:
                    self.metrics.inc("node_weights_fetch_failures_total", label=getattr(e, "reason", "network"))
                    logger.warning("could not fetch version %d: %s", trainer.weight_version, e)
                    await asyncio.sleep(POLL_S)
                    continue
                if paused_at is not None and self.version > paused_at:
                    paused_at = None
                if self.version < 0 or paused_at is not None:
                    await asyncio.sleep(POLL_S)
                    continue
                batch = await asyncio.to_thread(self._generate, spec, model, tokenizer)
                self.batch_index += 1
                peer_id = trainer.p2p_maddrs[0].rsplit("/p2p/", 1)[-1]
                try:
                    reply = await submit(p2p, peer_id, self.run_id, seal(self.identity, batch), self.run_id)
                except (TimeoutError, Rejected, OSError, asyncio.IncompleteReadError) as e:
                    self.metrics.inc("node_inference_submit_failures_total")
                    logger.warning("could not deliver batch version=%d: %r", batch.version, e)
                    continue
                self.batches_sent += 1
                self.metrics.inc("node_inference_batches_sent_total")
                if reply.ok:
                    self.batches_accepted += 1
                    if reply.backlog >= 2 * spec.train.batch_groups:
                        paused_at = self.version
                else:
                    self.rejections[reply.reason] = self.rejections.get(reply.reason, 0) + 1
                    self.metrics.inc("node_inference_batches_refused_total", label=reply.reason)
                    logger.warning("trainer refused batch reason=%s detail=%s", reply.reason, reply.detail)
                    if reply.reason in ("stale_version", "duplicate"):
                        paused_at = self.version

    async def run(self) -> None:
        try:
            port = await self.http.start(self.cfg.host, self.cfg.http_port)
            self.status_url = f"http://{self.cfg.host}:{port}"
            self.maddrs = await self.membership.start(self.cfg.host, self.cfg.p2p_port, self.cfg.peers)
            spec = self.spec = await self._wait_for_spec()
            torch.set_num_threads(self.cfg.threads)
            p2p = await self.membership.replicate_p2p()
            await self.membership.publish_record(self.record())
            announce(
                "inference",
                self.identity.node_id,
                self.run_id,
                {"p2p_maddrs": self.maddrs, "status_url": self.status_url},
            )
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.membership.republish_forever(self.record))
                tasks.create_task(self.work_forever(spec, p2p))
        finally:
            await self.http.close()
            await self.membership.close()
