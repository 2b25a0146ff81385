"""The auditor role: replay a sampled training step over the network and check the weights the trainer published.

``intellect-node join --role auditor --peers ... --run-id ...`` follows the run's weights like a relay (and relays
them, unless ``--no-relay``). Every ``audit_every_s`` it picks the newest step it can replay and checks it the way
``intellect-node audit`` does on the trainer's own disk (node/roles/audit.py), from what anyone can check with the
run id alone:

1. the trainer's contribution ledger (``GET /ledger/entries``), followed from the head it checked last, each entry
   checked with the run id (signature, link, Merkle root), and compared with the head the trainer's signed DHT
   record names (a trainer that shows us a history other than the one it announces is a fork);
2. the published version the step produced, as this node fetched it through the relay tree (its manifest signed
   by the run key; the entry must name its digest);
3. the checkpoint the step started from (``GET /audit/checkpoint/<parent>``, node/roles/trainer_audit.py),
   checked against the SHA-256 the parent version's entry committed to when it was written: the trainer cannot
   swap in another starting state (an optimizer state made to cover a dishonest step) after the fact;
4. the batches the entry credits: those the checkpoint still held, and those spooled after it
   (``GET /audit/spool/<parent>``), each kept only if its SHA-256 is one the entry names and its producer's
   signature holds.

It then recomputes every reward, runs the trainer's own step function on ``threads`` CPU threads and compares
(``audit.AUDIT_TOLERANCE``). A finding (``honest`` or ``caught``, with the reason) is logged, printed as an
``AUDIT`` line, counted (``node_audits_total``) and shown in ``/status`` (``audits``); a step that cannot be
replayed here (the trainer no longer holds the checkpoint, a download failed) is counted by reason and the next
round tries again. Findings stay on this node: they are not gossiped (another node would have to trust us).

What one audit costs this node: a download of one checkpoint (the engine's fp32 weights and optimizer, about 12
bytes a parameter; 1.6 GB for SmolLM2-135M trained in full) and of one spool, and one training step on its CPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from intellect_node.aio import Backoff
from intellect_node.roles.audit import (
    AuditError,
    AuditFinding,
    AuditResult,
    assemble,
    engine_of,
    load_state,
    parent_entry,
    verdict,
)
from intellect_node.roles.credit import BODY_MAX_BYTES, BUSY_TRIES, LedgerFork, retry_after
from intellect_node.roles.relay_node import RelayNode
from intellect_node.roles.trainer_ledger import parse_framed
from intellect_node.weights.auth import server_clock_offset, signed_headers
from intellect_node.weights.files import load_checkpoint
from intellect_node.weights.store import WeightStore
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import Head, LedgerEntry, LedgerError, start, verify_entry
from intellect_protocol.messages import Role, RunSpec

logger = logging.getLogger(__name__)
T = TypeVar("T")
ENTRIES_KEPT = 64
"""Newest ledger entries an auditor keeps (it replays recent steps: the trainer holds its last two checkpoints)."""
PAGES_PER_ROUND = 64
"""Ledger pages fetched at most per round (a long ledger is followed over several rounds)."""
SPOOL_MAX_BYTES = 1 << 30
STATE_SLACK_BYTES = 1 << 30
"""A checkpoint may be at most 16 bytes per published parameter (fp32 weights, two optimizer moments, slack) plus
this (the batches it still held): past it the download stops."""
ENVELOPE_MAX = 64 << 20
FIRST_AUDIT_S = 5.0
"""After the node is ready, the first round comes this soon (then every ``audit_every_s``)."""
CHUNK = 1 << 20
FETCH_S = 30.0
DOWNLOAD_GRACE_S = 60.0
DOWNLOAD_MIN_BPS = 1_000_000
"""A download must end within its limit's size at this rate, plus the grace: a trainer that trickles bytes cannot
hold an auditor for ever."""


class ChainFollower:
    """The trainer's ledger, checked entry by entry from the genesis with the run id, the newest kept."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.head: Head = start(run_id)
        self.entries: deque[LedgerEntry] = deque(maxlen=ENTRIES_KEPT)
        self.hashes: dict[int, str] = {0: self.head.hash}
        """Hash of the chain at each recent length (the newest 4 x ENTRIES_KEPT)."""
        self.named: dict[int, str] = {}
        """Heads the trainer's signed record named beyond what was served then: checked once the chain reaches them."""

    async def catch_up(self, session: aiohttp.ClientSession, url: str, named: tuple[int, str] | None) -> None:
        """Fetch and check the entries past the head checked last. LedgerError on an
        entry that does not check (the reason names it), LedgerFork on a history other than the one checked before
        or the trainer's signed record ``named`` (length, head)."""
        head = json.loads(await fetch(session, url.rstrip("/") + "/ledger"))
        if not isinstance(head, dict) or head.get("run_id") != self.run_id or not isinstance(head.get("length"), int):
            raise ValueError(f"{url} does not serve the ledger of run {self.run_id}")
        served = int(head["length"])
        if served < self.head.length:
            raise LedgerFork(f"the trainer serves {served} entries, fewer than the {self.head.length} checked here")
        for _ in range(PAGES_PER_ROUND):
            if self.head.length >= served:
                break
            page = parse_framed(await fetch(session, f"{url.rstrip('/')}/ledger/entries?first={self.head.length}"))
            if not page:
                break
            for sealed in page:
                signed, self.head = verify_entry(sealed, self.run_id, self.head)
                self.entries.append(signed.message)
                self.hashes[self.head.length] = self.head.hash
                if len(self.hashes) > 4 * ENTRIES_KEPT:
                    self.hashes.pop(min(self.hashes))
        if named is not None and named[1]:
            self.named[named[0]] = named[1]
            while len(self.named) > ENTRIES_KEPT:
                self.named.pop(min(self.named))
        for length in [n for n in self.named if n <= self.head.length]:  # heads the trainer named, once reached
            head = self.named.pop(length)
            known = self.hashes.get(length)
            if known is not None and known != head:
                raise LedgerFork(
                    f"the trainer's signed record named a ledger of {length} entries ending {head[:16]}..., and it "
                    f"served one ending {known[:16]}..."
                )


class _Busy(Exception):
    """A try the trainer answered busy: ``wait`` seconds, then again; ``final`` is raised when no try is left."""

    def __init__(self, wait: float, final: Exception) -> None:
        super().__init__(f"busy; again in {wait:.1f} s")
        self.wait, self.final = wait, final


async def _busy_retried(attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()``, again after each ``_Busy`` as it says, BUSY_TRIES times at most."""
    for _ in range(BUSY_TRIES):
        try:
            return await attempt()
        except _Busy as e:
            await asyncio.sleep(e.wait)
    try:
        return await attempt()
    except _Busy as e:
        raise e.final from None


async def fetch(session: aiohttp.ClientSession, url: str) -> bytes:
    """One small answer of the trainer (the ledger, a page of entries, the audit index): at most BODY_MAX_BYTES,
    each try within FETCH_S (a trainer that trickles bytes cannot hold the auditor); a busy answer (429, 503) is
    asked again as its Retry-After says (at most BUSY_WAIT_MAX_S), BUSY_TRIES times at most."""

    async def once() -> bytes:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=FETCH_S)) as resp:
            if resp.status != 200:
                refused = ValueError(f"{url} answered {resp.status}")
                if resp.status in (429, 503):
                    raise _Busy(retry_after(resp.headers.get("Retry-After")), refused)
                raise refused
            chunks, size = [], 0
            async for chunk in resp.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > BODY_MAX_BYTES:
                    raise ValueError(f"{url} answered more than {BODY_MAX_BYTES} bytes")
                chunks.append(chunk)
        return b"".join(chunks)

    return await _busy_retried(once)


def _spooled(data: bytes) -> list[bytes]:
    """The whole records of a spool file (a torn last record, from a crash mid-append, is left out)."""
    out, at = [], 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        if size > ENVELOPE_MAX or at + 4 + size > len(data):
            break
        out.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return out


class RemoteAudit:
    """One auditor's rounds against a trainer's HTTP server (module docstring, steps 1-4 and the replay), with the
    published versions of ``store`` (what the node fetched through the relay tree)."""

    def __init__(self, identity: Identity, run_id: str, store: WeightStore, workdir: Path, threads: int) -> None:
        self.identity = identity
        self.run_id = run_id
        self.store = store
        self.workdir = workdir
        self.threads = threads
        self.chain = ChainFollower(run_id)
        self.audited: set[tuple[int, int]] = set()
        """(epoch, version) already replayed."""
        self.spec: RunSpec | None = None
        """The run spec this node follows (signed by the run key): a replay takes the task, seed and model from it,
        never from the trainer's checkpoint (which must name the same)."""
        self._clock_offset = 0.0

    def candidate(self, held: list[int]) -> tuple[LedgerEntry, LedgerEntry]:
        """The newest entry (and its parent's) this node can replay: its version held here, not replayed yet, its
        parent's checkpoint held by the trainer (``held``) and committed to by the parent's entry."""
        entries = list(self.chain.entries)
        have = set(self.store.complete_versions())
        for entry in reversed(entries):
            if entry.epoch != self.store.epoch or (entry.epoch, entry.version) in self.audited:
                continue
            before = parent_entry(entries, entry)
            if entry.weights and entry.version in have and entry.parent in held and before and before.state:
                return entry, before
        raise AuditError("nothing_new", f"no step to replay yet (checkpoints held by the trainer: {held})")

    async def download(self, session: aiohttp.ClientSession, url: str, path: str, to: Path, limit: int) -> str:
        """GET ``path`` signed with this node's key into ``to``; returns the body's SHA-256 (hex). AuditError
        past ``limit`` bytes or on a refusal; the trainer's rate per address (a 429 saying ``rate``) is waited out,
        BUSY_TRIES times at most (this key's own limits, one download at a time and so many an hour, are not)."""
        return await _busy_retried(lambda: self._download_once(session, url, path, to, limit))

    async def _download_once(self, session: aiohttp.ClientSession, url: str, path: str, to: Path, limit: int) -> str:
        headers = signed_headers(self.identity, "GET", path, self.run_id, self._clock_offset)  # a fresh nonce each
        digest, size = hashlib.sha256(), 0
        timeout = aiohttp.ClientTimeout(total=DOWNLOAD_GRACE_S + limit / DOWNLOAD_MIN_BPS, sock_read=60)
        async with session.get(url.rstrip("/") + path, headers=headers, timeout=timeout) as resp:
            offset = server_clock_offset(resp.headers.get("Date"))
            if offset is not None:
                self._clock_offset = offset
            if resp.status != 200:
                text = (await resp.content.read(500)).decode(errors="replace")
                refused = AuditError("not_held" if resp.status == 404 else f"http_{resp.status}", f"{path}: {text}")
                if resp.status == 429 and '"rate"' in text:  # the public routes' rate, not this key's own limits
                    raise _Busy(retry_after(resp.headers.get("Retry-After")), refused)
                raise refused
            if resp.content_length is not None and resp.content_length > limit:
                raise AuditError("too_large", f"{path} is {resp.content_length} bytes, more than {limit}")
            with open(to, "wb") as f:
                async for chunk in resp.content.iter_chunked(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise AuditError("too_large", f"{path} is more than {limit} bytes")
                    digest.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
        return digest.hexdigest()

    async def committed(self, session: aiohttp.ClientSession, url: str, step: int, committed: str, limit: int) -> Path:
        """The trainer's checkpoint of ``step`` downloaded into the work dir, its SHA-256 checked (as it arrives)
        against what the ledger committed to; AuditFinding ``state`` when it is another file."""
        path = self.workdir / f"step-{step:08d}.pt"
        got = await self.download(session, url, f"/audit/checkpoint/{step}", path, limit)
        if got != committed:
            raise AuditFinding(
                "state",
                f"the trainer served a checkpoint of step {step} other than the one its ledger committed to "
                f"(SHA-256 {got[:16]}..., the entry names {committed[:16]}...)",
            )
        return path

    async def audit_once(self, url: str, named: tuple[int, str] | None, session: aiohttp.ClientSession) -> AuditResult:
        """One round against the trainer at ``url`` whose signed record names the ledger head ``named`` (module
        docstring). Raises AuditError when no step can be replayed here now, LedgerError on a chain that does not
        check."""
        await self.chain.catch_up(session, url, named)
        index = json.loads(await fetch(session, url.rstrip("/") + "/audit"))
        listed = index.get("checkpoints") if isinstance(index, dict) and index.get("run_id") == self.run_id else None
        held = [s for s in listed if isinstance(s, int)] if isinstance(listed, list) else []
        entry, before = self.candidate(held)
        try:
            result = await self._replay(url, session, entry, before, held)
        except AuditFinding as e:  # the trainer contradicted its own signed word: caught, before any replay
            result = AuditResult(entry.version, entry.epoch, len(entry.producers), 0, 0.0, 0.0, "caught", e.reason)
            logger.error("audit of version %d: %s", entry.version, e)
        self.audited.add((result.epoch, result.version))
        return result

    async def _replay(
        self, url: str, session: aiohttp.ClientSession, entry: LedgerEntry, before: LedgerEntry, held: list[int]
    ) -> AuditResult:
        manifest = self.store.manifest(entry.version)
        if manifest is None:
            raise AuditError("not_held", f"version {entry.version} was dropped here meanwhile")
        published = await asyncio.to_thread(load_checkpoint, self.store.folder(entry.version), manifest)
        limit = 16 * sum(t.numel() for t in published.values()) + STATE_SLACK_BYTES
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        try:
            spool = self.workdir / "spool.bin"  # first: the trainer drops it once it writes the next checkpoint
            await self.download(session, url, f"/audit/spool/{entry.parent}", spool, SPOOL_MAX_BYTES)
            ckpt = await self.committed(session, url, entry.parent, before.state, limit)
            after = None
            if entry.state and entry.version in held:  # the state the step made: the replay must land on it too
                path = await self.committed(session, url, entry.version, entry.state, limit)
                after = engine_of(await asyncio.to_thread(load_state, path, ""))
                path.unlink()
            state = await asyncio.to_thread(load_state, ckpt, "")  # its hash was checked as it arrived
            spooled = _spooled(await asyncio.to_thread(spool.read_bytes))
            inputs = await asyncio.to_thread(
                assemble, self.run_id, entry, state, spooled, published, manifest, self.spec
            )
            del state
            inputs.after = after
            return await asyncio.to_thread(verdict, inputs, self.threads)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


class AuditorNode(RelayNode):
    role: Role = "auditor"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.remote = RemoteAudit(
            self.identity, self.run_id, self.store, self.cfg.data_dir / "audit", max(1, self.cfg.threads)
        )
        self.audits: Counter[str] = Counter()
        """Findings (``honest``, ``caught``) and rounds that could not replay (by reason)."""
        self.last: dict[str, Any] = {}

    def status(self) -> dict[str, Any]:
        return {**super().status(), "audits": {"counts": dict(self.audits), "last": self.last}}

    def working(self) -> dict[str, Any]:
        done = self.audits["honest"] + self.audits["caught"]
        if self.audits["caught"]:
            return {
                "ok": False,
                "doing": f"CAUGHT: {self.audits['caught']} of {done} replayed steps do not match what the trainer "
                f"published; last: {self.last.get('line', '')}",
            }
        return {"ok": True, "doing": f"auditing: {done} steps replayed, all matching; version {self.version} held"}

    async def work(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        assert self.follower is not None
        self._reading = None
        self.remote.spec = spec
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._follow(self.follower))
            tasks.create_task(self.audit_forever(session))

    async def audit_forever(self, session: aiohttp.ClientSession) -> None:
        every = self.cfg.audit_every_s
        # after the trainer refused us (403: our record not read yet, or not admitted yet), waits doubling up to the
        # round's interval: a trainer reads an unknown key's record at most every few seconds
        refused = Backoff(FIRST_AUDIT_S, every)
        await asyncio.sleep(FIRST_AUDIT_S)
        while True:
            started = time.monotonic()
            trainer = await self.trainer()
            if trainer is None or not trainer.http_url or trainer.epoch != self.store.epoch:
                await asyncio.sleep(1.0)
                continue
            named = (trainer.ledger.length, trainer.ledger.head) if trainer.ledger is not None else None
            self.remote.spec = self.spec  # a new epoch brings a new signed spec
            try:
                result = await self.remote.audit_once(trainer.http_url, named, session)
                refused.reset()
                self._finding(result, time.monotonic() - started)
            except AuditError as e:
                self._count(e.reason)
                (logger.debug if e.reason == "nothing_new" else logger.info)("no step replayed this round: %s", e)
                if e.reason == "nothing_new":  # the next version comes soon: look again before the full interval
                    await asyncio.sleep(min(every, 5.0))
                    continue
                if e.reason == "http_403":
                    await asyncio.sleep(refused.next())
                    continue
            except LedgerFork as e:  # evidence against the trainer: said loudly, counted, and the rounds go on
                self._count("fork")
                logger.error("the trainer's ledger forked: %s", e)
            except LedgerError as e:
                self._count(f"ledger_{e.reason}")
                logger.error("the trainer's ledger does not check: %s", e)
            except (ValueError, OSError, aiohttp.ClientError, TimeoutError) as e:
                self._count(type(e).__name__)
                logger.warning("audit round failed: %r; trying again in %.0fs", e, every)
            except Exception as e:  # whatever a trainer's files make the replay raise, the node goes on
                self._count("replay_error")
                logger.warning("audit round failed: %r; trying again in %.0fs", e, every, exc_info=True)
            await asyncio.sleep(max(1.0, every - (time.monotonic() - started)))

    def _count(self, reason: str) -> None:
        self.audits[reason] += 1
        self.metrics.inc("node_audits_total", label=reason, help="audit rounds, by finding or why none")

    def _finding(self, result: AuditResult, seconds: float) -> None:
        self._count(result.verdict)
        line = f"{result.line()} seconds={seconds:.1f}"
        self.last = {"version": result.version, "verdict": result.verdict, "line": line, "at": round(time.time(), 3)}
        print(f"AUDIT {line}", flush=True)
        if result.verdict == "caught":
            logger.error(
                "the trainer's version %d is not what its step makes from what its ledger says it consumed: %s",
                result.version,
                line,
            )
        else:
            logger.info("%s", line)
