"""A volunteer's own account of its work, checked against the trainer's contribution ledger (protocol/ledger.py).

An inference node keeps a book of its batches in ``<data-dir>/credit/<run id>.jsonl`` (``CreditBook``): one line
when a batch is made (digest, epoch, version, index, rollouts, tokens), one when the trainer decides it
(acknowledged, or refused for good with the reason from the run key's signed reply), and where the trainer's HTTP
server is (from its signed DHT record). Appends only, a few hundred bytes a batch; a line torn by a crash is
skipped when read.

``intellect-node credit --data-dir DIR`` (``report``) fetches the trainer's ledger, checks the whole chain with the
run id alone, and lists each batch of the book: trained (in which version, its Merkle inclusion proof checked
against the entry's root), refused (the reason), acknowledged and not trained yet, or acknowledged and never
trained nor refused (too old to be trained any more: dropped after acceptance, or lost), with totals per version.
Batches the ledger credits to this node id that the book never made mean another node uses this identity (a copy
of node.key): named, with the versions they were credited in.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intellect_node.roles.trainer_ledger import parse_framed
from intellect_protocol.envelope import open_signed
from intellect_protocol.ledger import LedgerEntry, inclusion_proof, leaf_hash, verify_chain, verify_inclusion
from intellect_protocol.messages import RolloutBatch

logger = logging.getLogger(__name__)
TRAINER_NOTE_S = 30.0
"""The trainer's address and ledger head are noted in the book at most this often (and whenever the address
changes)."""
FETCH_TIMEOUT_S = 30.0
PAGES_MAX = 100_000
"""Pages of ``GET /ledger/entries`` fetched at most (each at least one entry)."""


class CreditBook:
    """The inference node's side of the book (module docstring). Not thread-safe: the node's event loop writes."""

    def __init__(self, data_dir: Path, run_id: str) -> None:
        self.path = data_dir / "credit" / f"{run_id}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._noted: tuple[str, float] = ("", -TRAINER_NOTE_S)

    def _write(self, line: dict[str, Any]) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as e:  # a full disk: the book is the volunteer's own record, the run goes on without it
            logger.warning("could not write to the credit book %s: %r", self.path, e)

    def made(self, batch: RolloutBatch, digest: str) -> None:
        rollouts = sum(len(g.completions) for g in batch.groups)
        tokens = sum(len(c) for g in batch.groups for c in g.completions)
        self._write(
            {
                "e": "made",
                "d": digest,
                "epoch": batch.epoch,
                "version": batch.version,
                "index": batch.batch_index,
                "rollouts": rollouts,
                "tokens": tokens,
                "at": round(time.time(), 3),
            }
        )

    def made_before(self, count: int) -> list[str]:
        """The digests of the last ``count`` batches the book records as made (by this node's earlier lives)."""
        if not self.path.exists():
            return []
        return [d for d, b in read_book(self.path).batches.items() if b.rollouts][-count:]

    def acknowledged(self, digest: str) -> None:
        self._write({"e": "ack", "d": digest, "at": round(time.time(), 3)})

    def refused(self, digest: str, reason: str, detail: str) -> None:
        self._write(
            {"e": "refused", "d": digest, "reason": reason, "detail": detail[:200], "at": round(time.time(), 3)}
        )

    def trainer(self, http_url: str | None, length: int, head: str, async_level: int) -> None:
        """Where the trainer serves its ledger, the head its signed record named, and the run's async level."""
        if not http_url:
            return
        url, at = self._noted
        if url == http_url and time.monotonic() - at < TRAINER_NOTE_S:
            return
        self._noted = (http_url, time.monotonic())
        line = {"e": "trainer", "url": http_url, "length": length, "head": head, "async_level": async_level}
        self._write({**line, "at": round(time.time(), 3)})


@dataclass
class Batch:
    digest: str
    epoch: int = 0
    version: int = 0
    index: int = 0
    rollouts: int = 0
    tokens: int = 0
    outcome: str = ""
    """``acknowledged``, ``refused`` or "" (no decision received)."""
    reason: str = ""


@dataclass
class Book:
    batches: dict[str, Batch] = field(default_factory=dict)
    trainer_url: str = ""
    head: tuple[int, str] = (0, "")
    """The ledger length and head the trainer's signed record named, last noted."""
    async_level: int = 2
    torn: int = 0


def read_book(path: Path) -> Book:
    """Fold a credit book's lines; a line that does not parse (torn by a crash) is counted and skipped."""
    book = Book()
    for raw in path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
            kind = line["e"]
            if kind == "trainer":
                book.trainer_url = str(line["url"])
                book.head = (int(line["length"]), str(line["head"]))
                book.async_level = int(line["async_level"])
                continue
            digest = str(line["d"])
            batch = book.batches.setdefault(digest, Batch(digest))
            if kind == "made":
                batch.epoch, batch.version, batch.index = int(line["epoch"]), int(line["version"]), int(line["index"])
                batch.rollouts, batch.tokens = int(line["rollouts"]), int(line["tokens"])
            elif kind == "ack":
                batch.outcome = "acknowledged"
            elif kind == "refused":
                batch.outcome, batch.reason = "refused", str(line["reason"])
        except (ValueError, KeyError, TypeError):
            book.torn += 1
    return book


def fetch_ledger(url: str, run_id: str) -> list[bytes]:
    """Every sealed entry the trainer at ``url`` serves, the chain checked with ``run_id`` alone; ValueError (or
    LedgerError) when it does not check or is shorter than the head the trainer names."""
    with urllib.request.urlopen(url.rstrip("/") + "/ledger", timeout=FETCH_TIMEOUT_S) as resp:
        head = json.load(resp)
    if head.get("run_id") != run_id:
        raise ValueError(f"{url} serves the ledger of run {head.get('run_id')}, not {run_id}")
    sealed: list[bytes] = []
    for _ in range(PAGES_MAX):
        with urllib.request.urlopen(
            f"{url.rstrip('/')}/ledger/entries?first={len(sealed)}", timeout=FETCH_TIMEOUT_S
        ) as resp:
            page = parse_framed(resp.read())
        if not page:
            break
        sealed += page
    named = int(head["length"])
    if len(sealed) < named or verify_chain(sealed[:named], run_id).hash != head["head"]:
        raise ValueError(f"the trainer names {named} entries ending {str(head['head'])[:16]}..., and served others")
    verify_chain(sealed, run_id)
    return sealed


def agrees(sealed: list[bytes], run_id: str, length: int, head: str) -> bool:
    """Whether the chain's first ``length`` entries end in ``head`` (what the trainer's signed DHT record named):
    False is a fork, the trainer showing this node a history other than the one it announced."""
    return length > len(sealed) or verify_chain(sealed[:length], run_id).hash == head


@dataclass
class Credit:
    """What ``report`` found, as numbers (the text is for people)."""

    node_id: str
    run_id: str
    rows: list[tuple[Batch, str]]
    """Each batch of the book with its state: trained, refused, acknowledged, lost or unanswered."""
    trained_in: dict[str, int]
    """Digest -> the version whose entry credits it."""
    twins: dict[int, int]
    """Version -> batches credited to this node id that this book never made."""
    entries: int

    def counts(self) -> Counter[str]:
        return Counter(state for _, state in self.rows)


def account(node_id: str, run_id: str, book: Book, sealed: list[bytes], async_level: int = 2) -> Credit:
    """The book against the checked ledger (``sealed``): each batch's state, each credit's inclusion proof checked
    against its entry's root."""
    entries = [open_signed(s, LedgerEntry).message for s in sealed]
    trained_in: dict[str, int] = {}
    twins: Counter[int] = Counter()
    newest: dict[int, int] = {}
    for entry in entries:
        newest[entry.epoch] = max(newest.get(entry.epoch, 0), entry.version)
        credits = entry.credits()
        leaves = [leaf_hash(c) for c in credits]
        root = bytes.fromhex(entry.root)
        for i, credit in enumerate(credits):
            if credit.producer != node_id:
                continue
            if not verify_inclusion(leaves[i], i, len(leaves), inclusion_proof(leaves, i), root):
                raise ValueError(
                    f"the credit of {credit.digest[:16]}... does not prove its place in version {entry.version}"
                )
            if credit.digest in book.batches:
                trained_in[credit.digest] = entry.version
            else:
                twins[entry.version] += 1
    rows = []
    for batch in book.batches.values():
        if batch.digest in trained_in:
            state = "trained"
        elif batch.outcome == "refused":
            state = "refused"
        elif batch.outcome == "acknowledged":
            # trained at the latest by the step async_level after its version, and that step's entry came after
            too_old = newest.get(batch.epoch, -1) > batch.version + async_level + 1
            state = "lost" if too_old else "acknowledged"
        else:
            state = "unanswered"
        rows.append((batch, state))
    return Credit(node_id, run_id, rows, trained_in, dict(twins), len(entries))


STATES = {
    "trained": "trained (in the ledger, inclusion proof checked)",
    "refused": "refused by the trainer",
    "acknowledged": "acknowledged, not trained yet",
    "lost": "acknowledged, never trained nor refused",
    "unanswered": "no decision received (sent again, or given up as stale)",
}


def render(credit: Credit) -> str:
    counts = credit.counts()
    lines = [f"credit for node {credit.node_id} in run {credit.run_id}: ledger of {credit.entries} entries checked"]
    by_version: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    for batch, state in credit.rows:
        by_version[(batch.epoch, batch.version)][state] += 1
    if by_version:
        lines.append(f"{'epoch':>18} {'version':>7}  " + " ".join(f"{s:>12}" for s in STATES))
        for (epoch, version), c in sorted(by_version.items()):
            lines.append(f"{epoch:>18} {version:>7}  " + " ".join(f"{c.get(s, 0):>12}" for s in STATES))
    for state, words in STATES.items():
        if counts.get(state):
            lines.append(f"  {counts[state]:>6} {words}")
    reasons = Counter(b.reason for b, state in credit.rows if state == "refused")
    if reasons:
        lines.append("  refused, by reason: " + ", ".join(f"{r} {n}" for r, n in reasons.most_common()))
    if credit.twins:
        versions = ", ".join(str(v) for v in sorted(credit.twins))
        lines.append(
            f"  ANOTHER NODE USES THIS IDENTITY: {sum(credit.twins.values())} batches credited to {credit.node_id} "
            f"were not made from this data dir (versions {versions}); stop the other copy of node.key, or give one "
            "of them a new data dir"
        )
    lines.append(
        f"credit node={credit.node_id} batches={len(credit.rows)} trained={counts.get('trained', 0)} "
        f"refused={counts.get('refused', 0)} acknowledged={counts.get('acknowledged', 0)} "
        f"lost={counts.get('lost', 0)} twin_batches={sum(credit.twins.values())}"
    )
    return "\n".join(lines)


def report(data_dir: Path, run_id: str | None = None, trainer_url: str | None = None) -> int:
    """``intellect-node credit`` (module docstring): prints the account; exit status 1 when the ledger does not
    check or cannot be read, 0 otherwise."""
    from intellect_node.p2p.keys import load_or_create

    books = sorted((data_dir / "credit").glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    if run_id is not None:
        books = [p for p in books if p.stem == run_id]
    if not books:
        print(
            f"intellect-node credit: no credit book under {data_dir / 'credit'}"
            + (f" for run {run_id}" if run_id else "")
            + ": an inference node keeps one there once it makes batches (check --data-dir)"
        )
        return 1
    path = books[-1]
    run = path.stem
    book = read_book(path)
    url = trainer_url or book.trainer_url
    if not url:
        print(f"intellect-node credit: the book for run {run} names no trainer address yet; pass --trainer-url")
        return 1
    key = data_dir / "node.key"
    if not key.exists():
        print(f"intellect-node credit: no node.key in {data_dir}: pass the inference node's --data-dir")
        return 1
    node_id = load_or_create(key).node_id
    try:
        sealed = fetch_ledger(url, run)
    except Exception as e:
        print(f"intellect-node credit: the trainer's ledger at {url} could not be read or does not check: {e}")
        return 1
    if book.head[1] and not agrees(sealed, run, *book.head):
        print(
            f"intellect-node credit: FORK: the trainer's signed DHT record named a ledger of {book.head[0]} entries "
            f"ending {book.head[1][:16]}...; the one it serves differs there. Keep {path}: it is the evidence"
        )
        return 1
    print(render(account(node_id, run, book, sealed, book.async_level)))
    return 0
