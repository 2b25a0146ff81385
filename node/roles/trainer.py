"""The trainer role: owns the run, verifies rollouts, trains with GRPO, publishes each new policy.

Invariants:
- A batch is queued only if it is signed by a node registered in the DHT for this run, its weight version is
  at least ``step - async_level``, it was not seen before, and its tasks are exactly the ones assigned to that
  node; everything else is rejected with a reason, counted and logged, and the node keeps running.
- Rewards are recomputed here from the completions; nothing the worker says about rewards is read.
- Step ``n`` turns version ``n`` into ``n + 1`` in a thread: inference never waits for training or publishing.

The trainer is a thin wiring of parts, each with its own state and a small interface, none of which knows the
trainer: the door (trainer_door.Door: every batch's checks, cheapest first, and the spool before the reply), the
judging pipeline (trainer_validation.Judging), the learner (trainer_learner.Learner: GRPO steps), durability
(trainer_checkpoint.Durability: checkpoints, the spool, each version's contribution-ledger entry
(trainer_ledger.py), publishing versions in order) and gossip (trainer_gossip.TrainerGossip). Batches come in
through the run's rollout source (node/p2p/rollouts), which hands each to the door. What they share is
``self.shared`` (trainer_state.py). The trainer builds them, assembles a checkpoint from their states and hands a
resumed one back, and serves /status, /ledger, /audit (trainer_audit.py: what an auditor replays a step from) and
its DHT record (with the ledger's head).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from intellect_node import __version__
from intellect_node.config import NodeConfig, RunConfig
from intellect_node.judging.tasks import require_jail
from intellect_node.judging.validator import Gate, Validator
from intellect_node.p2p.dht import Membership
from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.keys import load_or_create
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.reach import announced
from intellect_node.p2p.rollouts import Endpoint, Receiver, RolloutSource, make_source
from intellect_node.p2p.transport import Intake
from intellect_node.policy.engine import EngineFactory, local_engine
from intellect_node.policy.model import DTYPES, build_model, build_tokenizer, resolve_device, stored_in
from intellect_node.roles.admission import Admission, mint_invite
from intellect_node.roles.invites import InviteDoor
from intellect_node.roles.tracking import Tracker
from intellect_node.roles.trainer_audit import AuditRoutes
from intellect_node.roles.trainer_checkpoint import CheckpointDir, Durability, next_epoch
from intellect_node.roles.trainer_door import Door
from intellect_node.roles.trainer_gossip import TrainerGossip
from intellect_node.roles.trainer_learner import Learner
from intellect_node.roles.trainer_ledger import LedgerRoutes, open_ledger
from intellect_node.roles.trainer_registry import NodeRegistry
from intellect_node.roles.trainer_state import InFlight, Ledger, Progress, RewardCurve, Shared, TrainQueue
from intellect_node.roles.trainer_validation import Judging
from intellect_node.runtime import announce
from intellect_node.weights.earned import Earned
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_node.weights.stripes import announced_home
from intellect_protocol.envelope import Rejected
from intellect_protocol.ledger import train_hash
from intellect_protocol.messages import LedgerHead, NodeRecord, RunSpec

logger = logging.getLogger(__name__)
WAITING_S = 60.0
"""A trainer that took no step for this long says it waits for rollouts (``Trainer.state``)."""


class Trainer:
    def __init__(self, node: NodeConfig, run: RunConfig, make_engine: EngineFactory | None = None) -> None:
        self.cfg = node
        self.identity = load_or_create(node.data_dir / "node.key")
        self.run_id = self.identity.node_id
        self.spec = run.spec(self.run_id, created=time.time())
        self.metrics = Metrics()
        weights_root = node.data_dir / "weights" / self.run_id
        ckpt_root = node.data_dir / "checkpoints" / self.run_id
        if node.fresh:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        ckpt = CheckpointDir(ckpt_root)
        resumed: dict[str, Any] | None = ckpt.latest() if node.checkpoint_every else None
        if resumed is not None:
            saved = RunSpec.model_validate_json(resumed["spec"])
            same = {"created": 0.0, "epoch": 0}
            if saved.model_copy(update=same) != self.spec.model_copy(update=same):
                raise SystemExit(
                    f"{ckpt_root} holds run {self.run_id} at step {resumed['step']}, started with another run "
                    "config; give the same --config/--set to resume it, or --fresh to start the run over"
                )
            self.spec = saved
        else:  # a new run epoch: versions count from 0 again, and the epoch tells the swarm they are new weights
            self.spec = self.spec.model_copy(update={"epoch": next_epoch(node.data_dir / "epochs" / self.run_id)})
            shutil.rmtree(weights_root, ignore_errors=True)
            dropped = ckpt.drop_spools()
            if dropped:
                logger.warning(
                    "%d accepted batches of the run's previous start are dropped: the weights they "
                    "were made with are gone (--checkpoint-every > 0 resumes instead)",
                    dropped,
                )
            logger.info("run %s starts epoch %d", self.run_id, self.spec.epoch)
        require_jail(self.spec.task)  # before any peer's completion is scored
        spec = self.spec
        self.store = WeightStore(weights_root, self.run_id, spec.epoch)
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
        self.admission = Admission(spec.admission, self.run_id, redemptions, spec.epoch)
        # who comes first for the origin's slots: keys past probation, and the relays they hang below
        self.origin.earned = Earned(self._trusted, lambda: self.registry.records, self.run_id, lambda: spec.epoch)
        self.tokenizer = build_tokenizer(spec.model)
        engine = (make_engine or partial(local_engine, device=node.device))(spec, self.tokenizer)
        self.gate = Gate(spec.train.async_level)
        # what the parts share (trainer_state.py)
        self.progress = progress = Progress()
        ledger = Ledger(spec.epoch, lambda: progress.step)
        self.shared = Shared(TrainQueue(), InFlight(), RewardCurve(), ledger, progress)
        self.banned = self.shared.banned
        self.maddrs: list[str] = []
        self.status_url = ""
        self._saved_peers: list[str] = []
        self.resume_info: dict[str, int] | None = None
        # Validation (node/judging/validator.py) on a second copy of the model holding the version a batch claims,
        # kept in the published dtype (policy/model.py stored_in)
        model = build_model(spec.model, self.tokenizer).to(resolve_device(node.device))
        model = stored_in(model, DTYPES[spec.model.dtype])
        store_lock = threading.Lock()
        self.gossip: TrainerGossip  # made below: it takes the door, which takes the judging pipeline
        self.judging = Judging(
            spec,
            node.validators,
            self.identity,
            self.metrics,
            self.registry,
            self.admission,
            self.store,
            store_lock,
            Validator(spec, self.tokenizer, model),
            self.tokenizer,
            self.shared,
            self._fresh_floor,
            lambda batch, envelope, judges, full: self.gossip.admitted(batch, envelope, judges, full),
        )
        self.durability = Durability(
            node,
            self.identity,
            spec.epoch,
            spec.train.async_level,
            ckpt,
            self.store,
            store_lock,
            self.metrics,
            self.progress,
            self._announce_version,
            train_hash(spec.train),
        )
        self.door = Door(
            spec,
            self.metrics,
            self.registry,
            self.admission,
            self.gate,
            self.shared,
            self.judging,
            self.durability.spool,
            self._fresh_floor,
        )
        self.intake = Intake()
        """Batch bodies on their way in, pushed or pulled: one budget for both."""
        self.gossip = TrainerGossip(
            self.run_id,
            spec.epoch,
            self.identity,
            self.metrics,
            self.store,
            self.registry,
            self.admission,
            self.banned,
            node.validators,
            self.judging.waits,
            self.door.check_announced,
        )
        where = node.track_dir or node.data_dir / "tracking"
        tracker = None
        if node.track != "none":
            tracker = Tracker(node.track, where, self.run_id, spec.model_dump(mode="json"))
        self.learner = Learner(
            spec,
            engine,
            int(self.tokenizer.pad_token_id),
            self.metrics,
            self.shared,
            self.gate,
            self.durability,
            self._fresh_floor,
            self._checkpoint_meta,
            lambda: self.judging.validate_s,
            node.max_steps,
            node.checkpoint_every,
            tracker,
        )
        self.ledger_routes = LedgerRoutes(self.run_id)
        self.audit_routes = AuditRoutes(self.run_id, lambda: spec.epoch, ckpt.root, self._may_audit, self.metrics)
        self.http = HttpServer(
            self.metrics,
            self.status,
            [
                *self.origin.routes(),
                self.judging.route(),
                *self.ledger_routes.routes(),
                *self.audit_routes.routes(),
            ],
        )
        self.p2p: Any = None
        self._resumed = resumed
        if resumed is not None:
            self._restore(resumed)

    # ---- peer boundary -------------------------------------------------------------------------------

    async def _is_member(self, node_id: str) -> bool:
        """Whether a node may hold one of the origin's relay slots: admitted, with a valid record in the run (an
        unknown key waits for a read: it asks again)."""
        if node_id in self.banned:
            return False
        record = await self.registry.registered(node_id, patient=True)
        if record is None:
            return False
        try:
            self.admission.check(record)
        except Rejected:
            return False
        return True

    async def _may_audit(self, node_id: str) -> bool:
        """Whether a node may download what a step started from (trainer_audit.py): a member whose record says it
        is an auditor."""
        if not await self._is_member(node_id):
            return False
        record = self.registry.records.get(node_id)
        return record is not None and record.role == "auditor"

    def _trusted(self, node_id: str) -> bool:
        """Whether a key earned trust by itself: past probation (its batches passed), not banned. Such a key comes
        first for the origin's slots, and vouches for the relay it hangs below (weights/earned.py)."""
        return node_id not in self.banned and not self.admission.on_probation(node_id)

    def _fresh_floor(self) -> int:
        return self.progress.step - self.spec.train.async_level

    async def _announce_version(self, version: int) -> None:
        """A version durability published: gossip's notice, then the trainer's DHT record."""
        await self.gossip.announce_version(version)
        try:
            await self.membership.publish_record(self.record())
        except Exception as e:  # timeouts, daemon errors: the periodic republish will try again
            logger.warning("could not announce version %d in the DHT: %r", version, e)

    # ---- checkpoints ---------------------------------------------------------------------------------

    def _checkpoint_meta(self) -> dict[str, Any]:
        """Everything a checkpoint holds but the engine, from the parts' states (on the event loop, consistent
        with the queue and the spool rotation)."""
        return {
            **self.learner.state(),
            **self.door.state(),
            "spec": self.spec.model_dump_json(),
            "banned": dict(self.banned),
            "rewards_seen": list(self.shared.curve.seen),
            "admission": self.admission.state(),
            "peers": self.registry.peer_addresses(self.run_id),
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        self.learner.restore(saved)
        self.banned.clear()
        self.banned.update(saved["banned"])
        self.gate.next_index = dict(saved["gate"])
        self.shared.curve.seen = list(saved["rewards_seen"])
        self.admission.restore(saved.get("admission", {}))
        self._saved_peers = list(saved["peers"])
        logger.info("resuming run %s from its checkpoint at step %d", self.run_id, self.progress.step)

    def _replay(self) -> None:
        """Batches accepted before a restart go through validation again: those of the checkpoint (only their
        groups still due) and every one spooled since."""
        saved = self._resumed
        self._resumed = None  # the engine state in it is no longer needed
        todo: Iterator[tuple[bytes, list[int] | None]] = itertools.chain(
            ((env, saved["due"].get(key)) for key, env in saved["batches"].items()) if saved is not None else (),
            ((env, None) for env in self.durability.ckpt.spooled_since(self.progress.step)),
        )
        counts = self.door.replay(todo)
        if saved is not None or any(counts.values()):
            self.resume_info = {"from_step": self.progress.step, **counts}
            logger.info(
                "replayed %d accepted groups from before the restart; %d had gone stale",
                counts["replayed_groups"],
                counts["stale_groups"],
            )

    async def _join_dht(self) -> list[str]:
        """The first DHT peer of a new run; a resumed trainer rejoins through the peers it knew (or ``--peers``)."""
        peers = self.cfg.peers or self._saved_peers
        state = self.cfg.data_dir
        if not self.cfg.peers and peers:
            try:
                return await self.membership.start(self.cfg.host, self.cfg.p2p_port, peers, state, fresh_process=True)
            except SystemExit as e:
                logger.warning(
                    "could not rejoin the DHT through the peers known at the checkpoint (%s); starting "
                    "alone: nodes reconnect to this address (kept across restarts)",
                    e,
                )
        return await self.membership.start(
            self.cfg.host, self.cfg.p2p_port, peers if self.cfg.peers else [], state, fresh_process=True
        )

    # ---- status --------------------------------------------------------------------------------------

    def record(self) -> NodeRecord:
        return NodeRecord(
            run_id=self.run_id,
            node_id=self.identity.node_id,
            role="trainer",
            p2p_maddrs=self.maddrs[:8],
            http_url=self.status_url,
            weight_version=max(self.progress.published, 0),
            epoch=self.spec.epoch,
            updated=time.time(),
            software=f"intellect-node/{__version__}",
            relay=self.origin.origin_info(self.registry.records, self.store.complete_versions(), self.cfg.relay_slots),
            ledger=self.ledger_head(),
        )

    def ledger_head(self) -> LedgerHead | None:
        ledger = self.durability.ledger
        return None if ledger is None else LedgerHead(length=ledger.head.length, head=ledger.head.hash)

    def state(self) -> dict[str, Any]:
        """What the trainer does, in words (``/status``, ``intellect-node status``, the dashboard). Waiting for
        rollouts is its job too: it is never "not ok" for want of volunteers, but it says that it waits."""
        step, history = self.progress.step, self.learner.history
        if self.cfg.max_steps is not None and step >= self.cfg.max_steps:
            return {"ok": True, "doing": f"done: {step} steps (max_steps); serving the weights until stopped"}
        since = time.time() - history[-1]["time"] if history else None
        if since is None or since > WAITING_S:
            return {
                "ok": True,
                "doing": f"waiting for rollouts: no step for {'ever' if since is None else f'{since:.0f} s'}, "
                f"{len(self.shared.queue)} groups queued; volunteers join with the line printed at start",
            }
        return {"ok": True, "doing": f"training: step {step}"}

    def status(self) -> dict[str, Any]:
        shared = self.shared
        return {
            "role": "trainer",
            "state": self.state(),
            "node_id": self.identity.node_id,
            "run_id": self.run_id,
            "epoch": self.spec.epoch,
            "step": self.progress.step,
            "weight_version": self.progress.published,
            "max_steps": self.cfg.max_steps,
            "queue_groups": len(shared.queue),
            "idle_s": round(self.learner.idle_s, 3),
            "received_batches_by_node": dict(shared.received_by_node),
            "accepted_groups_by_node": dict(shared.accepted_by_node),
            "rejected_batches_by_node": dict(shared.rejected_by_node),
            "by_node_others": {
                "received": shared.received_by_node.others,
                "accepted": shared.accepted_by_node.others,
                "rejected": shared.rejected_by_node.others,
            },
            "rejected_batches_by_reason": self.metrics.by_label("node_trainer_batches_rejected_total"),
            "validation_failures_by_reason": self.metrics.by_label("node_validator_rejected_total"),
            "banned": self.banned,
            "validators_missing": self.judging.validators_missing,
            "verdicts_ok": int(self.metrics.counter("node_validator_accepted_total")),
            "pending_validation": self.judging.pending.qsize(),
            "judging": len(shared.inflight),  # admitted, verdict not yet applied (here or by validators)
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
            "outstanding_groups": len(shared.queue) + shared.inflight.groups(),
            "resumed": self.resume_info,
            "ledger": None if (head := self.ledger_head()) is None else head.model_dump(),
            "history": self.learner.history,
        }

    # ---- lifecycle -----------------------------------------------------------------------------------

    def _invite_arg(self) -> str:
        """An invite-only run's join line carries a fresh invite (``--invite-uses`` nodes, ``--invite-days``)."""
        if self.spec.admission.policy != "invite":
            return ""
        return f" --invite {mint_invite(self.identity, self.cfg.invite_uses, self.cfg.invite_days)}"

    async def run(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        await self.durability.publish_current(self.learner.engine.export_state)
        ledger = open_ledger(self.cfg.data_dir / "ledger", self.run_id, self.spec.epoch, self.progress.published)
        self.durability.ledger = self.ledger_routes.ledger = ledger
        self.durability.start()  # without checkpoints there is no resume, and nothing to spool for one
        self._replay()
        source: RolloutSource | None = None
        invites: InviteDoor | None = None
        try:
            self.maddrs = await self._join_dht()  # first: the DHT process must not inherit a listening socket
            port = await self.http.start(self.cfg.host, self.cfg.http_port)
            self.maddrs, self.status_url = announced(self.cfg.host, self.cfg.announce, self.maddrs, port)
            (self.cfg.data_dir / "http.url").write_text(f"http://127.0.0.1:{port}\n")  # for `intellect-node status`
            p2p = self.p2p = await self.membership.replicate_p2p()
            source = make_source(Endpoint(p2p, self.identity, self.run_id, self.metrics))
            await source.start(Receiver(self.door.on_batch, self.door.reject, self.intake))
            invites = InviteDoor(p2p, self.identity, self.run_id, self.admission, self.metrics)
            await invites.start()
            await self.gossip.start(p2p, source)
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
                tasks.create_task(self.learner.train_forever())
                tasks.create_task(self.judging.validate_forever())
                tasks.create_task(self.judging.watch_validators())
                tasks.create_task(self.gossip.repeat_notices(self.progress.published))
        finally:
            self.durability.abandon()
            await self.gossip.stop()
            if self.learner.tracker is not None:
                self.learner.tracker.close()
            if source is not None:
                await source.close()
            if invites is not None:
                await invites.close()
            await self.http.close()
            await self.membership.close()
            self.durability.ckpt.close()
            self.learner.engine.close()
            self.judging.close()
