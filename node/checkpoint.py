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

import logging
import os
import re
import struct
from pathlib import Path
from typing import IO, Any

import torch

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
