"""The trainer's contribution ledger on disk (the entries' format: protocol/ledger.py).

``<data-dir>/ledger/<run id>.log`` holds the sealed entries in order, each after its length (4 bytes, big
endian). An entry is appended and fsynced before the version it describes is published, as a checkpoint is, so a
published version always has its entry. At start the whole file is checked with the run id (``verify_chain``); a
record cut short by a crash during the append is cut off (its version was not published), and so are entries a
previous life wrote for versions it never published (the step is done again and gets an entry of its own). A
file that does not check stops the trainer, saying what to do: volunteers would refuse the chain.

``open_ledger`` opens it at start and checks that it ends at the version the trainer published (a ledger that lags,
deleted or from before the ledger existed, is switched off for the epoch, said loudly: a chain with a gap would be
refused). ``step_record`` turns a step's groups into the entry's batch credits and packing order (``StepRecord``,
what the learner hands to durability). ``LedgerRoutes`` serves the chain: ``GET /ledger`` (its head) and ``GET
/ledger/entries``.

The routes are public (the ledger is for anyone to check). Cost per request: a bounded read of the file
(``ENTRIES_MAX`` entries, ``RESPONSE_MAX_BYTES``, at least one entry), ``READS_AT_ONCE`` at a time in a thread (503
with Retry-After past that); no work depends on the caller's input but the range.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from intellect_node.policy.engine import Group
from intellect_protocol.envelope import open_signed
from intellect_protocol.ledger import BatchCredit, Head, LedgerEntry, LedgerError, extend, start, verify_entry

logger = logging.getLogger(__name__)
ENTRIES_MAX = 1024
"""Entries one ``GET /ledger/entries`` returns at most."""
RESPONSE_MAX_BYTES = 8 << 20
"""Bytes of entries one response carries at most (always at least one entry: a step of 100,000 batches is ~15 MB)."""
READS_AT_ONCE = 2
"""Ledger reads served at once; more get 503 and Retry-After."""

_LENGTH = 4


class LedgerLog:
    """Append-only, fsynced, checked on open (module docstring). Thread-safe."""

    def __init__(self, root: Path, run_id: str) -> None:
        self.path = root / f"{run_id}.log"
        self.run_id = run_id
        self._lock = threading.Lock()
        self._offsets: list[int] = []  # where each entry's record starts
        self._versions: list[tuple[int, int]] = []  # (epoch, version) of each entry
        self._heads: list[Head] = [start(run_id)]  # the head before each entry, then the last
        self._size = 0  # bytes of whole entries in the file
        root.mkdir(parents=True, exist_ok=True)
        self._load()

    @property
    def head(self) -> Head:
        return self._heads[-1]

    def __len__(self) -> int:
        return len(self._offsets)

    def _load(self) -> None:
        if not self.path.exists():
            self.path.touch()
            return
        data = self.path.read_bytes()
        at = 0
        while at < len(data):
            if at + _LENGTH > len(data):
                break
            size = int.from_bytes(data[at : at + _LENGTH], "big")
            end = at + _LENGTH + size
            if end > len(data):
                break
            sealed = data[at + _LENGTH : end]
            try:
                signed, head = verify_entry(sealed, self.run_id, self.head)
            except LedgerError as e:
                raise SystemExit(
                    f"the contribution ledger {self.path} does not check at entry {len(self)} ({e}): restore it "
                    "from a backup; volunteers refuse a ledger that does not extend the one they saw"
                ) from None
            self._offsets.append(at)
            self._versions.append((signed.message.epoch, signed.message.version))
            self._heads.append(head)
            at = end
        self._size = at
        if at < len(data):
            logger.warning("ledger %s: cut off %d bytes of an entry a crash left unfinished", self.path, len(data) - at)
            self._truncate(at)

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())

    def append(self, sealed: bytes, entry: LedgerEntry | None = None) -> Head:
        """Check ``sealed`` extends the chain, write it and fsync; the new head. Blocks (run it in a thread).
        ``entry``: the entry the caller just built and sealed itself, whose signature and root need no check (at
        100,000 batches they were most of an append); only its link to the chain is checked. An append that failed
        part way (disk full) leaves bytes past the last whole entry: the next one writes over them."""
        with self._lock:
            if entry is None:
                signed, head = verify_entry(sealed, self.run_id, self.head)
                entry = signed.message
            else:
                head = extend(self.head, entry, sealed)
            offset = self._size
            with open(self.path, "r+b") as f:
                f.seek(offset)
                f.write(len(sealed).to_bytes(_LENGTH, "big") + sealed)
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
            self._offsets.append(offset)
            self._versions.append((entry.epoch, entry.version))
            self._heads.append(head)
            self._size = offset + _LENGTH + len(sealed)
            return head

    def drop_unpublished(self, epoch: int, published: int) -> int:
        """Cut the entries of ``epoch`` past version ``published`` (written, then the trainer died before it
        published them); how many were cut."""
        with self._lock:
            keep = len(self._versions)
            while keep and self._versions[keep - 1][0] == epoch and self._versions[keep - 1][1] > published:
                keep -= 1
            cut = len(self._versions) - keep
            if cut:
                self._truncate(self._offsets[keep])
                self._size = self._offsets[keep]
                del self._offsets[keep:], self._versions[keep:], self._heads[keep + 1 :]
                logger.warning("ledger: dropped %d entries of versions never published (past %d)", cut, published)
            return cut

    def read(self, first: int, count: int) -> list[bytes]:
        """Sealed entries ``first`` .. ``first + count - 1`` (fewer at the end)."""
        with self._lock:
            offsets = self._offsets[first : first + count]
        out = []
        with open(self.path, "rb") as f:
            for at in offsets:
                f.seek(at)
                size = int.from_bytes(f.read(_LENGTH), "big")
                out.append(f.read(size))
        return out

    def read_framed(self, first: int, count: int, max_bytes: int) -> bytes:
        """Entries from ``first``, at most ``count`` of them and ``max_bytes`` (but always the first), each after its
        length: the file's bytes as they are."""
        with self._lock:
            starts = self._offsets[first : first + count]
            ends = self._offsets[first + 1 : first + count + 1]
            if len(ends) < len(starts):
                ends.append(self._size)
        if not starts:
            return b""
        take = 1
        while take < len(starts) and ends[take] - starts[0] <= max_bytes:
            take += 1
        with open(self.path, "rb") as f:
            f.seek(starts[0])
            return f.read(ends[take - 1] - starts[0])

    def entry(self, index: int) -> LedgerEntry:
        (sealed,) = self.read(index, 1)
        return open_signed(sealed, LedgerEntry).message


@dataclass(frozen=True)
class StepRecord:
    """What one step consumed, for its ledger entry: the batches trained on, the batches refused for good since
    the step before (producer -> reason -> count), and the groups in packing order (credit index, slot)."""

    credits: list[BatchCredit]
    refusals: dict[str, dict[str, int]]
    groups: list[tuple[int, int]] = field(default_factory=list)
    dropped: list[tuple[str, str, str]] = field(default_factory=list)
    """Batches acknowledged and then dropped untrained since the step before: (producer, digest, reason)."""


def step_record(
    groups: Sequence[Group], refusals: dict[str, dict[str, int]], dropped: Sequence[tuple[str, str, str]] = ()
) -> StepRecord:
    """The entry of a step that trained ``groups`` (in this order): one credit per batch they came from, in the
    order the step met them (producer, digest, version, and the rollouts and completion tokens of it that were
    trained), and each group's place. Groups without a digest (made outside the door, as tests do) are not
    credited."""
    rows: dict[str, list[int]] = {}
    owner: dict[str, tuple[str, int]] = {}
    order: list[tuple[str, int]] = []
    for g in groups:
        if not g.digest:
            continue
        row = rows.setdefault(g.digest, [0, 0])
        owner.setdefault(g.digest, (g.node_id, g.version))
        row[0] += len(g.completions)
        row[1] += sum(len(c) for c in g.completions)
        order.append((g.digest, g.slot))
    index = {d: i for i, d in enumerate(rows)}
    credits = [BatchCredit(owner[d][0], d, owner[d][1], n, tokens) for d, (n, tokens) in rows.items()]
    return StepRecord(credits, refusals, [(index[d], slot) for d, slot in order], list(dropped))


def open_ledger(root: Path, run_id: str, epoch: int, published: int) -> LedgerLog | None:
    """The run's ledger, checked, cut back to ``published`` (the newest version of ``epoch`` this trainer holds), or
    None when it does not end there: entries are missing (the file was deleted, or the run began before the
    ledger) and the next entry would leave a gap that every volunteer refuses. Said loudly; the next epoch starts
    a ledger that checks again."""
    ledger = LedgerLog(root, run_id)
    ledger.drop_unpublished(epoch, published)
    head = ledger.head
    if (head.length and head.epoch == epoch and head.version == published) or (
        published <= 0 and (not head.length or head.epoch < epoch)
    ):
        return ledger
    logger.error(
        "the contribution ledger %s ends at epoch %d version %d, but this trainer published version %d of epoch %d: "
        "entries are missing, so no entries are written in this epoch (restore the file, or start a new epoch "
        "without --resume, to have one)",
        ledger.path,
        head.epoch,
        head.version,
        published,
        epoch,
    )
    return None


class LedgerRoutes:
    """``GET /ledger``: ``{"run_id", "length", "head", "epoch", "version", "enabled"}``. ``GET /ledger/entries?
    first=N&count=M``: sealed entries ``N..`` as ``application/octet-stream``, each after its length (4 bytes,
    big endian), the file's own framing; check them with ``protocol.ledger.verify_chain``."""

    def __init__(self, run_id: str, ledger: LedgerLog | None = None) -> None:
        self.run_id = run_id
        self.ledger = ledger
        self._reads = asyncio.Semaphore(READS_AT_ONCE)

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/ledger", self._head), web.get("/ledger/entries", self._entries)]

    async def _head(self, _request: web.Request) -> web.Response:
        ledger = self.ledger
        head = ledger.head if ledger is not None else start(self.run_id)
        return web.json_response(
            {
                "run_id": self.run_id,
                "enabled": ledger is not None,
                "length": head.length,
                "head": head.hash,
                "epoch": head.epoch,
                "version": head.version,
            }
        )

    async def _entries(self, request: web.Request) -> web.Response:
        ledger = self.ledger
        if ledger is None:
            raise web.HTTPNotFound(text="this trainer writes no contribution ledger in this epoch (see its log)")
        try:
            first = int(request.query.get("first", "0"))
            count = int(request.query.get("count", str(ENTRIES_MAX)))
        except ValueError:
            raise web.HTTPBadRequest(text="first and count are whole numbers") from None
        if first < 0 or count < 1:
            raise web.HTTPBadRequest(text="first >= 0 and count >= 1")
        if self._reads.locked():
            raise web.HTTPServiceUnavailable(text="too many ledger reads at once", headers={"Retry-After": "1"})
        async with self._reads:
            body = await asyncio.to_thread(ledger.read_framed, first, min(count, ENTRIES_MAX), RESPONSE_MAX_BYTES)
        return web.Response(body=body, content_type="application/octet-stream")


def parse_framed(body: bytes) -> list[bytes]:
    """The sealed entries of a ``GET /ledger/entries`` body (or a ledger file); ValueError when it is cut short."""
    out, at = [], 0
    while at < len(body):
        if at + _LENGTH > len(body):
            raise ValueError("a length cut short")
        size = int.from_bytes(body[at : at + _LENGTH], "big")
        if at + _LENGTH + size > len(body):
            raise ValueError("an entry cut short")
        out.append(body[at + _LENGTH : at + _LENGTH + size])
        at += _LENGTH + size
    return out
