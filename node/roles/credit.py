"""A volunteer's own account of its work, checked against the trainer's contribution ledger (protocol/ledger.py).

An inference node keeps a book of its batches in ``<data-dir>/credit/<run id>.jsonl`` (``CreditBook``): one line
when a batch is made (digest, epoch, version, index, rollouts, tokens), one when the trainer decides it
(acknowledged, or refused for good with the reason and the run key's signed reply itself, which names the batch's
digest), and where the trainer's HTTP server is (from its signed DHT record). Appends only, a few hundred bytes a
batch (a refusal about a kilobyte); a line torn by a crash is skipped when read.

``intellect-node credit --data-dir DIR`` (``report``) fetches the trainer's ledger, checks the whole chain with the
run id alone, and lists each batch of the book: trained (in which version, its Merkle inclusion proof checked
against the entry's root), refused (the reason, and whether the kept reply is the run key's signed refusal of that
very batch), acknowledged and then dropped untrained (an entry names the batch and why), acknowledged and not
trained yet, or acknowledged and never trained, dropped nor refused (lost), with totals per version.
Batches the ledger credits to this node id that the book never made mean another node uses this identity (a copy
of node.key): named, with the versions they were credited in.

A running inference node does the same every ``credit_check_s`` (``LedgerWatch``): it follows the ledger from where
it last checked (only new entries are fetched, each chained to the head checked before), and shows the account in
``/status`` (``credit``) and on its dashboard. A trainer that serves a history other than the one this node checked
(fewer entries, an entry that does not link, or a head other than its signed DHT record names) is reported as a
fork, and the book is kept as the evidence.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intellect_node.roles.trainer_ledger import parse_framed
from intellect_protocol.envelope import Rejected, open_signed
from intellect_protocol.ledger import (
    Head,
    LedgerEntry,
    inclusion_proof,
    leaf_hash,
    start,
    verify_chain,
    verify_entry,
    verify_inclusion,
)
from intellect_protocol.messages import RolloutBatch, SubmitReply

logger = logging.getLogger(__name__)
TRAINER_NOTE_S = 30.0
"""The trainer's address and ledger head are noted in the book at most this often (and whenever the address
changes)."""
FETCH_TIMEOUT_S = 30.0
PAGES_MAX = 100_000
"""Pages of ``GET /ledger/entries`` fetched at most (each at least one entry)."""
PAGES_PER_CHECK = 64
"""Pages a running node's check fetches at most (the rest at the next check): a long ledger is caught up in parts."""
BODY_MAX_BYTES = 16 << 20
"""Bytes of one answer read at most: a page is at most 8 MiB plus one entry (trainer_ledger.RESPONSE_MAX_BYTES)."""
HEADS_KEPT = 4096
SEALED_REPLY_MAX = 4096
"""A refusal's sealed reply the book keeps at most (a reply is a few hundred bytes)."""
"""Hashes of the chain at the last lengths checked, to compare with the head a newer signed record names."""


class CreditBook:
    """The inference node's side of the book (module docstring). Not thread-safe: the node's event loop writes."""

    def __init__(self, data_dir: Path, run_id: str) -> None:
        self.path = data_dir / "credit" / f"{run_id}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._noted: tuple[str, float] = ("", -TRAINER_NOTE_S)
        self.latest: tuple[str, tuple[int, str], int] | None = None
        """The trainer's address, the ledger head its signed record named last, and the run's async level."""

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

    def acknowledged(self, digest: str, sealed: bytes = b"") -> None:
        """An acknowledgement; ``sealed``: the trainer's signed reply naming this batch, kept as evidence (a gossip
        acknowledgement has none)."""
        line: dict[str, Any] = {"e": "ack", "d": digest, "at": round(time.time(), 3)}
        if sealed and len(sealed) <= SEALED_REPLY_MAX:
            line["signed"] = sealed.hex()
        self._write(line)

    def refused(self, digest: str, reason: str, detail: str, sealed: bytes = b"") -> None:
        """A refusal for good; ``sealed``: the trainer's signed reply, kept when it names this batch (the evidence
        ``intellect-node credit`` checks against the run key)."""
        line = {"e": "refused", "d": digest, "reason": reason, "detail": detail[:200], "at": round(time.time(), 3)}
        if sealed and len(sealed) <= SEALED_REPLY_MAX:
            line["signed"] = sealed.hex()
        self._write(line)

    def trainer(self, http_url: str | None, length: int, head: str, async_level: int) -> None:
        """Where the trainer serves its ledger, the head its signed record named, and the run's async level."""
        if not http_url:
            return
        self.latest = (http_url, (length, head), async_level)
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
    signed: bytes = b""
    """The decision's reply as the trainer sealed it (empty: not kept)."""


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
                batch.signed = bytes.fromhex(str(line.get("signed", ""))) or batch.signed
            elif kind == "refused":
                batch.outcome, batch.reason = "refused", str(line["reason"])
                batch.signed = bytes.fromhex(str(line.get("signed", "")))
        except (ValueError, KeyError, TypeError):
            book.torn += 1
    return book


BUSY_TRIES = 30
"""Answers 429 or 503 (the trainer's rate per address for public routes, its ledger readers at once) waited out
before a fetch fails, each as its Retry-After says (at most BUSY_WAIT_MAX_S)."""
BUSY_WAIT_MAX_S = 5.0


def get_bounded(url: str) -> bytes:
    """One answer of the trainer, at most BODY_MAX_BYTES (more is an error, not a reason to run out of memory); a
    trainer that says it is busy (429, 503) is asked again as it says, BUSY_TRIES times at most."""
    for tries in range(BUSY_TRIES + 1):
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as resp:
                body: bytes = resp.read(BODY_MAX_BYTES + 1)
            break
        except urllib.error.HTTPError as e:
            if e.code not in (429, 503) or tries == BUSY_TRIES:
                raise
            wait = retry_after(e.headers.get("Retry-After"))
            e.close()
            time.sleep(wait)
    if len(body) > BODY_MAX_BYTES:
        raise ValueError(f"{url} answered more than {BODY_MAX_BYTES} bytes")
    return body


def retry_after(header: str | None) -> float:
    """A busy answer's Retry-After in seconds, within 0.1 and BUSY_WAIT_MAX_S (1 when it says nothing usable)."""
    try:
        return min(BUSY_WAIT_MAX_S, max(0.1, float(header or "1")))
    except ValueError:
        return 1.0


def ledger_head(url: str, run_id: str) -> dict[str, Any]:
    head = json.loads(get_bounded(url.rstrip("/") + "/ledger"))
    if not isinstance(head, dict) or head.get("run_id") != run_id:
        raise ValueError(f"{url} does not serve the ledger of run {run_id}")
    if not isinstance(head.get("length"), int) or not isinstance(head.get("head"), str):
        raise ValueError(f"{url}/ledger: a head without a length and hash")
    return head


def fetch_ledger(url: str, run_id: str) -> list[bytes]:
    """Every sealed entry the trainer at ``url`` serves, the chain checked with ``run_id`` alone; ValueError (or
    LedgerError) when it does not check or is shorter than the head the trainer names."""
    head = ledger_head(url, run_id)
    sealed: list[bytes] = []
    for _ in range(PAGES_MAX):
        page = parse_framed(get_bounded(f"{url.rstrip('/')}/ledger/entries?first={len(sealed)}"))
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
    """Each batch of the book with its state: trained, refused, dropped, acknowledged, lost or unanswered."""
    trained_in: dict[str, int]
    """Digest -> the version whose entry credits it."""
    twins: dict[int, int]
    """Version -> batches credited to this node id that this book never made."""
    entries: int
    signed_refusals: int = 0
    """Refused batches whose book line keeps the trainer's reply, signed by the run key and naming the batch."""
    signed_lost: int = 0
    """Lost batches (acknowledged, never trained, dropped nor refused) whose acknowledgement the book keeps, signed
    by the run key and naming the batch: the evidence that the trainer took them."""

    def counts(self) -> Counter[str]:
        return Counter(state for _, state in self.rows)

    def refused_by_reason(self) -> Counter[str]:
        return Counter(b.reason for b, state in self.rows if state == "refused")

    def dropped_by_reason(self) -> Counter[str]:
        return Counter(b.reason for b, state in self.rows if state == "dropped")


@dataclass
class Tally:
    """What a checked ledger says of one node, taken entry by entry (``add``): its credits (each inclusion proof
    checked against its entry's root) and the newest version per epoch. Only this node's credits are kept."""

    node_id: str
    ours: dict[str, int] = field(default_factory=dict)
    """Digest -> the version whose entry credits it to this node id."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Digest -> why the trainer dropped this node's acknowledged batch untrained (the entry that says so)."""
    newest: dict[int, int] = field(default_factory=dict)
    entries: int = 0

    def add(self, entry: LedgerEntry) -> None:
        self.entries += 1
        self.newest[entry.epoch] = max(self.newest.get(entry.epoch, 0), entry.version)
        for producer, digest, reason in entry.drops():
            if producer == self.node_id:
                self.dropped[digest] = reason
        credits = entry.credits()
        if not any(c.producer == self.node_id for c in credits):
            return
        leaves = [leaf_hash(c) for c in credits]
        root = bytes.fromhex(entry.root)
        for i, credit in enumerate(credits):
            if credit.producer != self.node_id:
                continue
            if not verify_inclusion(leaves[i], i, len(leaves), inclusion_proof(leaves, i), root):
                raise ValueError(
                    f"the credit of {credit.digest[:16]}... does not prove its place in version {entry.version}"
                )
            self.ours[credit.digest] = entry.version

    def credit(self, run_id: str, book: Book, async_level: int = 2) -> Credit:
        """The book against what was taken: each batch's state; credits of batches the book never made are a
        twin's (read the book after the entries: a batch is in the book before it can be trained)."""
        trained_in = {d: v for d, v in self.ours.items() if d in book.batches}
        twins = Counter(v for d, v in self.ours.items() if d not in book.batches)
        rows = []
        for batch in book.batches.values():
            if batch.digest in trained_in:
                state = "trained"
            elif batch.outcome == "refused":
                state = "refused"
            elif batch.digest in self.dropped:
                state = "dropped"
                batch.reason = self.dropped[batch.digest]
            elif batch.outcome == "acknowledged":
                # trained at the latest by the step async_level after its version, and that step's entry came after
                too_old = self.newest.get(batch.epoch, -1) > batch.version + async_level + 1
                state = "lost" if too_old else "acknowledged"
            else:
                state = "unanswered"
            rows.append((batch, state))
        signed = sum(1 for b, state in rows if state == "refused" and signed_reply(b, run_id, ok=False))
        lost = sum(1 for b, state in rows if state == "lost" and signed_reply(b, run_id, ok=True))
        return Credit(self.node_id, run_id, rows, trained_in, dict(twins), self.entries, signed, lost)


def signed_reply(batch: Batch, run_id: str, ok: bool) -> bool:
    """Whether ``batch``'s kept reply is the run key's acceptance (``ok``) or refusal (for the reason the book says)
    of this very batch."""
    if not batch.signed:
        return False
    try:
        signed = open_signed(batch.signed, SubmitReply)
    except Rejected:
        return False
    reply = signed.message
    same = reply.ok if ok else not reply.ok and reply.reason == batch.reason
    return bool(signed.signer_id == run_id and reply.digest == batch.digest and same)


def account(node_id: str, run_id: str, book: Book, sealed: list[bytes], async_level: int = 2) -> Credit:
    """The book against the checked ledger (``sealed``): each batch's state, each credit's inclusion proof checked
    against its entry's root."""
    tally = Tally(node_id)
    for s in sealed:
        tally.add(open_signed(s, LedgerEntry).message)
    return tally.credit(run_id, book, async_level)


class LedgerFork(ValueError):
    """The trainer serves a history other than the one this node checked before or its signed record names."""


class LedgerWatch:
    """A running inference node's credit (module docstring): ``check`` (blocking: run it in a thread) follows the
    trainer's ledger from the head checked last and refreshes ``summary``, what ``/status`` shows as ``credit``."""

    def __init__(self, node_id: str, run_id: str, book_path: Path) -> None:
        self.run_id = run_id
        self.book_path = book_path
        self.tally = Tally(node_id)
        self.head: Head = start(run_id)
        self._hashes: OrderedDict[int, str] = OrderedDict({0: self.head.hash})
        self.summary: dict[str, Any] = {"checked_at": 0.0, "ledger_entries": 0, "error": ""}

    def _take(self, sealed: bytes) -> None:
        signed, self.head = verify_entry(sealed, self.run_id, self.head)  # a rewrite fails the link: LedgerError
        self.tally.add(signed.message)
        self._hashes[self.head.length] = self.head.hash
        while len(self._hashes) > HEADS_KEPT:
            self._hashes.popitem(last=False)

    def check(self, url: str, named: tuple[int, str], async_level: int) -> dict[str, Any]:
        """Fetch and check the entries past the head checked last (at most PAGES_PER_CHECK pages), compare with the
        head the trainer's signed record ``named`` (length, hash), and account the book. Raises (LedgerFork,
        LedgerError, ValueError, OSError) with ``summary`` keeping what the last good check found."""
        served = int(ledger_head(url, self.run_id)["length"])
        if served < self.head.length:
            raise LedgerFork(
                f"the trainer serves {served} ledger entries, fewer than the {self.head.length} this node checked"
            )
        for _ in range(PAGES_PER_CHECK):
            if self.head.length >= served:
                break
            page = parse_framed(get_bounded(f"{url.rstrip('/')}/ledger/entries?first={self.head.length}"))
            if not page:
                break
            for sealed in page:
                self._take(sealed)
        length, head = named
        known = self._hashes.get(length)
        if head and known is not None and known != head:
            raise LedgerFork(
                f"the trainer's signed record names a ledger of {length} entries ending {head[:16]}..., and it "
                f"served one ending {known[:16]}... there"
            )
        credit = self.tally.credit(self.run_id, read_book(self.book_path), async_level)
        counts = credit.counts()
        trained = [b for b, state in credit.rows if state == "trained"]
        self.summary = {
            "checked_at": round(time.time(), 3),
            "ledger_entries": credit.entries,
            "batches": len(credit.rows),
            **{state: counts.get(state, 0) for state in STATES},
            "trained_rollouts": sum(b.rollouts for b in trained),
            "trained_tokens": sum(b.tokens for b in trained),
            "refused_by_reason": dict(credit.refused_by_reason()),
            "refused_signed": credit.signed_refusals,
            "lost_signed": credit.signed_lost,
            "dropped_by_reason": dict(credit.dropped_by_reason()),
            "twin_batches": sum(credit.twins.values()),
            "error": "",
        }
        return self.summary

    def failed(self, error: Exception) -> None:
        """A check that did not complete: ``summary`` keeps the last good figures and says why."""
        self.summary = {**self.summary, "error": f"{type(error).__name__}: {error}"[:300]}


STATES = {
    "trained": "trained (in the ledger, inclusion proof checked)",
    "refused": "refused by the trainer",
    "dropped": "acknowledged, then dropped untrained (the ledger says why)",
    "acknowledged": "acknowledged, not trained yet",
    "lost": "acknowledged, never trained, dropped nor refused",
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
    reasons = credit.refused_by_reason()
    if reasons:
        lines.append(
            "  refused, by reason: "
            + ", ".join(f"{r} {n}" for r, n in reasons.most_common())
            + f" ({credit.signed_refusals} of them with the trainer's signed reply naming the batch, kept in the book)"
        )
    if credit.signed_lost:
        lines.append(
            f"  {credit.signed_lost} of the lost with the trainer's signed acknowledgement naming the batch, kept in "
            "the book: the evidence that it took them"
        )
    dropped = credit.dropped_by_reason()
    if dropped:
        lines.append("  dropped, by reason: " + ", ".join(f"{r} {n}" for r, n in dropped.most_common()))
    if credit.twins:
        versions = ", ".join(str(v) for v in sorted(credit.twins))
        lines.append(
            f"  ANOTHER NODE USES THIS IDENTITY: {sum(credit.twins.values())} batches credited to {credit.node_id} "
            f"were not made from this data dir (versions {versions}); stop the other copy of node.key, or give one "
            "of them a new data dir"
        )
    lines.append(
        f"credit node={credit.node_id} batches={len(credit.rows)} trained={counts.get('trained', 0)} "
        f"refused={counts.get('refused', 0)} dropped={counts.get('dropped', 0)} "
        f"acknowledged={counts.get('acknowledged', 0)} "
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
