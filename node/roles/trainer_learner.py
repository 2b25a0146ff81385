"""The trainer's learner: takes judged groups off the training queue, runs GRPO steps, hands each new version on.

Step ``n`` turns version ``n`` into ``n + 1``: ``batch_groups`` groups, oldest versions first (stale ones are
dropped and logged), packed and trained in a thread (group advantages and the clipped loss of kernels/grpo.py,
AdamW over fp32 master weights in policy/engine.py), so that the event loop keeps admitting, judging and serving
weights meanwhile. The weights (and, when a checkpoint is due, a private copy of the engine's state) are taken
between steps and handed to durability, with what the step consumed (the batches trained on, the refusals since
the step before: its contribution-ledger entry), which writes and publishes them while the next step runs:
inference never waits for training or publishing.

``Learner`` is one part of the trainer (node/roles/trainer.py wires it): it owns the engine, the step history and
the time it waited for rollouts; the step count is ``Shared.progress`` (others read it).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from intellect_kernels.grpo import group_advantages, lr_factor
from intellect_node.judging.validator import Gate
from intellect_node.p2p.http import EncodedList
from intellect_node.p2p.metrics import Metrics
from intellect_node.policy.engine import Group, Packed, PolicyEngine, pack_sequences
from intellect_node.roles.tracking import Tracker
from intellect_node.roles.trainer_checkpoint import Durability
from intellect_node.roles.trainer_ledger import step_record
from intellect_node.roles.trainer_state import Shared
from intellect_node.runtime import trim_freed
from intellect_protocol.messages import RunSpec

logger = logging.getLogger(__name__)


def grpo_step(engine: PolicyEngine, spec: RunSpec, groups: list[Group], pad_id: int, step: int) -> dict[str, float]:
    """One GRPO step turning version ``step`` into ``step + 1``: ``groups`` packed in this order, their advantages,
    the scheduled learning rate. Everything it reads is in the step's ledger entry, the previous version's engine
    state and the run spec: an auditor replays a step by calling it (node/roles/audit.py)."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    ids, attn, mask, logp_old = pack_sequences(groups, pad_id)
    t = spec.train
    lr = t.lr * lr_factor(step, t.warmup_steps, t.decay_steps, t.min_lr_ratio)
    return engine.step(Packed(ids, attn, mask, logp_old, group_advantages(rewards).flatten()), lr)


class Learner:
    """GRPO steps on judged groups (module docstring). ``train_forever`` until ``max_steps`` (None: for ever);
    ``checkpoint_every`` steps a checkpoint is due (0: never)."""

    def __init__(
        self,
        spec: RunSpec,
        engine: PolicyEngine,
        pad_id: int,
        metrics: Metrics,
        shared: Shared,
        gate: Gate,
        durability: Durability,
        fresh_floor: Callable[[], int],
        checkpoint_meta: Callable[[], dict[str, Any]],
        judged_s: Callable[[], float],
        max_steps: int | None,
        checkpoint_every: int,
        tracker: Tracker | None = None,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.pad_id = pad_id
        self.metrics = metrics
        self.shared = shared
        self.progress = shared.progress
        self.gate = gate
        self.durability = durability
        self.fresh_floor = fresh_floor
        self.checkpoint_meta = checkpoint_meta
        self.judged_s = judged_s
        self.max_steps = max_steps
        self.checkpoint_every = checkpoint_every
        self.tracker = tracker
        self.history: list[dict[str, Any]] = EncodedList()
        """Every step's stats (served by /status without encoding it again per request)."""
        self.idle_s = 0.0
        """Seconds spent waiting for enough judged groups."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the learner (besides the engine)."""
        return {
            "step": self.progress.step,
            "history": self.history,  # new lines only go to history.jsonl (CheckpointDir.write)
            "history_len": len(self.history),
            "idle_s": self.idle_s,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        self.engine.load_state(saved["engine"])
        self.progress.step = int(saved["step"])
        self.history = EncodedList(saved["history"])
        self.idle_s = float(saved["idle_s"])

    def take_batch(self) -> list[Group] | None:
        floor = self.fresh_floor()
        batch, stale = self.shared.queue.take(self.spec.train.batch_groups, floor)
        if stale:
            self.metrics.inc("node_trainer_groups_stale_dropped_total", len(stale))
            for g in stale:
                self.shared.ledger("stale", g.key, 1)
        self.gate.forget_before(floor)
        return batch

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        skipped = self.engine.skipped
        stats = grpo_step(self.engine, self.spec, groups, self.pad_id, self.progress.step)
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

    def snapshot(self, checkpoint: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """The weights to publish and (when a checkpoint is due) a private copy of the engine's state, taken
        between steps so that the next step can run while they are written."""
        return self.engine.export_state(), copy.deepcopy(self.engine.state()) if checkpoint else None

    async def train_forever(self) -> None:
        every = self.checkpoint_every
        queue = self.shared.queue
        while self.max_steps is None or self.progress.step < self.max_steps:
            waited = time.monotonic()
            while (groups := self.take_batch()) is None:
                queue.changed.clear()
                await queue.changed.wait()
            idle = time.monotonic() - waited
            self.idle_s += idle
            started, split = time.monotonic(), (self.judged_s(), self.durability.publish_s)
            stats = await asyncio.to_thread(self.train_step, groups)
            for g in groups:  # logged with the step they went into (step + 1 once it is counted below)
                self.shared.ledger("trained", g.key, 1)
            versions = [g.version for g in groups]
            due = bool(every) and (self.progress.step + 1) % every == 0
            tensors, engine_state = await asyncio.to_thread(self.snapshot, due)
            self.progress.step += 1
            step = self.progress.step
            stats.update(
                step=step,
                seconds=time.monotonic() - started,
                idle_s=idle,
                validate_s=self.judged_s() - split[0],  # judging batches here meanwhile (on its own thread)
                publish_s=self.durability.publish_s - split[1],  # the previous version's checkpoint and publication
                time=time.time(),
                staleness_max=float(step - 1 - min(versions)),
                staleness_mean=float(sum(step - 1 - v for v in versions) / len(versions)),
            )
            self.history.append(stats)
            self.progress.stepped(stats["seconds"])
            if self.tracker is not None:
                self.tracker.log(step, stats)
            # the step's ledger entry
            record = step_record(groups, self.shared.refusals.drain(), self.shared.ledger.drain_dropped())
            await self.durability.after_step(step, tensors, engine_state, self.checkpoint_meta, record)
            self._report(stats, len(groups), idle)
        await self.durability.drain()
        self.progress.final = True
        logger.info("reached max_steps=%s; still serving weights and status until stopped", self.max_steps)
        await asyncio.Event().wait()

    def _report(self, stats: dict[str, Any], groups: int, idle: float) -> None:
        m = self.metrics
        m.inc("node_trainer_steps_total")
        m.observe("node_trainer_step_seconds", stats["seconds"], help="a training step and snapshot")
        m.set("node_trainer_step", stats["step"])
        m.set("node_trainer_reward_mean", stats["reward_mean"])
        # a counter of this process's waits (as Prometheus counters go, from 0 at each start); /status has the run's
        m.inc("node_trainer_idle_seconds_total", idle, help="seconds the trainer waited for rollouts before a step")
        m.set(
            "node_trainer_staleness_max",
            stats["staleness_max"],
            help="steps from a trained rollout's policy to its step (last step's max)",
        )
        m.set("node_trainer_staleness_mean", stats["staleness_mean"])
        logger.info(
            "step=%d reward_mean=%.3f accuracy=%.3f loss=%.4f staleness_max=%d groups=%d seconds=%.2f idle=%.2f",
            stats["step"],
            stats["reward_mean"],
            stats["accuracy"],
            stats["loss"],
            stats["staleness_max"],
            groups,
            stats["seconds"],
            idle,
        )
        print(f"STEP {stats['step']} reward_mean={stats['reward_mean']:.3f}", flush=True)
