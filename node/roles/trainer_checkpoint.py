"""The trainer's durable state: checkpoints of the policy, and a spool of the rollout batches it accepted.

Layout under ``<data_dir>/checkpoints/<run_id>/``:

- ``step-<n>.pt``: everything needed to continue after step ``n``: the engine's fp32 weights and optimizer, the
  signed run spec, history, bans, the duplicate gate, peers to rejoin the DHT through, and the envelopes of every
  batch that still had rollouts waiting (queued or being validated), with which of their groups were still due.
  Written to a temporary file and renamed, so a checkpoint on disk is always whole; the last two are kept.
- ``spool-<n>.bin``: every batch accepted after checkpoint ``n``'s snapshot, appended as it is accepted
  (length-prefixed envelopes). On resume from checkpoint ``n`` the trainer replays the checkpoint's batches and
  every spool from ``n`` on through validation again: an accepted rollout is trained on, or its loss is counted
  and logged (stale by then, or failing checks), never silently dropped.

Invariant: checkpoint ``n`` is durable before version ``n`` is published, so a resumed trainer never publishes a
second, different version with a number the swarm has already seen.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from intellect_node.judging.validator import Gate
from intellect_node.p2p.metrics import Metrics
from intellect_node.policy.engine import BatchKey, Group, PolicyEngine
from intellect_node.roles.admission import Admission
from intellect_node.roles.trainer_registry import NodeRegistry
from intellect_node.roles.trainer_validation import PendingBatches
from intellect_protocol.envelope import Rejected, decode_body, open_envelope
from intellect_protocol.messages import RolloutBatch, RunSpec

logger = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d{8})\.pt$")
_SPOOL = re.compile(r"^spool-(\d{8})\.bin$")
_LEN = struct.Struct(">I")
MAX_ENVELOPE = 256 * 2**20
KEEP = 2


class CheckpointDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._spool: IO[bytes] | None = None
        self.spool_step = -1

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP.match(p.name)))

    def latest(self) -> dict[str, Any] | None:
        """The newest readable checkpoint (a corrupt one is skipped with a warning)."""
        for step in reversed(self.steps()):
            path = self.root / f"step-{step:08d}.pt"
            try:
                return dict(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:  # a torn file cannot exist (rename), but a disk can fail
                logger.warning("checkpoint %s is unreadable (%r); trying an older one", path, e)
        return None

    def write(self, step: int, state: dict[str, Any]) -> Path:
        path = self.root / f"step-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for old in self.steps()[:-KEEP]:
            (self.root / f"step-{old:08d}.pt").unlink(missing_ok=True)
        oldest = self.steps()[0]
        for p in self.root.iterdir():  # spools older than the oldest kept checkpoint are covered by it
            if (m := _SPOOL.match(p.name)) and int(m.group(1)) < oldest:
                p.unlink(missing_ok=True)
        return path

    # ---- spool -------------------------------------------------------------------------------------------

    def start_spool(self, step: int) -> None:
        """Batches accepted from now on go to ``spool-<step>.bin`` (called when checkpoint ``step`` is taken)."""
        if self._spool is not None:
            self._spool.close()
        self.spool_step = step
        self._spool = open(self.root / f"spool-{step:08d}.bin", "ab")

    def append(self, envelope: bytes) -> None:
        if self._spool is None:
            raise RuntimeError("start_spool() first")
        self._spool.write(_LEN.pack(len(envelope)) + envelope)
        self._spool.flush()  # survives the process being killed; the OS writes it out

    def spooled_since(self, step: int) -> list[bytes]:
        """Every envelope in spools from ``step`` on, oldest first; a torn last record is ignored."""
        out: list[bytes] = []
        spools = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _SPOOL.match(p.name)))
        for n, path in spools:
            if n < step:
                continue
            data = path.read_bytes()
            at = 0
            while at + _LEN.size <= len(data):
                (size,) = _LEN.unpack_from(data, at)
                if size > MAX_ENVELOPE or at + _LEN.size + size > len(data):
                    logger.warning("%s ends with a torn record (%d bytes ignored)", path.name, len(data) - at)
                    break
                out.append(data[at + _LEN.size : at + _LEN.size + size])
                at += _LEN.size + size
        return out

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None


class Checkpoints:
    """The trainer's side of checkpoints (a mixin of ``Trainer``): what a checkpoint holds besides the engine,
    restoring it, and replaying the batches accepted before a restart."""

    # what this uses of the trainer (set in Trainer.__init__, or its methods)
    spec: RunSpec
    run_id: str
    step: int
    engine: PolicyEngine
    ckpt: CheckpointDir
    metrics: Metrics
    registry: NodeRegistry
    admission: Admission
    gate: Gate
    history: list[dict[str, Any]]
    banned: dict[str, str]
    idle_s: float
    queue: list[Group]
    pending: PendingBatches
    pending_by_node: Counter[str]
    validating: set[BatchKey]
    envelopes: dict[BatchKey, bytes]
    resume_info: dict[str, int] | None
    _rewards_seen: list[float]
    _counted: set[BatchKey]

    _fresh_floor: Callable[[], int]
    _check_contents: Callable[[RolloutBatch], list[int]]

    def _snapshot(self, checkpoint: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """The weights to publish and (when a checkpoint is due) a private copy of the engine's state, taken
        between steps so that the next step can run while they are written."""
        return self.engine.export_state(), copy.deepcopy(self.engine.state()) if checkpoint else None

    def _checkpoint_meta(self) -> dict[str, Any]:
        """Everything but the engine, on the event loop (consistent with the queue and the spool rotation)."""
        due: dict[BatchKey, list[int] | None] = {key: None for key in self.validating}
        for g in self.queue:
            slots = due.setdefault(g.key, [])
            if slots is not None:
                slots.append(g.slot)
        self.envelopes = {k: v for k, v in self.envelopes.items() if k in due}
        return {
            "spec": self.spec.model_dump_json(),
            "step": self.step,
            "history": list(self.history),
            "banned": dict(self.banned),
            "gate": dict(self.gate.next_index),
            "idle_s": self.idle_s,
            "rewards_seen": list(self._rewards_seen),
            "admission": self.admission.state(),
            "peers": self.registry.peer_addresses(self.run_id),
            "batches": {k: self.envelopes[k] for k in due if k in self.envelopes},
            "due": due,
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        self.engine.load_state(saved["engine"])
        self.step = int(saved["step"])
        self.history = list(saved["history"])
        self.banned = dict(saved["banned"])
        self.gate.next_index = dict(saved["gate"])
        self.idle_s = float(saved["idle_s"])
        self._rewards_seen = list(saved["rewards_seen"])
        self.admission.restore(saved.get("admission", {}))
        self._saved_peers: list[str] = list(saved["peers"])
        logger.info("resuming run %s from its checkpoint at step %d", self.run_id, self.step)

    def _replay(self, saved: dict[str, Any] | None) -> None:
        """Batches accepted before a restart go through validation again: those of the checkpoint (only their
        groups still due) and every one spooled since. What went stale meanwhile is counted and logged."""
        todo: list[tuple[bytes, list[int] | None]] = []
        if saved is not None:
            todo += [(env, saved["due"].get(key)) for key, env in saved["batches"].items()]
        todo += [(env, None) for env in self.ckpt.spooled_since(self.step)]
        seen: set[BatchKey] = set()
        replayed = stale = 0
        for data, slots in todo:
            try:
                signer, body = open_envelope(data, RolloutBatch)
                batch = decode_body(signer, body, RolloutBatch).message
                due = self._check_contents(batch)
            except Rejected as e:  # it passed these checks once: only a changed task set can fail them
                logger.warning("could not replay a spooled batch: %s", e)
                continue
            key = (batch.node_id, batch.version, batch.batch_index)
            if key in seen or batch.node_id in self.banned:
                continue
            seen.add(key)
            if slots is not None:
                due = [slot for slot in due if slot in slots]
                self._counted.add(key)
            if batch.version < self._fresh_floor():
                stale += len(due)
                self.metrics.inc("node_trainer_groups_stale_dropped_total", len(due))
                continue
            self.gate.next_index[(batch.node_id, batch.version)] = max(
                self.gate.next_index.get((batch.node_id, batch.version), 0), batch.batch_index + 1
            )
            self.envelopes[key] = data
            self.validating.add(key)
            self.ckpt.append(data)
            self.pending.put_nowait((batch, due, data))
            self.pending_by_node[batch.node_id] += len(due)
            replayed += len(due)
        if saved is not None or todo:
            self.resume_info = {"from_step": self.step, "replayed_groups": replayed, "stale_groups": stale}
            logger.info("replayed %d accepted groups from before the restart; %d had gone stale", replayed, stale)
