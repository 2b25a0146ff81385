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

Invariant: checkpoint ``n`` (when due) and the ledger entry of version ``n`` (node/roles/trainer_ledger.py) are
durable before version ``n`` is published, so a published version always has its entry, and a resumed trainer
never publishes a second, different version with a number the swarm has already seen. A start without a checkpoint
to resume is a new run epoch (``RunSpec.epoch``, kept in ``<data_dir>/epochs/<run_id>``, always larger than the
last): its version numbers start at 0 again, and the epoch tells the swarm that they name other weights.

Durability: a batch's spool record is fsynced before the trainer answers ok; checkpoints, published shards and
manifests are fsynced before they are renamed into place, and the directory after the rename.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import IO, Any

import torch

from intellect_node.config import NodeConfig
from intellect_node.p2p.http import EncodedList
from intellect_node.p2p.metrics import Metrics
from intellect_node.roles.trainer_ledger import LedgerLog, StepRecord
from intellect_node.roles.trainer_state import Progress
from intellect_node.weights.files import fsync_dir, sha256_file, write_checkpoint
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import entry_of
from intellect_protocol.messages import Manifest

logger = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d{8})\.pt$")
_SPOOL = re.compile(r"^spool-(\d{8})\.bin$")
_LEN = struct.Struct(">I")
SHED_EVERY_S = 5.0
"""On a full disk the trainer drops old files at most this often (every failing write asks)."""
MAX_ENVELOPE = 256 * 2**20
KEEP = 2
HISTORY = "history.jsonl"
"""Every step's stats, one JSON line each, appended as checkpoints are taken."""


def next_epoch(path: Path) -> int:
    """A new run epoch: the time in microseconds, or one more than the last epoch recorded at ``path`` if the
    clock is behind it; recorded (fsynced) before it is used."""
    last = 0
    try:
        last = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        pass
    epoch = max(time.time_ns() // 1000, last + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(f"{epoch}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return epoch


class CheckpointDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._spool: IO[bytes] | None = None
        self._lock = threading.Lock()
        """Appends run on a worker thread; rotation on the event loop."""
        self.keep = KEEP
        """Checkpoints kept; one while the disk is under pressure (see Checkpoints._shed_disk)."""
        self.spool_step = -1
        self._history_lines = 0
        self._history_known = False
        """Whether ``history.jsonl`` is known to hold exactly ``_history_lines`` lines of this run's steps."""
        self.digests: dict[int, str] = {}
        """SHA-256 of each checkpoint file this process wrote, by step: the ledger entry of the step names it."""

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP.match(p.name)))

    def latest(self) -> dict[str, Any] | None:
        """The newest readable checkpoint (a corrupt one is skipped with a warning)."""
        for step in reversed(self.steps()):
            path = self.root / f"step-{step:08d}.pt"
            try:
                state = dict(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:  # a torn file cannot exist (rename), but a disk can fail
                logger.warning("checkpoint %s is unreadable (%r); trying an older one", path, e)
                continue
            if "history_len" in state:
                state["history"] = self._read_history(int(state["history_len"]))
            return state
        return None

    def _read_history(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` steps' stats from ``history.jsonl``; lines past them (written for a checkpoint that
        never landed) are cut off, so appends continue right after."""
        path = self.root / HISTORY
        entries: list[dict[str, Any]] = []
        end = 0
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            for line in f:
                if len(entries) == count or not line.endswith(b"\n"):
                    break
                entries.append(json.loads(line))
                end += len(line)
        if len(entries) < count:
            logger.warning("%s holds %d of the %d steps the checkpoint names", path, len(entries), count)
        if path.exists() and path.stat().st_size != end:
            os.truncate(path, end)
        self._history_lines, self._history_known = len(entries), True
        return entries

    def _write_history(self, history: EncodedList, upto: int) -> None:
        """Append the stats of steps not yet on disk (up to ``upto``), fsynced: each step is written once, not the
        whole history at every checkpoint (at one checkpoint a step that cost grew with the run: the trainer
        slowed by a fifth over 15 minutes)."""
        path = self.root / HISTORY
        if not self._history_known:  # no checkpoint resumed: whatever is there is from another run
            path.unlink(missing_ok=True)
            self._history_lines, self._history_known = 0, True
        if upto <= self._history_lines:
            return
        lines = "".join(text + "\n" for text in history.texts(self._history_lines, upto))
        with open(path, "a") as f:
            at = f.tell()
            try:
                f.write(lines)
                f.flush()
                os.fsync(f.fileno())
            except OSError:  # a full disk: no partial line stays behind to be followed by the retry's
                with contextlib.suppress(OSError):
                    f.truncate(at)
                raise
        self._history_lines = upto

    def shed(self) -> int:
        """Make room on a full disk: keep only the newest checkpoint (and the spools it needs). Returns the bytes
        freed."""
        freed = 0
        for old in self.steps()[:-1]:
            path = self.root / f"step-{old:08d}.pt"
            freed += path.stat().st_size if path.exists() else 0
            path.unlink(missing_ok=True)
        for tmp in self.root.glob("*.tmp"):
            freed += tmp.stat().st_size
            tmp.unlink(missing_ok=True)
        steps = self.steps()
        for n, path in self.spools():
            if steps and n < steps[0]:
                freed += path.stat().st_size
                path.unlink(missing_ok=True)
        return freed

    def write(self, step: int, state: dict[str, Any]) -> Path:
        """Checkpoint ``step``. A ``history`` that is an EncodedList goes to ``history.jsonl`` (new lines only,
        durable before the checkpoint that counts them), the checkpoint keeping its length."""
        history = state.get("history")
        if isinstance(history, EncodedList):
            upto = int(state["history_len"])
            self._write_history(history, upto)
            state = {k: v for k, v in state.items() if k != "history"}
        path = self.root / f"step-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        try:
            torch.save(state, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            digest = sha256_file(tmp)  # read back from the page cache: about 1 s a GB on one core
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not also keep the half-written file
            raise
        os.replace(tmp, path)
        fsync_dir(self.root)
        self.digests = {n: d for n, d in self.digests.items() if n > step - 2 * KEEP} | {step: digest}
        for old in self.steps()[: -self.keep]:
            (self.root / f"step-{old:08d}.pt").unlink(missing_ok=True)
        oldest = self.steps()[0]
        for p in self.root.iterdir():  # spools older than the oldest kept checkpoint are covered by it
            if (m := _SPOOL.match(p.name)) and int(m.group(1)) < oldest:
                p.unlink(missing_ok=True)
        return path

    # ---- spool -------------------------------------------------------------------------------------------

    def start_spool(self, step: int) -> None:
        """Batches accepted from now on go to ``spool-<step>.bin`` (called when checkpoint ``step`` is taken)."""
        with self._lock:
            path = self.root / f"spool-{step:08d}.bin"
            if path.exists():  # a restart at the same step: a torn last record (a crash mid-append) goes first
                whole = sum(_LEN.size + size for size in self._records(path))
                if whole != path.stat().st_size:
                    logger.warning("%s: dropping a torn last record (%d bytes)", path.name, path.stat().st_size - whole)
                    os.truncate(path, whole)
            spool = open(path, "ab")  # raises OSError on a full disk: the old spool then stays the one in use
            fsync_dir(self.root)
            if self._spool is not None:
                self._spool.close()
            self._spool, self.spool_step = spool, step

    def append(self, envelope: bytes) -> int:
        """Append one accepted batch and make it durable (fsync) before returning the step of the spool it went
        to; raises OSError (disk full) without leaving a partial record behind as far as the file system lets
        us. A caller that sees the spool rotated meanwhile appends again: the new checkpoint does not hold it."""
        with self._lock:
            if self._spool is None:
                raise RuntimeError("start_spool() first")
            at = self._spool.tell()
            try:
                self._spool.write(_LEN.pack(len(envelope)) + envelope)
                self._spool.flush()
                os.fsync(self._spool.fileno())
            except OSError:
                try:
                    self._spool.truncate(at)  # what was written of a failed record goes
                    self._spool.seek(at)
                except (OSError, ValueError):
                    pass
                raise
            return self.spool_step

    def spools(self) -> list[tuple[int, Path]]:
        return sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _SPOOL.match(p.name)))

    def spooled_since(self, step: int) -> Iterator[bytes]:
        """Every envelope in spools from ``step`` on, oldest first, read one record at a time; a torn last
        record is ignored."""
        for n, path in self.spools():
            if n < step:
                continue
            with open(path, "rb") as f:
                while len(head := f.read(_LEN.size)) == _LEN.size:
                    (size,) = _LEN.unpack(head)
                    data = f.read(size) if size <= MAX_ENVELOPE else b""
                    if len(data) != size or size > MAX_ENVELOPE:
                        logger.warning("%s ends with a torn record (ignored)", path.name)
                        break
                    yield data

    def drop_spools(self) -> int:
        """Delete every spool (a new run epoch: their batches were made on weights that are gone); returns how
        many batches they held."""
        count = 0
        for _, path in self.spools():
            count += sum(1 for _ in self._records(path))
            path.unlink(missing_ok=True)
        return count

    def _records(self, path: Path) -> Iterator[int]:
        """The sizes of the whole records in ``path``, skipped over (counting them reads no envelope)."""
        end = path.stat().st_size
        with open(path, "rb") as f:
            while len(head := f.read(_LEN.size)) == _LEN.size:
                (size,) = _LEN.unpack(head)
                if size > MAX_ENVELOPE or f.tell() + size > end:
                    return
                f.seek(size, os.SEEK_CUR)
                yield size

    def close(self) -> None:
        with self._lock:
            if self._spool is not None:
                self._spool.close()
                self._spool = None


class LedgerWriteError(Exception):
    """A version's ledger entry could not be written (its OSError is the cause): the version is not published."""


class Durability:
    """The trainer's durable side (module docstring): ``spool`` each accepted batch before it is acknowledged,
    ``after_step`` to checkpoint (when due) and publish each version in order while training goes on,
    ``publish_current`` at start. It owns the checkpoint directory and the publication of versions; the learner
    hands it what a step produced, and the trainer the rest of a checkpoint (``meta``) and how a published
    version is announced (``announce``: gossip and the trainer's DHT record)."""

    def __init__(
        self,
        cfg: NodeConfig,
        identity: Identity,
        epoch: int,
        async_level: int,
        ckpt: CheckpointDir,
        store: WeightStore,
        store_lock: threading.Lock,
        metrics: Metrics,
        progress: Progress,
        announce: Callable[[int], Awaitable[None]],
        train_settings: str = "",
    ) -> None:
        self.cfg = cfg
        self.identity = identity
        self.run_id = identity.node_id
        self.epoch = epoch
        self.async_level = async_level
        self.ckpt = ckpt
        self.store = store
        self.store_lock = store_lock
        self.weights_root = store.root
        self.metrics = metrics
        self.progress = progress
        self.announce = announce
        self.publish_s = 0.0
        """Seconds spent publishing versions (the step split)."""
        self._persisting: asyncio.Task[None] | None = None
        self._shed_at = -1e9
        self.ledger: LedgerLog | None = None
        """The contribution ledger (set at start by ``open_ledger``; None: no entries written this epoch)."""
        self.train_settings = train_settings
        """``train_hash`` of the run's training settings: every entry names it."""
        self._unrecorded: list[tuple[int, StepRecord]] = []
        """Steps whose entry is not yet in the ledger (an append failed): written, in order, before the next
        version is published."""
        self._parent: int | None = None
        """The version the next step starts from when it is not the one before its own (a resume from a checkpoint
        older than the newest published version)."""

    async def spool(self, envelope: bytes) -> None:
        """Make an accepted batch durable (fsynced) before it is acknowledged; raises OSError when it cannot be
        (disk full after shedding, out of file handles). Nothing to do without checkpoints (no resume)."""
        if not self.cfg.checkpoint_every:
            return
        try:
            try:
                written = await asyncio.to_thread(self.ckpt.append, envelope)
            except OSError:
                await asyncio.to_thread(self.shed_disk)
                written = await asyncio.to_thread(self.ckpt.append, envelope)
            while written != self.ckpt.spool_step:  # a checkpoint was taken meanwhile, without this batch
                written = await asyncio.to_thread(self.ckpt.append, envelope)
        except OSError as e:
            self.metrics.inc("node_trainer_spool_failures_total", help="accepted batches that could not be spooled")
            logger.error("cannot spool a batch: %r; free disk space under %s", e, self.ckpt.root)
            raise

    def start(self) -> None:
        """Batches accepted from now on go to the spool of the current step (none without checkpoints)."""
        if self.cfg.checkpoint_every:
            self.ckpt.start_spool(self.progress.step)

    async def after_step(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        engine_state: dict[str, Any] | None,
        meta: Callable[[], dict[str, Any]],
        record: StepRecord | None = None,
    ) -> None:
        """Version ``step`` is made: checkpoint it when ``engine_state`` is given (with ``meta``, everything but
        the engine, read now on the event loop, consistent with the queue and the spool rotation), write its
        ledger entry (``record``: what the step consumed), then publish it, after the version before it and
        without waiting for any of them."""
        if record is not None and self.ledger is not None:
            self._unrecorded.append((step, record))
        checkpoint = None
        if engine_state is not None:
            try:  # batches accepted from now on go to the next spool; if it cannot be made, no checkpoint now
                self.ckpt.start_spool(step)
                checkpoint = {**meta(), "engine": engine_state}
            except OSError as e:
                self.metrics.inc("node_trainer_persist_failures_total", label="spool")
                logger.error("cannot start a new spool (%r): checkpoint %d skipped", e, step)
        previous = self._persisting
        if previous is not None:  # versions go out in order; the step did not wait for this
            await previous
        self._persisting = asyncio.create_task(self._persist(step, tensors, checkpoint))

    async def drain(self) -> None:
        """Wait until the last version handed over is checkpointed and published."""
        if self._persisting is not None:
            await self._persisting

    def abandon(self) -> None:
        """The node stops: the version being written is left unfinished (a checkpoint and a version are renamed into
        place only once whole, so what is on disk is whole; a resume redoes the rest) rather than published while
        the DHT and gossip it announces on close under it."""
        if self._persisting is not None:
            self._persisting.cancel()

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write, sign and make visible ``version`` (blocking: run it in a thread), then prune old versions. The
        ledger entries due up to ``version`` are written once its files are durable and before they are visible,
        the version's own naming the weights' digest; LedgerWriteError when they cannot be (nothing published)."""

        def record(manifest: Manifest) -> None:
            if not self._unrecorded or self.ledger is None:
                return
            try:
                self._write_entries(version, manifest.checkpoint_sha256)
            except OSError as e:
                raise LedgerWriteError(f"ledger entry of version {version}") from e

        write = partial(
            write_checkpoint,
            self.weights_root,
            self.identity,
            self.run_id,
            version,
            tensors,
            self.cfg.shard_bytes,
            epoch=self.epoch,
            stripes=self.cfg.stripes,
            before_rename=record,
        )
        try:
            write()
        except LedgerWriteError:
            raise
        except Exception:  # most often a full disk: shed old versions and checkpoints, then once more
            shutil.rmtree(self.weights_root / f"{version}.partial", ignore_errors=True)
            self.shed_disk()
            write()
        keep = self.cfg.keep_versions or self.async_level + 1
        if self.ckpt.keep == 1:  # the disk was full: the newest two (the validator may still need the older)
            keep = min(keep, 2)
        with self.store_lock:
            self.store.prune(keep, int(self.cfg.max_disk_gb * 1e9) if self.cfg.max_disk_gb else None)

    async def publish_current(self, export: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Version ``step`` on disk: version 0 of a new run, or, after a resume, the checkpoint's step (unless it
        was published before the restart). Versions a previous life published beyond the checkpoint (possible
        with checkpoint_every > 1) keep their numbers: training continues from the checkpoint as the next one."""
        progress = self.progress
        newest = max(self.store.complete_versions(), default=-1)
        if newest > progress.step:
            logger.warning(
                "versions %d..%d were published after the last checkpoint (step %d); their %d steps of "
                "training are lost and the next version is %d",
                progress.step + 1,
                newest,
                progress.step,
                newest - progress.step,
                newest + 1,
            )
            self._parent = progress.step  # the next step starts from the checkpoint's weights
            progress.step = progress.published = newest
            return
        if newest < progress.step:
            await asyncio.to_thread(self.publish, progress.step, export())
        progress.published = progress.step

    def _write_entries(self, upto: int, weights: str = "") -> None:
        """Seal and append the entries not yet recorded of the steps up to version ``upto``, in order, that of
        ``upto`` naming ``weights`` (its manifest's checkpoint_sha256; the others were never published). Blocks."""
        ledger = self.ledger
        assert ledger is not None
        while self._unrecorded and self._unrecorded[0][0] <= upto:
            version, record = self._unrecorded[0]
            parent = version - 1 if self._parent is None else self._parent
            entry = entry_of(
                self.run_id,
                self.epoch,
                version,
                parent,
                ledger.head.hash,
                time.time(),
                self.train_settings,
                record.credits,
                record.refusals,
                record.groups,
                weights if version == upto else "",
                self.ckpt.digests.get(version, ""),
                record.dropped,
            )
            ledger.append(seal(self.identity, entry), entry)  # sealed here: only its link is checked
            self._unrecorded.pop(0)
            self._parent = None
            self.metrics.set(
                "node_trainer_ledger_length", ledger.head.length, help="entries in the contribution ledger"
            )

    def shed_disk(self) -> None:
        """A full disk: keep one published version and one checkpoint, so that training can go on in what we
        already use (a disk filled by something else gives back nothing)."""
        if time.monotonic() - self._shed_at < SHED_EVERY_S:
            return
        self._shed_at = time.monotonic()
        self.ckpt.keep = 1  # from now on: one checkpoint and one version, so the room freed here stays ours
        with self.store_lock:
            self.store.prune(1)
        freed = self.ckpt.shed()
        self.metrics.inc("node_trainer_disk_sheds_total", help="times a full disk made the trainer drop old files")
        logger.warning(
            "disk full under %s: kept only the newest version and checkpoint (%d bytes of old "
            "checkpoints freed); free disk space",
            self.cfg.data_dir,
            freed,
        )

    async def _persist(self, version: int, tensors: dict[str, torch.Tensor], checkpoint: dict[str, Any] | None) -> None:
        """Checkpoint (when due), then publish and announce ``version``, in order, while training goes on."""
        began = time.monotonic()
        if checkpoint is not None:
            started = time.monotonic()
            try:
                try:
                    await asyncio.to_thread(self.ckpt.write, version, checkpoint)
                except Exception:
                    await asyncio.to_thread(self.shed_disk)
                    await asyncio.to_thread(self.ckpt.write, version, checkpoint)
                self.metrics.inc("node_trainer_checkpoint_seconds_total", time.monotonic() - started)
                self.metrics.set("node_trainer_checkpoint_step", version)
            except Exception as e:  # disk full (torch.save says RuntimeError): the spools since the last stay
                self.metrics.inc("node_trainer_persist_failures_total", label="checkpoint")
                logger.error(
                    "could not write checkpoint %d: %r; training goes on, free disk space under %s",
                    version,
                    e,
                    self.ckpt.root,
                )
        try:
            await asyncio.to_thread(self.publish, version, tensors)
        except LedgerWriteError as e:  # disk full: not published without its entry; the next step writes both
            self.metrics.inc("node_trainer_persist_failures_total", label="ledger")
            logger.error(
                "could not write the ledger entry of version %d: %r; the version is not published, free disk "
                "space under %s",
                version,
                e.__cause__,
                self.cfg.data_dir,
            )
            return
        except Exception as e:  # disk full, say: the swarm keeps generating on the last version; the next step retries
            self.metrics.inc("node_trainer_persist_failures_total", label="publish")
            logger.error(
                "could not publish version %d: %r; free disk space under %s (or lower --keep-versions)",
                version,
                e,
                self.weights_root,
            )
            shutil.rmtree(self.weights_root / f"{version}.partial", ignore_errors=True)
            return
        self.progress.publish(version)
        self.store.added()  # the relays below learn of it from us (GET /relay/next), before the DHT says so
        self.publish_s += time.monotonic() - began
        self.metrics.set("node_trainer_weight_version", version)
        await self.announce(version)
