"""The trainer's door: every rollout batch, pushed or pulled, passes here before any work is spent on it.

``Door.on_batch`` checks, cheapest first: the envelope's signature, that the signer is a registered inference node
(a DHT read of bounded cost for unknown keys), not banned, admitted by the run's policy, within its room (before
the body is decoded: a flood costs a signature check per submission), then the batch's header (run, signer,
epoch, freshness, order, duplicates: ``Gate``), the producer's backlog, and its contents (shape and task
assignment; no untrusted program runs at the door). An admitted batch is spooled (fsynced) before the reply, so
that it survives a crash of the trainer, and handed to the judging pipeline.

Room: keys on probation together hold at most ``admission.probation_share`` of the batches pending a verdict,
each at most ``admission.probation_pending``, and new keys start probation at most
``admission.newcomers_per_min`` a minute (``Newcomers``): keys are free, so without a rate a flood of fresh keys
buys one judged batch each, as fast as it can make them. Trusted keys together leave the newcomers' share free.

Pacing: a refusal that holds only for now (``busy``, ``backlog_full``), and the acceptance that fills a producer's
share, say when to send again (``SubmitReply.retry_after_ms``): the time a verdict takes less the age of the oldest
batch in flight (``InFlight.until_verdict``), or the time between versions less the time since the last
(``Progress.until_version``). A producer that polled instead made ~10 refusals for every accepted batch.

``Door`` is one part of the trainer (node/roles/trainer.py wires it): it holds the duplicate gate's reservations
and the newcomers' bucket, and is handed the rest (trainer_state.Shared; the registry, the admission policy, the
judging pipeline; ``spool``, durability's write of an accepted batch).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from intellect_node.judging.validator import Gate
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.transport import off_loop_if_large
from intellect_node.policy.engine import BatchKey
from intellect_node.roles.admission import Admission
from intellect_node.roles.trainer_registry import NodeRegistry
from intellect_node.roles.trainer_state import NOT_DECIDED, Shared
from intellect_node.roles.trainer_validation import Judging
from intellect_protocol.envelope import Rejected, decode_body, open_envelope
from intellect_protocol.identity import node_id_of
from intellect_protocol.messages import RETRY_AFTER_MAX_MS, RolloutBatch, RunSpec, SubmitReply

logger = logging.getLogger(__name__)
MAX_QUEUED_PER_NODE = 2
"""A node may have this many training steps' worth of rollout groups queued, or ``async_level`` steps' worth if
more: what the trainer can use before they go stale."""
MAX_PENDING_BATCHES = 64
"""Admitted batches waiting for a verdict, all nodes together; past this the trainer answers busy (producers
resend). Keys on probation share ``admission.probation_share`` of it."""
STORE_RETRY_S = 5.0
"""Told to a producer whose batch the trainer could not store (disk full, out of file handles)."""
NEWCOMER_BURST = 8
"""New keys that may start probation at once, on top of ``admission.newcomers_per_min``."""
NEWCOMER_GRANT_S = 60.0
"""A new key granted a place may send (or be pulled from) again within this long without another one."""
NEWCOMERS_TRACKED = 65_536
"""Keys remembered as started (an admitted batch): the oldest are forgotten first."""


def retry_after_ms(seconds: float) -> int:
    """An estimate in seconds as a reply's ``retry_after_ms`` (bounded by the protocol's ten minutes)."""
    return min(RETRY_AFTER_MAX_MS, max(0, round(seconds * 1000)))


class Newcomers:
    """A token bucket for keys that start probation: ``per_min`` a minute, ``NEWCOMER_BURST`` at once. A key is
    charged once, when it first asks for room, and not again once one of its batches was admitted (``started``)
    or within ``NEWCOMER_GRANT_S`` of its grant (the pull of an announced batch and the door it then passes ask
    twice)."""

    def __init__(self, per_min: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_min / 60.0
        self.clock = clock
        self.tokens = float(NEWCOMER_BURST)
        self.at = clock()
        self.granted: OrderedDict[str, float] = OrderedDict()
        self.started: OrderedDict[str, None] = OrderedDict()

    def check(self, node_id: str) -> None:
        """Room for ``node_id`` to start probation, or Rejected('busy') with when to send again."""
        if node_id in self.started:
            return
        now = self.clock()
        granted = self.granted.get(node_id)
        if granted is not None and now - granted < NEWCOMER_GRANT_S:
            return
        self.tokens = min(float(NEWCOMER_BURST), self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1.0:
            wait = (1.0 - self.tokens) / self.per_s
            raise Rejected(
                "busy",
                f"the trainer takes {self.per_s * 60:g} new nodes a minute and is at that rate; send again in "
                f"{wait:.0f} s",
                retry_after_s=wait,
            )
        self.tokens -= 1.0
        self.granted[node_id] = now
        self.granted.move_to_end(node_id)
        while len(self.granted) > NEWCOMERS_TRACKED or next(iter(self.granted.values())) < now - NEWCOMER_GRANT_S:
            self.granted.popitem(last=False)

    def admitted(self, node_id: str) -> None:
        self.started[node_id] = None
        self.started.move_to_end(node_id)
        while len(self.started) > NEWCOMERS_TRACKED:
            self.started.popitem(last=False)


class Door:
    """The trainer's door (module docstring): ``on_batch`` for every batch, ``check_room`` before a pull,
    ``reject`` for a refusal made elsewhere (a frame too large), ``replay`` for the batches accepted before a
    restart."""

    def __init__(
        self,
        spec: RunSpec,
        metrics: Metrics,
        registry: NodeRegistry,
        admission: Admission,
        gate: Gate,
        shared: Shared,
        judging: Judging,
        spool: Callable[[bytes], Awaitable[None]],
        fresh_floor: Callable[[], int],
    ) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self.metrics = metrics
        self.registry = registry
        self.admission = admission
        self.gate = gate
        self.shared = shared
        self.judging = judging
        self.spool = spool
        self.fresh_floor = fresh_floor
        self.progress = shared.progress
        self.newcomers = Newcomers(spec.admission.newcomers_per_min)
        self.envelopes: dict[BatchKey, bytes] = {}
        """Admitted batches that may still have groups to train: what a checkpoint keeps for a resume."""

    def reject(self, e: Rejected, peer: str, node_id: str = "", next_index: int = -1, digest: str = "") -> SubmitReply:
        self.metrics.inc("node_trainer_batches_rejected_total", label=e.reason, help="rollout batches refused")
        if node_id:
            self.shared.rejected_by_node[node_id] += 1
            self.shared.refusals.add(node_id, e.reason)  # for the step's ledger entry, if it decides the batch
        logger.info("rejected batch peer=%s node=%s reason=%s detail=%s", peer, node_id or "?", e.reason, e.detail)
        return SubmitReply(
            ok=False,
            reason=e.reason,
            detail=e.detail[:500],
            trainer_step=self.progress.step,
            next_index=next_index,
            retry_after_ms=retry_after_ms(e.retry_after_s),
            digest=digest,
        )

    async def on_batch(self, data: bytes, peer: str) -> SubmitReply:
        node_id = ""
        batch: RolloutBatch | None = None
        try:
            signer, body = await off_loop_if_large(len(data), open_envelope, data, RolloutBatch)
            node_id = node_id_of(signer)
            record = await self.registry.registered(node_id)
            if record is None or record.role != "inference":
                node_id = ""  # do not keep per-node state for keys the run does not know
                raise Rejected("unknown_signer", "no inference record for this key in the run's DHT")
            if node_id in self.shared.banned:
                raise Rejected("banned", f"this node was caught cheating ({self.shared.banned[node_id]}) and is banned")
            self.admission.check(record)
            self.check_room(node_id)  # before decoding: a flood costs a signature check per submission
            self.shared.received_by_node[node_id] += 1
            batch = (await off_loop_if_large(len(body), decode_body, signer, body, RolloutBatch)).message
            self._check_header(batch, node_id)
            # Reserved before the first await: the same batch on another stream, or this node's next one, is
            # refused until this one is admitted or refused (a duplicate check and an admission separated by an
            # await let one signed batch in 16 times).
            self.gate.reserve(batch)
            try:
                slots = await off_loop_if_large(len(body), self.judging.check_contents, batch)
            except Rejected:
                self.gate.release(batch)
                raise
            except Exception as e:  # a completion our scoring cannot take (say, an integer of 5,000 digits)
                self.gate.release(batch)
                logger.info("could not check batch node=%s: %r", node_id, e)
                raise Rejected("unscorable", f"{type(e).__name__}: {str(e)[:200]}") from None
        except Rejected as e:
            expected = -1
            if batch is not None and e.reason in ("duplicate", "out_of_order"):
                expected = self.gate.next_index.get((batch.node_id, batch.version), 0)
            digest = ""
            if node_id and e.reason not in NOT_DECIDED:  # a registered key's signed batch, refused for good
                digest = await off_loop_if_large(len(data), lambda: hashlib.sha256(data).hexdigest())
            return self.reject(e, peer, node_id, expected, digest)
        digest = await off_loop_if_large(len(data), lambda: hashlib.sha256(data).hexdigest())
        try:  # durable (fsynced) before the reply: it survives a crash of the trainer
            await self.spool(data)
        except OSError:  # disk full, out of file handles: nothing accepted, the producer sends it again
            self.gate.release(batch)
            refusal = Rejected("busy", "the trainer cannot store batches right now; send again", STORE_RETRY_S)
            return self.reject(refusal, peer, node_id)
        self.gate.admit(batch)
        self.newcomers.admitted(node_id)
        key = (node_id, batch.version, batch.batch_index)
        self.envelopes[key] = data
        self.shared.inflight.add(key, len(slots))
        self.judging.dispatch(batch, slots, data)
        self.metrics.set("node_trainer_batches_pending_validation", self.judging.pending.qsize())
        self.shared.ledger("acked", key, len(slots), digest)
        # the last batch of this node's share before the next version: the producer is told when that should be
        full = self.held(node_id) >= self.share()
        return SubmitReply(
            ok=True,
            accepted_groups=len(slots),
            trainer_step=self.progress.step,
            backlog=self.backlog(),
            retry_after_ms=retry_after_ms(self.progress.until_version()) if full else 0,
            digest=digest,
        )

    def _check_header(self, batch: RolloutBatch, node_id: str) -> None:
        if batch.run_id != self.run_id:
            raise Rejected("wrong_run", f"batch for run {batch.run_id}")
        if batch.node_id != node_id:
            raise Rejected("signer_mismatch", f"batch of {batch.node_id} signed by {node_id}")
        if batch.epoch != self.spec.epoch:
            raise Rejected(
                "wrong_epoch",
                f"made in run epoch {batch.epoch}; the run is at epoch {self.spec.epoch} "
                "(it was started over): read the run spec again",
            )
        self.gate.check(batch, self.progress.step, newest=self.progress.published)
        if self.held(node_id) >= self.share():
            wait = self.progress.until_version()
            raise Rejected(
                "backlog_full",
                "the trainer holds enough of this node's rollouts; "
                + (
                    "the run has made its last step (max_steps): no newer version will come"
                    if self.progress.final
                    else "wait for a version" + (f" (the next is expected in {wait:.0f} s)" if wait else "")
                ),
                retry_after_s=wait,
            )

    def check_announced(self, node_id: str) -> None:
        """Before a batch announced on gossip is pulled: room as for a push, and this node's share not full (the
        header is not known yet; a producer with a full share announces again later). Pulling a batch only to
        refuse it as backlog_full cost a whole body each time a waiting producer re-announced it (every 5 s)."""
        self.check_room(node_id)
        if self.held(node_id) >= self.share():
            raise Rejected("backlog_full", "the trainer holds enough of this node's rollouts; wait for a version")

    def share(self) -> int:
        """The rollout groups one node may have queued or being judged (``MAX_QUEUED_PER_NODE``)."""
        return max(MAX_QUEUED_PER_NODE, self.spec.train.async_level) * self.spec.train.batch_groups

    def held(self, node_id: str) -> int:
        """The groups of ``node_id`` queued for training or being judged."""
        return self.shared.queue.by_node[node_id] + self.shared.inflight.groups_by_node[node_id]

    def check_room(self, node_id: str) -> None:
        """Bounded, fair work before anything is decoded: for keys on probation together, and for everybody (the
        per-node backlog is checked after the header, so that a stale batch is told it is stale)."""
        a = self.spec.admission
        inflight = self.shared.inflight
        newcomer_slots = max(1, int(a.probation_share * MAX_PENDING_BATCHES))
        newcomers = inflight.count(self.admission.on_probation)
        if self.admission.on_probation(node_id):
            mine = inflight.of(node_id)
            if mine >= a.probation_pending:
                wait = inflight.until_verdict(node_id)
                raise Rejected(
                    "busy",
                    f"a new node may have {a.probation_pending} batch(es) judged at once until "
                    f"{a.probation_batches} passed"
                    + (
                        f"; its verdict is expected in {wait:.0f} s"
                        if inflight.judge_s
                        else f"; ask again in {wait:.0f} s (no batch judged yet to time a verdict by)"
                    ),
                    retry_after_s=wait,
                )
            if newcomers >= newcomer_slots:
                raise Rejected(
                    "busy",
                    "the trainer is judging many new nodes' batches; send again shortly",
                    retry_after_s=inflight.until_verdict(),
                )
            self.newcomers.check(node_id)
        elif len(inflight) - newcomers >= MAX_PENDING_BATCHES - newcomer_slots:
            # trusted nodes together leave the newcomers' share free: a busy swarm still lets new nodes in
            raise Rejected(
                "busy", "the trainer has many batches to judge; send again shortly", inflight.until_verdict()
            )

    def backlog(self) -> int:
        """Validated groups that will be trained (fresh, past the filter): a producer that pauses on this number
        cannot stall the run, since they are enough for a step and a step publishes the version it waits for.
        (Counting groups still being validated deadlocked small runs: the filter then dropped most of them.)"""
        return self.shared.queue.fresh(self.fresh_floor())

    def replay(self, todo: Iterable[tuple[bytes, list[int] | None]]) -> dict[str, int]:
        """Batches accepted before a restart go through validation again: each envelope with the slots still due
        (None: all of them). What went stale meanwhile is counted and logged. Returns the counts."""
        seen: set[BatchKey] = set()
        replayed = stale = unreadable = 0
        for data, slots in todo:
            try:
                signer, body = open_envelope(data, RolloutBatch)
                batch = decode_body(signer, body, RolloutBatch).message
                if batch.epoch != self.spec.epoch:
                    raise Rejected("wrong_epoch", f"a batch of run epoch {batch.epoch}")
                due = self.judging.check_contents(batch)
            except Exception as e:  # it passed these checks once: only a changed task set (or a bad disk) fails
                unreadable += 1
                self.metrics.inc("node_trainer_replay_failures_total", help="spooled batches not replayable")
                logger.warning("could not replay a spooled batch: %r", e)
                continue
            key = (batch.node_id, batch.version, batch.batch_index)
            if key in seen or batch.node_id in self.shared.banned:
                continue
            seen.add(key)
            if slots is not None:
                due = [slot for slot in due if slot in slots]
                self.shared.curve.replayed(key)
            else:  # still being judged at the restart: none of it was trained, its outcome goes in the ledger
                self.shared.ledger.follow(key, len(due), hashlib.sha256(data).hexdigest())
            if batch.version < self.fresh_floor():
                stale += len(due)
                self.metrics.inc("node_trainer_groups_stale_dropped_total", len(due))
                self.shared.ledger("stale", key, len(due))
                continue
            self.gate.next_index[(batch.node_id, batch.version)] = max(
                self.gate.next_index.get((batch.node_id, batch.version), 0), batch.batch_index + 1
            )
            self.envelopes[key] = data
            self.shared.inflight.add(key, len(due))
            # not spooled again: it stays in its spool, which is kept until a checkpoint holding it is taken
            self.judging.submit(batch, due, data)
            replayed += len(due)
        return {"replayed_groups": replayed, "stale_groups": stale, "unreadable_batches": unreadable}

    def due(self) -> dict[BatchKey, list[int] | None]:
        """For a checkpoint: every batch that may still have groups to train, with the slots still due (None:
        all, the batch is still being judged). Envelopes of batches no longer due are forgotten."""
        due: dict[BatchKey, list[int] | None] = {key: None for key in self.shared.inflight.keys}
        for g in self.shared.queue.groups:
            slots = due.setdefault(g.key, [])
            if slots is not None:
                slots.append(g.slot)
        self.envelopes = {k: v for k, v in self.envelopes.items() if k in due}
        return due

    def state(self) -> dict[str, Any]:
        due = self.due()
        return {
            "gate": dict(self.gate.next_index),
            "batches": {k: self.envelopes[k] for k in due if k in self.envelopes},
            "due": due,
        }
