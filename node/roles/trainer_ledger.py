"""The trainer's contribution ledger on disk (the entries' format: protocol/ledger.py).

``<data-dir>/ledger/<run id>.log`` holds the sealed entries in order, each after its length (4 bytes, big
endian). An entry is appended and fsynced before the version it describes is published, as a checkpoint is, so a
published version always has its entry. At start the whole file is checked with the run id (``verify_chain``); a
record cut short by a crash during the append is cut off (its version was not published), and so are entries a
previous life wrote for versions it never published (the step is done again and gets an entry of its own). A
file that does not check stops the trainer, saying what to do: volunteers would refuse the chain.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from intellect_protocol.envelope import open_signed
from intellect_protocol.ledger import Head, LedgerEntry, LedgerError, start, verify_entry

logger = logging.getLogger(__name__)

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
        if at < len(data):
            logger.warning("ledger %s: cut off %d bytes of an entry a crash left unfinished", self.path, len(data) - at)
            self._truncate(at)

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())

    def append(self, sealed: bytes) -> Head:
        """Check ``sealed`` extends the chain, write it and fsync; the new head. Blocks (run it in a thread)."""
        with self._lock:
            signed, head = verify_entry(sealed, self.run_id, self.head)
            with open(self.path, "ab") as f:
                offset = f.tell()
                f.write(len(sealed).to_bytes(_LENGTH, "big") + sealed)
                f.flush()
                os.fsync(f.fileno())
            self._offsets.append(offset)
            self._versions.append((signed.message.epoch, signed.message.version))
            self._heads.append(head)
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

    def entry(self, index: int) -> LedgerEntry:
        (sealed,) = self.read(index, 1)
        return open_signed(sealed, LedgerEntry).message
