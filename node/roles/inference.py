"""The inference role: follow the newest signed policy, generate the assigned rollouts, deliver them.

Loop: read the trainer's record from the DHT; if it announces a newer version, receive it through the relay tree
(manifest signed by the run key, every shard hash-checked) and swap it in, or the newest version already received;
derive the batch's tasks from (run seed, node id, version, batch index); sample a group per task; sign the batch and
hand it to the run's rollout sink (node/p2p/rollouts: offered, then pushed to the trainer). Generation runs in a
thread, so the node keeps serving /health, the DHT and weight shards while it works.

Meanwhile, as a relay does, a node that serves (all but ``--no-relay`` ones) receives each version its parents tell
it of (``follower.receive_announced``): it is at home in a stripe and the children there receive through it, so it must
not wait for its own next batch to fetch (in the red team's swarm, children hung below producers waited 4-6 s for
each version, and the producers themselves spent most of their time waiting for weights); and the version the next
batch needs is usually here by then.

Pacing by the trainer's replies: when the trainer holds enough of this node's rollouts (a ``backlog_full``
refusal, or the acceptance that filled its share) the node waits for the next version instead of producing
rollouts that would go stale, and when it is ``busy`` (judging) the node sends the same batch again later; in
both cases as long as the reply's ``retry_after_ms`` says (the trainer's estimate, at most ``RETRY_HINT_MAX_S``)
or, without one, ``PAUSE_MAX_S`` and a doubling wait up to ``DEFERRED_BACKOFF_MAX_S``. A newer version ends a
pause at once. A batch whose delivery failed is sent again, unchanged, before anything new; a node that restarted
continues at the batch index the trainer says it expects.

Every ``credit_check_s`` the node checks its credit book against the trainer's contribution ledger
(node/roles/credit.py, ``LedgerWatch``): ``/status`` ``credit`` and the dashboard show batches trained (inclusion
proofs checked), refused, acknowledged, lost, and batches of a twin on this identity.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import OrderedDict, deque
from functools import partial
from typing import Any

import aiohttp
import torch

from intellect_node.aio import Backoff
from intellect_node.judging.tasks import task_source
from intellect_node.judging.validator import task_reward
from intellect_node.p2p.metrics import TOKENS_PER_S
from intellect_node.p2p.rollouts import Endpoint, RolloutSink, make_sink
from intellect_node.p2p.transport import DELIVERY_ERRORS
from intellect_node.policy.backend import GenerationBackend, SamplingRequest, TransformersBackend, make_backend
from intellect_node.policy.model import build_tokenizer, encode_prompt
from intellect_node.roles.credit import CreditBook, LedgerFork, LedgerWatch
from intellect_node.roles.invites import FIXES
from intellect_node.roles.volunteer import POLL_S, Volunteer
from intellect_node.runtime import trim_freed
from intellect_node.weights.files import load_checkpoint
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.messages import NodeRecord, Role, RolloutBatch, RolloutGroup, RunSpec, SubmitReply
from intellect_protocol.tasks import sampling_seed

logger = logging.getLogger(__name__)
RETRY_SAME = frozenset({"busy", "unknown_signer"})
"""Refusals that decide nothing about the batch (the trainer is full, or has not read our record yet)."""
FLOW_CONTROL = frozenset({"busy", "unknown_signer", "backlog_full", "duplicate", "out_of_order"})
"""Refusals an honest producer gets in the normal course of a run: logged at INFO, not as a warning."""
DELIVERY_BACKOFF_MAX_S = 8.0
"""The longest wait between two tries to deliver a batch to a trainer that cannot be reached."""
DEFERRED_BACKOFF_MAX_S = 1.0
"""The longest wait between two tries of a batch the trainer deferred (busy judging, or a newcomer's one batch
pending on probation): at most one try a second, and no more than a second lost once the trainer has room (with 4 s
a newcomer on probation fell versions behind the trainer: tests/roles/test_gossip_swarm.py)."""
REFUSED_IN_ROW = 3
"""Refusals (other than flow control) or failed deliveries in a row after which the node says it is not working."""
DISK_RETRY_S = 5.0
"""After a local disk error (full, out of file handles), the node waits this long before trying again."""
REANNOUNCE_S = 5.0
LOAD_LOG_S = 30.0
"""A loaded version is logged at INFO at most this often (DEBUG otherwise; /status lists them all)."""
RECENT = 32
MADE_KNOWN = 16_384
"""Digests of our own batches remembered (a few MB), to tell an acknowledgement of ours from a twin's."""
TWIN_KEPT = 16
PAUSE_MAX_S = 10.0
"""A producer the trainer told to wait, without saying how long, asks again after this long even without a new
version: backpressure slows producers down, it must never leave the trainer waiting on paused producers."""
RETRY_HINT_MAX_S = 120.0
"""The longest a producer waits on a reply's ``retry_after_ms`` before asking again (a newer version ends the wait
sooner)."""
RETRY_HINT_SPREAD = 0.2
"""A hinted wait is lengthened by up to this fraction, drawn at random: producers told the same time do not all
come back in the same instant."""


def hinted_wait(retry_after_ms: int) -> float:
    """The seconds to wait for a reply's ``retry_after_ms`` (0: no hint, the caller's own backoff applies)."""
    if retry_after_ms <= 0:
        return 0.0
    return min(RETRY_HINT_MAX_S, retry_after_ms / 1000 * random.uniform(1.0, 1.0 + RETRY_HINT_SPREAD))


class InferenceNode(Volunteer):
    role: Role = "inference"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded = -1
        self.batch_index = 0
        self.versions_loaded: list[int] = []
        self.batches_sent = 0
        self.batches_accepted = 0
        self.rejections: dict[str, int] = {}
        self.unacked: OrderedDict[str, tuple[RolloutBatch, bytes]] = OrderedDict()
        """Batches made and not yet acknowledged by the trainer, by digest: offered again until they are (or go
        stale)."""
        self.batches_announced = 0
        self._logged_load = -LOAD_LOG_S
        self.batches_made = self.batch_bytes = 0
        self.acked_on_gossip: OrderedDict[str, bool] = OrderedDict()
        self._made_at: dict[str, float] = {}
        self.delivery_ms: deque[float] = deque(maxlen=2000)
        """Milliseconds from a batch made to its acknowledgement (the push's reply or gossip), the last 2000."""
        self.unreachable = Backoff(POLL_S, DELIVERY_BACKOFF_MAX_S)
        """Waits between tries to deliver to a trainer that cannot be reached."""
        self.refused_in_row = 0
        self.last_refusal = ("", "")
        """The reason and detail of the trainer's last refusal of a batch (``refused_in_row`` in a row since one was
        accepted)."""
        self.sink: RolloutSink | None = None
        """Where sealed batches go (node/p2p/rollouts): made once the node's gossip is up."""
        self.book: CreditBook | None = None
        """This node's account of its batches (node/roles/credit.py: ``intellect-node credit`` checks it against the
        trainer's ledger): made once the run is known."""
        self.made: OrderedDict[str, None] = OrderedDict()
        """Digests of the batches this node made (the newest MADE_KNOWN, with those of its book at start): an
        acknowledgement for this node's key naming another one means a second node uses this identity."""
        self.watch: LedgerWatch | None = None
        """This node's running check of its credit (``credit_check_s``): made with the book."""
        self.twin_batches: list[str] = []
        """Digests the trainer acknowledged for this node's key that this node never made (the first TWIN_KEPT)."""
        self.held_back_until = 0.0
        """Until when (monotonic) the trainer asked this node to wait (its share full, or busy judging): batches are
        not re-announced meanwhile (the trainer would pull one only to refuse it)."""

    def working(self) -> dict[str, Any]:
        if self.twin_batches:
            return {
                "ok": False,
                "doing": f"another node uses this node's identity: the trainer acknowledged {len(self.twin_batches)} "
                f"batch(es) signed with its key that it never made (first {self.twin_batches[0][:16]}); stop the "
                f"other copy of {self.cfg.data_dir / 'node.key'}, or give one of them a new data dir",
            }
        reason, detail = self.last_refusal
        if self.refused_in_row >= REFUSED_IN_ROW and reason not in FLOW_CONTROL:
            return {
                "ok": False,
                "doing": f"every batch refused: the trainer refused the last {self.refused_in_row} ({reason}: "
                f"{detail[:200]}); {FIXES.get(reason, 'ask the run operator why')}",
            }
        if self.unreachable.failures >= REFUSED_IN_ROW:
            return {
                "ok": False,
                "doing": f"cannot deliver batches: {self.unreachable.failures} tries in a row failed to reach the "
                "trainer (sending again, waits doubling)",
            }
        if self.loaded < 0:
            return {"ok": True, "doing": f"fetching the weights (version {self.version} held)"}
        return {
            "ok": True,
            "doing": f"generating with version {self.loaded}: {self.batches_accepted} batches accepted",
        }

    def status(self) -> dict[str, Any]:
        return {
            **super().status(),
            "loaded_version": self.loaded,
            "versions_loaded": self.versions_loaded,
            "batches_sent": self.batches_sent,
            "batches_accepted": self.batches_accepted,
            "rejections": self.rejections,
            "batches_made": self.batches_made,
            "batch_bytes": self.batch_bytes,
            "batches_announced": self.batches_announced,
            "delivery_ms": list(self.delivery_ms),
            "unacknowledged": len(self.unacked),
            "twin_batches": self.twin_batches,
            "held_back_s": max(0.0, self.held_back_until - time.monotonic()),  # told by the trainer to wait
            "credit": self.watch.summary if self.watch is not None else None,
        }

    async def _swap_weights(self, trainer: NodeRecord, backend: GenerationBackend) -> None:
        """Load the newest version: the trainer's record's, or a newer one already received from the parents
        (``follower.receive_announced``; the record read is seconds behind the tree's news at times)."""
        assert self.follower is not None
        record = trainer.weight_version
        if 0 <= record < self.loaded:
            # an older version is a stale record (a DHT replica behind, or one replayed): a trainer never reuses a
            # version number, so going back would only get our batches refused as duplicates
            self.metrics.inc(
                "node_inference_older_versions_ignored_total",
                help="trainer records announcing a version older than the one loaded",
            )
        newest = max(record, max(self.store.complete_versions(), default=-1)) if record >= 0 else -1
        if newest <= self.loaded:
            return
        started = time.monotonic()
        async with self.follower.newest(record) as (target, manifest):  # kept until read (no fetch prunes it)
            tensors = await asyncio.to_thread(load_checkpoint, self.store.folder(target), manifest)
        await asyncio.to_thread(backend.load_weights, tensors)
        del tensors
        trim_freed()
        self.loaded = target
        self.batch_index = 0
        self.versions_loaded.append(target)
        self.metrics.set("node_inference_weight_version", target)
        self.metrics.observe(
            "node_weights_fetch_seconds", time.monotonic() - started, help="a new version received, verified and loaded"
        )
        seconds = time.monotonic() - started
        quiet = time.monotonic() - self._logged_load < LOAD_LOG_S  # a fast run loads versions every second
        logger.log(
            logging.DEBUG if quiet else logging.INFO,
            "loaded version=%d bytes=%d seconds=%.2f (%d versions loaded so far)",
            target,
            manifest.total_size,
            seconds,
            len(self.versions_loaded),
        )
        if not quiet:
            self._logged_load = time.monotonic()

    async def ready(self, spec: RunSpec) -> None:
        await super().ready(spec)
        self.book = CreditBook(self.cfg.data_dir, self.run_id)
        self.watch = LedgerWatch(self.identity.node_id, self.run_id, self.book.path)
        for digest in self.book.made_before(MADE_KNOWN):  # acknowledgements of batches made before a restart
            self.made[digest] = None
        self.sink = make_sink(Endpoint(self.p2p, self.identity, self.run_id, self.metrics, self.gossip))
        await self.sink.start(self._acknowledged)
        self._reannouncer = asyncio.ensure_future(self.reannounce_forever())  # ends with the node's loop
        if self.cfg.credit_check_s > 0:
            self._credit_checker = asyncio.ensure_future(self.check_credit_forever(self.cfg.credit_check_s))

    def _acknowledged(self, digest: str) -> None:
        """The trainer acknowledged one of our batches apart from a push's reply: it need not be offered or sent
        again."""
        if digest not in self.made:  # acknowledged for our key, never made here: a second node on this identity
            if digest not in self.twin_batches:
                if not self.twin_batches:
                    logger.error(
                        "another node signs batches with this node's key: the trainer acknowledged batch %s, which "
                        "this node never made; stop the other copy of %s, or give one of them a new data dir",
                        digest[:16],
                        self.cfg.data_dir / "node.key",
                    )
                self.metrics.inc(
                    "node_inference_twin_acks_total", help="acknowledgements for our key naming a batch we never made"
                )
                if len(self.twin_batches) < TWIN_KEPT:
                    self.twin_batches.append(digest)
            return
        if self.unacked.pop(digest, None):
            self._delivered(digest)
            if self.book is not None:
                self.book.acknowledged(digest)
            self.acked_on_gossip[digest] = True
            while len(self.acked_on_gossip) > RECENT:
                self.acked_on_gossip.popitem(last=False)

    def _delivered(self, digest: str) -> None:
        made = self._made_at.pop(digest, None)
        if made is not None:
            self.delivery_ms.append(round((time.monotonic() - made) * 1000, 1))

    def _keep(self, batch: RolloutBatch, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.unacked[digest] = (batch, data)
        self.made[digest] = None
        while len(self.made) > MADE_KNOWN:
            self.made.popitem(last=False)
        if self.book is not None:
            self.book.made(batch, digest)
        self.batches_made += 1
        self.batch_bytes += len(data)
        self._made_at[digest] = time.monotonic()
        while len(self._made_at) > 4 * RECENT:
            self._made_at.pop(next(iter(self._made_at)))
        return digest

    async def reannounce_forever(self) -> None:
        """Offer each unacknowledged batch again every REANNOUNCE_S until the trainer acknowledges it (on
        gossip, or in the push's reply) or it goes stale; not while the trainer asked us to wait."""
        while True:
            await asyncio.sleep(REANNOUNCE_S)
            spec, sink = self.spec, self.sink
            assert spec is not None and sink is not None
            waiting = time.monotonic() < self.held_back_until
            for digest, (batch, data) in list(self.unacked.items()):
                if batch.version < self.loaded - spec.train.async_level or batch.epoch != spec.epoch:
                    self.unacked.pop(digest, None)
                    self.metrics.inc("node_inference_batches_stale_total", help="unacknowledged batches given up")
                elif not waiting and digest in self.unacked and await sink.reoffer(batch, data):
                    self.batches_announced += 1

    async def check_credit_forever(self, every: float) -> None:
        """Check this node's credit against the trainer's ledger every ``every`` seconds, once the trainer's
        record named its ledger (``LedgerWatch``). A check that fails is counted and logged (once per distinct
        reason), and shown in ``/status``; the node goes on working."""
        said = ""
        while True:
            await asyncio.sleep(every)
            book, watch = self.book, self.watch
            if book is None or watch is None or book.latest is None:
                continue
            url, named, async_level = book.latest
            try:
                await asyncio.to_thread(watch.check, url, named, async_level)
            except Exception as e:  # whatever the trainer answers, the node goes on producing
                watch.failed(e)
                reason = "fork" if isinstance(e, LedgerFork) or getattr(e, "reason", "") == "fork" else "failed"
                self.metrics.inc(
                    "node_inference_credit_checks_total", label=reason, help="checks of this node's credit, by outcome"
                )
                if watch.summary["error"] != said:
                    said = watch.summary["error"]
                    level = logging.ERROR if reason == "fork" else logging.WARNING
                    logger.log(
                        level,
                        "could not check this node's credit against the trainer's ledger at %s: %s%s",
                        url,
                        said,
                        f"; keep {book.path}: it is the evidence" if reason == "fork" else "; trying again",
                    )
                continue
            self.metrics.inc(
                "node_inference_credit_checks_total", label="ok", help="checks of this node's credit, by outcome"
            )
            said = ""

    def _generate(self, spec: RunSpec, backend: GenerationBackend, tokenizer: Any) -> RolloutBatch:
        try:
            return generate_batch(spec, backend, tokenizer, self.identity.node_id, self.loaded, self.batch_index)
        finally:
            trim_freed()

    async def work(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        torch.set_num_threads(self.cfg.threads)
        tokenizer = build_tokenizer(spec.model)
        build = partial(
            make_backend, backend=self.cfg.inference.backend, threads=self.cfg.threads, device=self.cfg.device
        )
        backend = await asyncio.to_thread(build, spec, tokenizer)
        sink = self.sink
        assert sink is not None
        assert self.follower is not None
        # a node that serves (the default) receives every version for its children; one with --no-relay only what
        # its next batch needs
        serving = self.server is not None
        following = asyncio.ensure_future(self.follower.receive_announced()) if serving else None
        try:
            await self._deliver_forever(spec, tokenizer, backend, build, sink)
        finally:
            if following is not None:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
            await sink.close()

    async def _deliver_forever(
        self, spec: RunSpec, tokenizer: Any, backend: GenerationBackend, build: Any, sink: RolloutSink
    ) -> None:
        """Generate and deliver batches, one at a time, for as long as the node runs (module docstring)."""
        paused_at: int | None = None  # the version at which the trainer said it had enough rollouts
        paused_until = 0.0  # ... and until when (monotonic) the node waits for a newer one
        unsent: tuple[RolloutBatch, bytes] | None = None
        """A batch whose delivery failed: sent again as it is (same index) before anything new is generated."""
        unreachable = self.unreachable
        deferred = Backoff(POLL_S, DEFERRED_BACKOFF_MAX_S)
        """Waits between tries of a batch the trainer deferred (busy, or our record not read yet)."""
        while True:
            trainer = await self.trainer()
            if trainer is None or not trainer.p2p_maddrs:
                await asyncio.sleep(POLL_S)
                continue
            if self.book is not None and trainer.ledger is not None:  # where `intellect-node credit` looks
                self.book.trainer(trainer.http_url, trainer.ledger.length, trainer.ledger.head, spec.train.async_level)
            if await self.follow_epoch(trainer):  # started over: version numbers, indices and maybe model are new
                assert self.spec is not None
                if self.spec.model != spec.model or self.spec.sampling != spec.sampling:
                    tokenizer = build_tokenizer(self.spec.model)
                    backend = await asyncio.to_thread(build, self.spec, tokenizer)
                spec = self.spec
                self.loaded, self.batch_index, unsent, paused_at = -1, 0, None, None
            if trainer.epoch != spec.epoch:
                await asyncio.sleep(POLL_S)
                continue
            try:
                await self._swap_weights(trainer, backend)
            except (TimeoutError, Rejected, aiohttp.ClientError) as e:
                self.metrics.inc("node_weights_fetch_failures_total", label=getattr(e, "reason", "network"))
                self.fetch_failed(trainer.weight_version, e)
                await asyncio.sleep(POLL_S)
                continue
            except OSError as e:  # our disk (full?) or a version pruned under us: shed, wait, try again
                self.metrics.inc("node_weights_fetch_failures_total", label="local_disk")
                logger.error(
                    "could not store or load version %d: %r; free disk space under %s or lower --max-disk-gb",
                    trainer.weight_version,
                    e,
                    self.store.root,
                )
                await asyncio.sleep(DISK_RETRY_S)
                continue
            if paused_at is not None and (self.loaded != paused_at or time.monotonic() >= paused_until):
                paused_at, self.held_back_until = None, 0.0
            if self.loaded < 0 or paused_at is not None:
                await asyncio.sleep(POLL_S)
                continue
            if unsent is not None and hashlib.sha256(unsent[1]).hexdigest() in self.acked_on_gossip:
                unsent = None  # acknowledged on gossip (the trainer pulled it) while the push kept failing
                self.batches_accepted += 1
            if unsent is None:
                began = time.monotonic()
                batch = await asyncio.to_thread(self._generate, spec, backend, tokenizer)
                took = time.monotonic() - began
                tokens = sum(len(c) for g in batch.groups for c in g.completions)
                self.metrics.observe(
                    "node_generation_tokens_per_second",
                    tokens / max(1e-6, took),
                    help="new tokens per second of a batch",
                    buckets=TOKENS_PER_S,
                )
                self.metrics.inc("node_generation_seconds_total", took, help="seconds spent generating batches")
                self.metrics.inc("node_generation_batches_total", help="batches generated")
                unsent = (batch, seal(self.identity, batch))
                self._keep(*unsent)
                if await sink.offer(*unsent):
                    self.batches_announced += 1
            batch, data = unsent
            try:
                reply, sealed = await sink.push_sealed(trainer, data)
            except (*DELIVERY_ERRORS, Rejected) as e:
                self.metrics.inc("node_inference_submit_failures_total")
                pause = unreachable.next()
                # said once when it starts (and once when it ends), not at every try
                say = logger.warning if unreachable.failures == 1 else logger.debug
                say(
                    "could not deliver batch version=%d index=%d: %r; sending it again, waits doubling to %.0fs",
                    batch.version,
                    batch.batch_index,
                    e,
                    DELIVERY_BACKOFF_MAX_S,
                )
                await asyncio.sleep(pause)
                continue
            if unreachable.failures:
                logger.info("the trainer answers again (after %d failed deliveries)", unreachable.reset())
            if not reply.ok and reply.reason in RETRY_SAME:  # nothing decided about this batch: the same, later
                self.metrics.inc("node_inference_batches_deferred_total", label=reply.reason)
                wait = hinted_wait(reply.retry_after_ms) or deferred.next()
                self.held_back_until = time.monotonic() + wait
                await asyncio.sleep(wait)
                continue
            deferred.reset()
            current = batch.version == self.loaded  # the index counts batches of the loaded version
            self.batches_sent += 1
            self.metrics.inc("node_inference_batches_sent_total")
            if reply.ok or reply.reason != "backlog_full":  # decided: acknowledged, or refused for good
                digest = hashlib.sha256(data).hexdigest()
                self.unacked.pop(digest, None)
                if reply.ok:
                    self._delivered(digest)
                if self.book is not None:
                    if reply.ok:
                        self.book.acknowledged(digest, sealed)
                    else:
                        self.book.refused(digest, reply.reason, reply.detail, sealed)
            if reply.ok:
                unsent = None
                self.batches_accepted += 1
                self.refused_in_row = 0
                if current:
                    self.batch_index = max(self.batch_index, batch.batch_index + 1)
                # the trainer's share of our work is full (it says when the next version is due), or it holds
                # enough to train on from everyone
                if reply.retry_after_ms or reply.backlog >= max(2, spec.train.async_level) * spec.train.batch_groups:
                    paused_at, paused_until = self.loaded, time.monotonic() + pause_for(reply)
                    self.held_back_until = paused_until
                continue
            self.rejections[reply.reason] = self.rejections.get(reply.reason, 0) + 1
            self.refused_in_row += 1
            self.last_refusal = (reply.reason, reply.detail)
            self.metrics.inc("node_inference_batches_refused_total", label=reply.reason)
            say = logger.info if reply.reason in FLOW_CONTROL else logger.warning
            say("trainer refused batch reason=%s detail=%s", reply.reason, reply.detail)
            if reply.reason == "backlog_full":  # kept, and sent again when the trainer has room
                paused_at, paused_until = self.loaded, time.monotonic() + pause_for(reply)
                self.held_back_until = paused_until
                continue
            unsent = None
            if reply.reason in ("duplicate", "out_of_order") and reply.next_index >= 0:
                if current:
                    self.batch_index = reply.next_index  # we restarted, or lost a reply: continue where it expects
            elif reply.reason == "wrong_epoch":  # the run was started over: the next record read says so
                pass
            elif reply.reason == "stale_version":
                if current:  # our weights are too old: wait for a newer version
                    paused_at, paused_until = self.loaded, time.monotonic() + PAUSE_MAX_S
            elif reply.reason == "banned":
                logger.error("the trainer banned this node (%s); it produces nothing more for this run", reply.detail)
                await asyncio.Event().wait()
            else:  # refused for good: the next batch, and a pause
                if current:
                    self.batch_index = max(self.batch_index, batch.batch_index + 1)
                paused_at, paused_until = self.loaded, time.monotonic() + PAUSE_MAX_S


def pause_for(reply: SubmitReply) -> float:
    """How long to wait for a newer version after ``reply`` said the trainer holds enough of our rollouts."""
    return hinted_wait(reply.retry_after_ms) or PAUSE_MAX_S


def generate_batch(
    spec: RunSpec,
    backend: GenerationBackend | torch.nn.Module,
    tokenizer: Any,
    node_id: str,
    version: int,
    index: int,
    max_rows: int | None = None,
    **sampling: Any,
) -> RolloutBatch:
    """Batch ``index`` of ``node_id`` on weight ``version``: its assigned tasks, a seeded group per task, TOPLOC
    proofs, and, where the task's reward is exact and cheap (``TaskSource.exact_reward``), the rewards the worker
    computes: a validator compares them, nothing else uses them; a producer never runs a reward that needs the jail.

    ``max_rows`` caps the rows of one generation call (the tokens do not depend on it: every row has its own
    seed). ``backend`` may be a bare model, run by the transformers backend with ``sampling`` (its ``draw``
    options: tests and benchmarks use them to play dishonest workers)."""
    if not isinstance(backend, GenerationBackend):
        backend = TransformersBackend(backend, **sampling)
    elif sampling:
        raise ValueError("sampling options apply to a bare model only; give them to the backend")
    n = spec.task.tasks_per_batch
    source = task_source(spec.task)
    tasks = [source.assigned(spec.seed, node_id, version, index, s) for s in range(n)]
    prompts = [encode_prompt(tokenizer, t.prompt) for t in tasks]
    group_size = spec.sampling.group_size
    rows = [
        (prompts[s], sampling_seed(spec.seed, node_id, version, index, s, j))
        for s in range(n)
        for j in range(group_size)
    ]
    step = max_rows or len(rows)
    request = SamplingRequest.of(spec, tokenizer)
    completions = []
    for start in range(0, len(rows), step):
        part = rows[start : start + step]
        completions += backend.generate([p for p, _ in part], [seed for _, seed in part], request)
    groups = [completions[s * group_size : (s + 1) * group_size] for s in range(n)]
    return RolloutBatch(
        run_id=spec.run_id,
        node_id=node_id,
        version=version,
        epoch=spec.epoch,
        batch_index=index,
        groups=[
            RolloutGroup(
                slot=s,
                prompt_ids=prompts[s],
                completions=[c.tokens for c in group],
                logprobs=[c.logprobs for c in group],
                proofs=[c.proofs for c in group],
                # only where a validator compares them (exact, cheap rewards): a producer never runs a reward that
                # needs the jail or takes long (code, math, an environment's rubric); the trainer scores anyway
                rewards=(
                    [task_reward(tokenizer, tasks[s], c.tokens, c.terminated, spec.task) for c in group]
                    if source.exact_reward(tasks[s])
                    else []
                ),
            )
            for s, group in enumerate(groups)
        ],
    )
