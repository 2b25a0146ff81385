"""The trainer role: owns the run, verifies rollouts, trains with GRPO, publishes each new policy.

Invariants:
- A batch is queued only if it is signed by a node registered in the DHT for this run, its weight version is
  at least ``step - async_level``, it was not seen before, and its tasks are exactly the ones assigned to that
  node; everything else is rejected with a reason, counted and logged, and the node keeps running.
- Rewards are recomputed here from the completions; nothing the worker says about rewards is read.
- Step ``n`` turns version ``n`` into ``n + 1`` in a thread: inference never waits for training or publishing.

Parts: the door (``on_batch``: signature, registry, admission, capacity, header, contents, spool, here), the
judging pipeline (``self.judging``, trainer_validation.Judging: its own state, handed what it shares), the
learner (``train_forever``, ``_train_step``, ``_publish``, here), durability (trainer_checkpoint.Checkpoints) and
gossip (``self.gossip``, trainer_gossip.TrainerGossip: its own state, handed what it reads). What they share is
in ``self.shared`` (trainer_state.py). Durability is still a mixin of this class, reading its attributes.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from functools import partial
from typing import Any

import torch

from intellect_kernels.grpo import group_advantages, lr_factor
from intellect_node import __version__
from intellect_node.config import NodeConfig, RunConfig
from intellect_node.judging.tasks import require_jail
from intellect_node.judging.validator import Gate, Validator
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.http import EncodedList, HttpServer
from intellect_node.p2p.keys import load_or_create
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.reach import announced
from intellect_node.p2p.transport import Intake, RolloutServer, off_loop_if_large
from intellect_node.policy.engine import BatchKey, EngineFactory, Group, Packed, local_engine, pack_sequences
from intellect_node.policy.model import DTYPES, build_model, build_tokenizer, resolve_device, stored_in
from intellect_node.roles.admission import Admission, mint_invite
from intellect_node.roles.invites import InviteDoor
from intellect_node.roles.tracking import Tracker
from intellect_node.roles.trainer_checkpoint import CheckpointDir, Checkpoints, next_epoch
from intellect_node.roles.trainer_gossip import TrainerGossip
from intellect_node.roles.trainer_registry import NodeRegistry
from intellect_node.roles.trainer_state import InFlight, Ledger, RewardCurve, Shared, TrainQueue
from intellect_node.roles.trainer_validation import Judging
from intellect_node.runtime import announce, trim_freed
from intellect_node.weights.earned import Earned
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_node.weights.stripes import announced_home
from intellect_protocol.envelope import Rejected, decode_body, open_envelope
from intellect_protocol.identity import node_id_of
from intellect_protocol.messages import NodeRecord, RolloutBatch, RunSpec, SubmitReply

logger = logging.getLogger(__name__)
MAX_QUEUED_PER_NODE = 2
"""A node may have this many training steps' worth of rollout groups queued, or ``async_level`` steps' worth if
more: what the trainer can use before they go stale."""
MAX_PENDING_BATCHES = 64
"""Admitted batches waiting for a verdict, all nodes together; past this the trainer answers busy (producers
resend). Keys on probation share ``admission.probation_share`` of it."""


class Trainer(Checkpoints):
    def __init__(self, node: NodeConfig, run: RunConfig, make_engine: EngineFactory | None = None) -> None:
        self.cfg = node
        self.identity = load_or_create(node.data_dir / "node.key")
        self.run_id = self.identity.node_id
        self.spec = run.spec(self.run_id, created=time.time())
        self.metrics = Metrics()
        self.weights_root = node.data_dir / "weights" / self.run_id
        ckpt_root = node.data_dir / "checkpoints" / self.run_id
        if node.fresh:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        self.ckpt = CheckpointDir(ckpt_root)
        self.resumed: dict[str, Any] | None = self.ckpt.latest() if node.checkpoint_every else None
        if self.resumed is not None:
            saved = RunSpec.model_validate_json(self.resumed["spec"])
            same = {"created": 0.0, "epoch": 0}
            if saved.model_copy(update=same) != self.spec.model_copy(update=same):
                raise SystemExit(
                    f"{ckpt_root} holds run {self.run_id} at step {self.resumed['step']}, started with another run "
                    "config; give the same --config/--set to resume it, or --fresh to start the run over"
                )
            self.spec = saved
        else:  # a new run epoch: versions count from 0 again, and the epoch tells the swarm they are new weights
            self.spec = self.spec.model_copy(update={"epoch": next_epoch(node.data_dir / "epochs" / self.run_id)})
            shutil.rmtree(self.weights_root, ignore_errors=True)
            dropped = self.ckpt.drop_spools()
            if dropped:
                logger.warning(
                    "%d accepted batches of the run's previous start are dropped: the weights they "
                    "were made with are gone (--checkpoint-every > 0 resumes instead)",
                    dropped,
                )
            logger.info("run %s starts epoch %d", self.run_id, self.spec.epoch)
        require_jail(self.spec.task)  # before any peer's completion is scored
        self.store = WeightStore(self.weights_root, self.run_id, self.spec.epoch)
        limit = node.upload_limit_mbps * 1e6 / 8 if node.upload_limit_mbps else None
        self.origin = ShardServer(
            self.store,
            self.metrics,
            node.relay_slots or node.stripes,
            limit,
            node_id=self.run_id,
            members=self._is_member,
        )
        self.origin.path = lambda: [self.run_id]
        self.origin.stripes = node.stripes
        self.membership = Membership(self.identity, self.run_id, self.metrics)
        self.registry = NodeRegistry(self.membership)
        self.origin.home_of = lambda n: announced_home(self.registry.records, n)
        redemptions = node.data_dir / "admission" / f"{self.run_id}.json"  # kept across epochs and --fresh starts
        self.admission = Admission(self.spec.admission, self.run_id, redemptions, self.spec.epoch)
        # who comes first for the origin's slots: keys past probation, and the relays they hang below
        self.origin.earned = Earned(self._trusted, lambda: self.registry.records, self.run_id, lambda: self.spec.epoch)
        self.tokenizer = build_tokenizer(self.spec.model)
        self.engine = (make_engine or partial(local_engine, device=node.device))(self.spec, self.tokenizer)
        self.step = 0
        """Completed training steps: version ``step`` exists (published once ``published`` reaches it)."""
        self.published = -1
        """The newest version written, signed and announced."""
        self.gate = Gate(self.spec.train.async_level)
        # what the parts share (trainer_state.py): the door, the judging pipeline, the learner and durability
        self.shared = Shared(TrainQueue(), InFlight(), RewardCurve(), Ledger(self.spec.epoch, lambda: self.step))
        self.queue, self.inflight, self.ledger = self.shared.queue, self.shared.inflight, self.shared.ledger
        self.banned = self.shared.banned
        self.history: list[dict[str, Any]] = EncodedList()
        self.idle_s = 0.0
        self.maddrs: list[str] = []
        self.status_url = ""
        # Validation (node/judging/validator.py) on a second copy of the model holding the version a batch claims,
        # kept in the published dtype (policy/model.py stored_in)
        model = build_model(self.spec.model, self.tokenizer).to(resolve_device(node.device))
        model = stored_in(model, DTYPES[self.spec.model.dtype])
        self._store_lock = threading.Lock()
        self.judging = Judging(
            self.spec,
            node.validators,
            self.identity,
            self.metrics,
            self.registry,
            self.admission,
            self.store,
            self._store_lock,
            Validator(self.spec, self.tokenizer, model),
            self.tokenizer,
            self.shared,
            self._fresh_floor,
            self._acknowledge,
        )
        self.http = HttpServer(self.metrics, self.status, [*self.origin.routes(), self.judging.route()])
        self.p2p: Any = None
        self.intake = Intake()
        """Batch bodies on their way in, pushed or pulled: one budget for both."""
        self.envelopes: dict[BatchKey, bytes] = {}
        """Admitted batches that may still have groups to train: what a checkpoint keeps for a resume."""
        self._persisting: asyncio.Task[None] | None = None
        self.resume_info: dict[str, int] | None = None
        self.publish_s = 0.0
        """Seconds this trainer spent publishing versions (the step split)."""
        self.gossip = TrainerGossip(
            self.run_id,
            self.spec.epoch,
            self.identity,
            self.metrics,
            self.store,
            self.registry,
            self.admission,
            self.banned,
            self.intake,
            node.validators,
            self.judging.waits,
            self.on_batch,
            self._check_room,
        )
        where = node.track_dir or node.data_dir / "tracking"
        self.tracker = (
            None if node.track == "none" else Tracker(node.track, where, self.run_id, self.spec.model_dump(mode="json"))
        )
        self._shed_at = -1e9
        if self.resumed is not None:
            self._restore(self.resumed)

    # ---- peer boundary -------------------------------------------------------------------------------

    async def _is_member(self, node_id: str) -> bool:
        """Whether a node may hold one of the origin's relay slots: admitted, with a valid record in the run."""
        if node_id in self.banned:
            return False
        record = await self.registry.registered(node_id)
        if record is None:
            return False
        try:
            self.admission.check(record)
        except Rejected:
            return False
        return True

    def _trusted(self, node_id: str) -> bool:
        """Whether a key earned trust by itself: past probation (its batches passed), not banned. Such a key comes
        first for the origin's slots, and vouches for the relay it hangs below (weights/earned.py)."""
        return node_id not in self.banned and not self.admission.on_probation(node_id)

    def reject(self, e: Rejected, peer: str, node_id: str = "", next_index: int = -1) -> SubmitReply:
        self.metrics.inc("node_trainer_batches_rejected_total", label=e.reason, help="rollout batches refused")
        if node_id:
            self.shared.rejected_by_node[node_id] += 1
        logger.info("rejected batch peer=%s node=%s reason=%s detail=%s", peer, node_id or "?", e.reason, e.detail)
        return SubmitReply(
            ok=False, reason=e.reason, detail=e.detail[:500], trainer_step=self.step, next_index=next_index
        )

    def _acknowledge(self, batch: RolloutBatch, envelope: bytes, judges: list[str], full: bool) -> str:
        """The judging pipeline's acknowledgement of an admitted batch: gossip announces it (and serves it to the
        judges named); returns its digest."""
        return self.gossip.admitted(batch, envelope, judges, full)

    def _fresh_floor(self) -> int:
        return self.step - self.spec.train.async_level

    async def on_batch(self, data: bytes, peer: str) -> SubmitReply:
        node_id = ""
        batch: RolloutBatch | None = None
        try:
            signer, body = await off_loop_if_large(len(data), open_envelope, data, RolloutBatch)
            node_id = node_id_of(signer)
            record = await self.registry.registered(node_id)
            if record is None or record.role != "inference":
                node_id = ""  # do not keep per-node state for keys the run does not know
                raise Rejected("unknown_signer", "no inference record for this key in the run's DHT")
            if node_id in self.banned:
                raise Rejected("banned", f"this node was caught cheating ({self.banned[node_id]}) and is banned")
            self.admission.check(record)
            self._check_room(node_id)  # before decoding: a flood costs a signature check per submission
            self.shared.received_by_node[node_id] += 1
            batch = (await off_loop_if_large(len(body), decode_body, signer, body, RolloutBatch)).message
            if batch.run_id != self.run_id:
                raise Rejected("wrong_run", f"batch for run {batch.run_id}")
            if batch.node_id != node_id:
                raise Rejected("signer_mismatch", f"batch of {batch.node_id} signed by {node_id}")
            if batch.epoch != self.spec.epoch:
                raise Rejected(
                    "wrong_epoch",
                    f"made in run epoch {batch.epoch}; the run is at epoch {self.spec.epoch} "
                    "(it was started over): read the run spec again",
                )
            self.gate.check(batch, self.step, newest=self.published)
            queued = self.queue.by_node[node_id] + self.inflight.groups_by_node[node_id]
            if queued >= max(MAX_QUEUED_PER_NODE, self.spec.train.async_level) * self.spec.train.batch_groups:
                raise Rejected("backlog_full", "the trainer holds enough of this node's rollouts; wait for a version")
            # Reserved before the first await: the same batch on another stream, or this node's next one, is
            # refused until this one is admitted or refused (a duplicate check and an admission separated by an
            # await let one signed batch in 16 times).
            self.gate.reserve(batch)
            try:
                slots = await off_loop_if_large(len(body), self.judging.check_contents, batch)
            except Rejected:
                self.gate.release(batch)
                raise
            except Exception as e:  # a completion our scoring cannot take (say, an integer of 5,000 digits)
                self.gate.release(batch)
                logger.info("could not check batch node=%s: %r", node_id, e)
                raise Rejected("unscorable", f"{type(e).__name__}: {str(e)[:200]}") from None
        except Rejected as e:
            expected = -1
            if batch is not None and e.reason in ("duplicate", "out_of_order"):
                expected = self.gate.next_index.get((batch.node_id, batch.version), 0)
            return self.reject(e, peer, node_id, expected)
        if self.cfg.checkpoint_every:  # durable (fsynced) before the reply: it survives a crash of the trainer
            try:
                try:
                    written = await asyncio.to_thread(self.ckpt.append, data)
                except OSError:
                    await asyncio.to_thread(self._shed_disk)
                    written = await asyncio.to_thread(self.ckpt.append, data)
                while written != self.ckpt.spool_step:  # a checkpoint was taken meanwhile, without this batch
                    written = await asyncio.to_thread(self.ckpt.append, data)
            except OSError as e:  # disk full, out of file handles: nothing accepted, the producer sends it again
                self.gate.release(batch)
                self.metrics.inc("node_trainer_spool_failures_total", help="accepted batches that could not be spooled")
                logger.error("cannot spool batch node=%s: %r; free disk space under %s", node_id, e, self.ckpt.root)
                return self.reject(
                    Rejected("busy", "the trainer cannot store batches right now; send again"), peer, node_id
                )
        self.gate.admit(batch)
        key = (node_id, batch.version, batch.batch_index)
        self.envelopes[key] = data
        self.inflight.add(key, len(slots))
        self.judging.dispatch(batch, slots, data)
        self.metrics.set("node_trainer_batches_pending_validation", self.judging.pending.qsize())
        self.ledger("acked", key, len(slots))
        return SubmitReply(ok=True, accepted_groups=len(slots), trainer_step=self.step, backlog=self._backlog())

    def _check_room(self, node_id: str) -> None:
        """Bounded, fair work before anything is decoded: for keys on probation together, and for everybody (the
        per-node backlog is checked after the header, so that a stale batch is told it is stale)."""
        a = self.spec.admission
        newcomer_slots = max(1, int(a.probation_share * MAX_PENDING_BATCHES))
        newcomers = self.inflight.count(self.admission.on_probation)
        if self.admission.on_probation(node_id):
            mine = self.inflight.of(node_id)
            if mine >= a.probation_pending:
                raise Rejected(
                    "busy",
                    f"a new node may have {a.probation_pending} batch(es) judged at once until "
                    f"{a.probation_batches} passed",
                )
            if newcomers >= newcomer_slots:
                raise Rejected("busy", "the trainer is judging many new nodes' batches; send again shortly")
        elif len(self.inflight) - newcomers >= MAX_PENDING_BATCHES - newcomer_slots:
            # trusted nodes together leave the newcomers' share free: a busy swarm still lets new nodes in
            raise Rejected("busy", "the trainer has many batches to judge; send again shortly")

    def _backlog(self) -> int:
        """Validated groups that will be trained (fresh, past the filter): a producer that pauses on this number
        cannot stall the run, since they are enough for a step and a step publishes the version it waits for.
        (Counting groups still being validated deadlocked small runs: the filter then dropped most of them.)"""
        return self.queue.fresh(self._fresh_floor())

    # ---- training ------------------------------------------------------------------------------------

    def _take_batch(self) -> list[Group] | None:
        floor = self._fresh_floor()
        batch, stale = self.queue.take(self.spec.train.batch_groups, floor)
        if stale:
            self.metrics.inc("node_trainer_groups_stale_dropped_total", len(stale))
            for g in stale:
                self.ledger("stale", g.key, 1)
        self.gate.forget_before(floor)
        return batch

    def _train_step(self, groups: list[Group]) -> dict[str, float]:
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        ids, attn, mask, logp_old = pack_sequences(groups, int(self.tokenizer.pad_token_id))
        t = self.spec.train
        lr = t.lr * lr_factor(self.step, t.warmup_steps, t.decay_steps, t.min_lr_ratio)
        skipped = self.engine.skipped
        stats = self.engine.step(Packed(ids, attn, mask, logp_old, group_advantages(rewards).flatten()), lr)
        trim_freed()
        if self.engine.skipped > skipped:  # never publish weights a bad batch turned into NaN
            self.metrics.inc(
                "node_trainer_steps_skipped_total",
                self.engine.skipped - skipped,
                label="nonfinite_gradient",
                help="optimizer steps skipped",
            )
        seen = self.shared.curve.drain()  # every rollout accepted since the last step
        return {
            **stats,
            "reward_mean": sum(seen) / len(seen) if seen else float(rewards.mean()),
            "accuracy": sum(r == 1.0 for r in seen) / len(seen) if seen else float((rewards == 1.0).float().mean()),
            "batch_reward_mean": float(rewards.mean()),
        }

    def _publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        write = partial(
            write_checkpoint,
            self.weights_root,
            self.identity,
            self.run_id,
            version,
            tensors,
            self.cfg.shard_bytes,
            epoch=self.spec.epoch,
        )
        try:
            write()
        except Exception:  # most often a full disk: shed old versions and checkpoints, then once more
            shutil.rmtree(self.weights_root / f"{version}.partial", ignore_errors=True)
            self._shed_disk()
            write()
        keep = self.cfg.keep_versions or self.spec.train.async_level + 1
        if self.ckpt.keep == 1:  # the disk was full: the newest two (the validator may still need the older)
            keep = min(keep, 2)
        with self._store_lock:
            self.store.prune(keep, int(self.cfg.max_disk_gb * 1e9) if self.cfg.max_disk_gb else None)

    def record(self) -> NodeRecord:
        return NodeRecord(
            run_id=self.run_id,
            node_id=self.identity.node_id,
            role="trainer",
            p2p_maddrs=self.maddrs[:8],
            http_url=self.status_url,
            weight_version=max(self.published, 0),
            epoch=self.spec.epoch,
            updated=time.time(),
            software=f"intellect-node/{__version__}",
            relay=self.origin.origin_info(self.registry.records, self.store.complete_versions(), self.cfg.relay_slots),
        )

    async def train_forever(self) -> None:
        max_steps = self.cfg.max_steps
        every = self.cfg.checkpoint_every
        while max_steps is None or self.step < max_steps:
            waited = time.monotonic()
            while (groups := self._take_batch()) is None:
                self.queue.changed.clear()
                await self.queue.changed.wait()
            idle = time.monotonic() - waited
            self.idle_s += idle
            started, split = time.monotonic(), (self.judging.validate_s, self.publish_s)
            stats = await asyncio.to_thread(self._train_step, groups)
            for g in groups:  # logged with the step they went into (step + 1 once it is counted below)
                self.ledger("trained", g.key, 1)
            versions = [g.version for g in groups]
            due = bool(every) and (self.step + 1) % every == 0
            tensors, engine_state = await asyncio.to_thread(self._snapshot, due)
            self.step += 1
            stats.update(
                step=self.step,
                seconds=time.monotonic() - started,
                idle_s=idle,
                validate_s=self.judging.validate_s - split[0],  # judging batches here meanwhile (on its own thread)
                publish_s=self.publish_s - split[1],  # the previous version's checkpoint and publication
                time=time.time(),
                staleness_max=float(self.step - 1 - min(versions)),
                staleness_mean=float(sum(self.step - 1 - v for v in versions) / len(versions)),
            )
            self.history.append(stats)
            if self.tracker is not None:
                self.tracker.log(self.step, stats)
            meta = None
            if engine_state is not None:
                try:  # batches accepted from now on go to the next spool; if it cannot be made, no checkpoint now
                    self.ckpt.start_spool(self.step)
                    meta = {**self._checkpoint_meta(), "engine": engine_state}
                except OSError as e:
                    self.metrics.inc("node_trainer_persist_failures_total", label="spool")
                    logger.error("cannot start a new spool (%r): checkpoint %d skipped", e, self.step)
            previous = self._persisting
            if previous is not None:  # versions go out in order; the step above did not wait for this
                await previous
            self._persisting = asyncio.create_task(self._persist(self.step, tensors, meta))
            self.metrics.inc("node_trainer_steps_total")
            self.metrics.observe("node_trainer_step_seconds", stats["seconds"], help="a training step and snapshot")
            self.metrics.set("node_trainer_step", self.step)
            self.metrics.set("node_trainer_reward_mean", stats["reward_mean"])
            self.metrics.set("node_trainer_idle_seconds", self.idle_s, help="time the trainer waited for rollouts")
            self.metrics.set(
                "node_trainer_staleness_max",
                stats["staleness_max"],
                help="steps from a trained rollout's policy to its step (last step's max)",
            )
            self.metrics.set("node_trainer_staleness_mean", stats["staleness_mean"])
            logger.info(
                "step=%d reward_mean=%.3f accuracy=%.3f loss=%.4f staleness_max=%d groups=%d seconds=%.2f idle=%.2f",
                self.step,
                stats["reward_mean"],
                stats["accuracy"],
                stats["loss"],
                stats["staleness_max"],
                len(groups),
                stats["seconds"],
                idle,
            )
            print(f"STEP {self.step} reward_mean={stats['reward_mean']:.3f}", flush=True)
        if self._persisting is not None:
            await self._persisting
        logger.info("reached max_steps=%s; still serving weights and status until stopped", max_steps)
        await asyncio.Event().wait()

    def status(self) -> dict[str, Any]:
        return {
            "role": "trainer",
            "node_id": self.identity.node_id,
            "run_id": self.run_id,
            "epoch": self.spec.epoch,
            "step": self.step,
            "weight_version": self.published,
            "max_steps": self.cfg.max_steps,
            "queue_groups": len(self.queue),
            "idle_s": round(self.idle_s, 3),
            "received_batches_by_node": dict(self.shared.received_by_node),
            "accepted_groups_by_node": dict(self.shared.accepted_by_node),
            "rejected_batches_by_node": dict(self.shared.rejected_by_node),
            "by_node_others": {
                "received": self.shared.received_by_node.others,
                "accepted": self.shared.accepted_by_node.others,
                "rejected": self.shared.rejected_by_node.others,
            },
            "rejected_batches_by_reason": self.metrics.by_label("node_trainer_batches_rejected_total"),
            "validation_failures_by_reason": self.metrics.by_label("node_validator_rejected_total"),
            "banned": self.banned,
            "validators_missing": self.judging.validators_missing,
            "verdicts_ok": int(self.metrics.counter("node_validator_accepted_total")),
            "pending_validation": self.judging.pending.qsize(),
            "judging": len(self.inflight),  # admitted, verdict not yet applied (here or by validators)
            "versions_held": self.store.complete_versions(),
            "relay": {
                "enabled": True,
                "depth": 0,
                "parent": None,
                "children": self.origin.children(),
                "slots_free": self.origin.slots_free(),
                "fetching": -1,
                "fetching_verified_shards": 0,
                "bans": self.metrics.counter("node_relay_bans_total"),
                "bytes_received": 0,
                "bytes_sent": self.metrics.counter("node_relay_bytes_sent_total"),
            },
            "peers": len(self.registry.records),  # nodes with a record in the run, as last read
            "validators_present": self.judging.validators_present,
            "awaiting_verdicts": len(self.judging.waits),
            "verdicts_remote": int(self.metrics.counter("node_trainer_remote_verdicts_total")),
            "verdicts_self": int(self.metrics.counter("node_trainer_self_verdicts_total")),
            **self.gossip.status(),
            "outstanding_groups": len(self.queue) + self.inflight.groups(),
            "resumed": self.resume_info,
            "history": self.history,
        }

    # ---- lifecycle -----------------------------------------------------------------------------------

    def _invite_arg(self) -> str:
        """An invite-only run's join line carries a fresh invite (``--invite-uses`` nodes, ``--invite-days``)."""
        if self.spec.admission.policy != "invite":
            return ""
        return f" --invite {mint_invite(self.identity, self.cfg.invite_uses, self.cfg.invite_days)}"

    async def run(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        await self._publish_current()
        if self.cfg.checkpoint_every:  # without checkpoints there is no resume, and nothing to spool for one
            self.ckpt.start_spool(self.step)
        self._replay(self.resumed)
        self.resumed = None  # the engine state in it is no longer needed
        server: RolloutServer | None = None
        invites: InviteDoor | None = None
        try:
            self.maddrs = await self._join_dht()  # first: the DHT process must not inherit a listening socket
            port = await self.http.start(self.cfg.host, self.cfg.http_port)
            self.maddrs, self.status_url = announced(self.cfg.host, self.cfg.announce, self.maddrs, port)
            (self.cfg.data_dir / "http.url").write_text(f"http://127.0.0.1:{port}\n")  # for `intellect-node status`
            p2p = self.p2p = await self.membership.replicate_p2p()
            server = RolloutServer(p2p, self.identity, self.run_id, self.on_batch, self.reject, intake=self.intake)
            await server.start()
            invites = InviteDoor(p2p, self.identity, self.run_id, self.admission, self.metrics)
            await invites.start()
            await self.gossip.start(p2p)
            if not (
                await self.membership.publish_spec(self.spec) and await self.membership.publish_record(self.record())
            ):
                raise RuntimeError("the DHT refused the run spec or the trainer's record; see the DHT logs")
            peers = " ".join(f"--peers {m}" for m in self.maddrs[:1])
            announce(
                "trainer",
                self.identity.node_id,
                self.run_id,
                {
                    "p2p_maddrs": self.maddrs,
                    "status_url": self.status_url,
                    "join": f"intellect-node join --role inference {peers} --run-id {self.run_id}{self._invite_arg()}",
                },
            )
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.membership.republish_forever(self.record, self.spec))
                tasks.create_task(self.registry.refresh_forever())
                tasks.create_task(self.train_forever())
                tasks.create_task(self.judging.validate_forever())
                tasks.create_task(self.judging.watch_validators())
                tasks.create_task(self.gossip.repeat_notices(self.published))
        finally:
            await self.gossip.stop()
            if self.tracker is not None:
                self.tracker.close()
            if server is not None:
                await server.close()
            if invites is not None:
                await invites.close()
            await self.http.close()
            await self.membership.close()
            self.ckpt.close()
            self.engine.close()
            self.judging.close()
