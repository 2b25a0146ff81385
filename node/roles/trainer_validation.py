"""The trainer's judging pipeline: every admitted batch judged against the exact version it claims.

A batch waits in ``pending`` until it is judged: by a trusted validator node (``--validator``), whose signed
verdict must be about exactly these bytes, or here on a second copy of the model when none answers. A batch that
fails is refused and, with ``verify.ban``, its producer banned for the run (its queued groups dropped); one that
passes and is still fresh enough is scored here and goes to the training queue. Nothing a batch does stops the loop.

``Judging`` is one part of the trainer (node/roles/trainer.py wires it): it holds its own state (the batches
pending, the verdict waits, the validators present, the validator's model) and is handed what it shares with the
other parts (trainer_state.py: the training queue, the batches in flight, the reward curve, the ledger; the bans
and per-node counts) and the few things it asks of them: the freshness floor, and ``acknowledge``, which
announces an admitted batch with the judges named (trainer_gossip.py).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from intellect_node.aio import within
from intellect_node.judging.validator import Finding, Validator, task_reward
from intellect_node.p2p.metrics import Metrics
from intellect_node.policy.engine import Group
from intellect_node.policy.model import encode_prompt, load_weights
from intellect_node.roles.admission import Admission
from intellect_node.roles.trainer_gossip import VerdictWait
from intellect_node.roles.trainer_registry import VALIDATOR_REFRESH_S, NodeRegistry
from intellect_node.roles.trainer_state import Shared
from intellect_node.runtime import trim_freed
from intellect_node.weights.files import load_checkpoint
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import Rejected, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import RolloutBatch, RolloutGroup, RunSpec, Verdict

logger = logging.getLogger(__name__)
VERDICTS_KEPT = 256
REWARD_WORKERS = 2
"""Threads that score completions (code tests and math checks run jailed programs)."""
VALIDATE_TIMEOUT_S = 120.0
VALIDATOR_WARN_S = 30.0
MAX_DEFER_S = 2.0
"""How long a pending batch may be passed over for batches of the version the validator holds."""


PendingBatch = tuple[RolloutBatch, list[int], bytes]
"""An admitted batch, the slots still due, and its envelope as the producer signed it."""


class PendingBatches:
    """Admitted batches waiting for a verdict. ``get(prefer)`` takes one of the version the validator's model
    holds when there is one (a producer alternating versions must not force a weight reload per batch), unless
    the oldest has waited ``MAX_DEFER_S``: else, under a steady honest flow of one version, a batch of another
    waits for ever (a flooder's first batch, pending for a whole attack, keeps its key answered 'busy' instead of
    banned, every submission costing a signature check)."""

    def __init__(self) -> None:
        self._items: list[tuple[float, PendingBatch]] = []
        self._added = asyncio.Event()

    def put_nowait(self, item: PendingBatch) -> None:
        self._items.append((time.monotonic(), item))
        self._added.set()

    def qsize(self) -> int:
        return len(self._items)

    async def get(self, prefer: int = -1) -> PendingBatch:
        while not self._items:
            self._added.clear()
            await self._added.wait()
        if time.monotonic() - self._items[0][0] >= MAX_DEFER_S:
            return self._items.pop(0)[1]
        at = next((i for i, (_, item) in enumerate(self._items) if item[0].version == prefer), 0)
        return self._items.pop(at)[1]


def judged_group(batch: RolloutBatch, group: RolloutGroup, rewards: list[float], digest: str) -> Group:
    """One group of ``batch`` (sealed as ``digest``) with the rewards recomputed for it, as the learner trains it:
    made alike by the judging pipeline and by the audit's replay of a step (node/roles/audit.py)."""
    return Group(
        batch.node_id,
        batch.version,
        group.prompt_ids,
        group.completions,
        group.logprobs,
        rewards,
        batch.batch_index,
        group.slot,
        digest,
    )


class Judging:
    """The judging pipeline (module docstring). ``dispatch`` takes an admitted batch; ``validate_forever`` and
    ``watch_validators`` run for the trainer's lifetime; ``route`` serves the newest verdicts."""

    def __init__(
        self,
        spec: RunSpec,
        validators: list[str],
        identity: Identity,
        metrics: Metrics,
        registry: NodeRegistry,
        admission: Admission,
        store: WeightStore,
        store_lock: threading.Lock,
        validator: Validator,
        tokenizer: Any,
        shared: Shared,
        fresh_floor: Callable[[], int],
        acknowledge: Callable[[RolloutBatch, bytes, list[str], bool], str],
    ) -> None:
        self.spec = spec
        self.validators = validators
        """The validator nodes named with ``--validator``: the only keys whose verdicts count."""
        self.identity = identity
        self.metrics = metrics
        self.registry = registry
        self.admission = admission
        self.store = store
        self.store_lock = store_lock
        """Held while the validator reads a version (the trainer prunes old versions under it)."""
        self.validator = validator
        self.tokenizer = tokenizer
        self.queue = shared.queue
        self.inflight = shared.inflight
        self.curve = shared.curve
        self.ledger = shared.ledger
        self.banned = shared.banned
        self.accepted_by_node = shared.accepted_by_node
        self.rejected_by_node = shared.rejected_by_node
        self.refusals = shared.refusals
        self.fresh_floor = fresh_floor
        self.acknowledge = acknowledge
        self.pending = PendingBatches()
        """Admitted batches waiting to be judged here, with the slots still due."""
        self.waits: dict[str, VerdictWait] = {}
        """By digest: the batches the named validators are judging."""
        self.verdicts: deque[bytes] = deque(maxlen=VERDICTS_KEPT)
        self.validators_present: list[str] = []
        self.validators_missing: list[str] = []
        self.validator_version = -1
        """The version the validator's model holds (-1: none, or a load that failed half-way)."""
        self.validate_s = 0.0
        """Seconds spent judging batches here (the step split)."""
        self._waiting: set[asyncio.Future[None]] = set()
        self._turn = 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="validation")  # its model: a batch at a time
        self.reward_pool = ThreadPoolExecutor(REWARD_WORKERS, thread_name_prefix="rewards")
        """Scoring (code tests and math checks run jailed programs) has threads of its own: a slow batch never
        holds up checkpointing and publishing, which use the default executor."""

    def close(self) -> None:
        self.reward_pool.shutdown(wait=False, cancel_futures=True)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def route(self) -> web.RouteDef:
        return web.get("/verdicts", self._verdicts)

    def submit(self, batch: RolloutBatch, slots: list[int], envelope: bytes) -> None:
        """Judge ``batch`` here (a batch replayed after a restart, or one no validator judged in time)."""
        self.pending.put_nowait((batch, slots, envelope))

    def check_contents(self, batch: RolloutBatch) -> list[int]:
        """Shape (node/judging/validator.py) and assignment: cheap, no untrusted program runs. Returns the slots."""
        self.validator.check_shape(batch)
        for g in batch.groups:
            task = self.validator.task(batch, g.slot)
            if g.prompt_ids != encode_prompt(self.tokenizer, task.prompt):
                raise Rejected("unassigned_task", f"slot {g.slot} is not the task assigned to this node")
        return [g.slot for g in batch.groups]

    def _score(self, batch: RolloutBatch, slots: list[int], deadline: float, digest: str) -> list[Group]:
        """The groups of ``slots`` with rewards recomputed here (on the reward pool, after validation passed), each
        naming its batch by ``digest``; raises Rejected('reward_budget') once ``deadline`` (monotonic) passes between
        completions."""
        eos = int(self.tokenizer.eos_token_id)
        groups = []
        for g in batch.groups:
            if g.slot not in slots:
                continue
            task = self.validator.task(batch, g.slot)
            rewards = []
            for c in g.completions:
                if time.monotonic() > deadline:
                    raise Rejected("reward_budget", f"scoring took over {self.spec.verify.reward_budget_s:.0f}s")
                rewards.append(task_reward(self.tokenizer, task, c, c[-1] == eos, self.spec.task))
            groups.append(judged_group(batch, g, rewards, digest))
        return groups

    def choose_judges(self) -> list[str]:
        """The validators to judge the next batch: one in turn, two for the ``second_opinion`` share."""
        present = self.validators_present
        if not present:
            return []
        self._turn += 1
        n = 2 if len(present) >= 2 and random.random() < self.spec.verify.second_opinion else 1
        return [present[(self._turn + i) % len(present)] for i in range(n)]

    async def watch_validators(self) -> None:
        """Say loudly, and keep saying it, when validators named with ``--validator`` are not in the run (the
        trainer then validates every batch itself): a log line every VALIDATOR_WARN_S, a gauge, /status."""
        if not self.validators:
            return
        warned = -VALIDATOR_WARN_S
        while True:
            await asyncio.sleep(0 if warned < 0 else VALIDATOR_REFRESH_S)  # who is present decides who judges
            try:
                found = {r.node_id for r in await self.registry.validators(self.validators)}
            except Exception as e:  # a DHT that does not answer: say so next time
                logger.debug("could not read the validators' records: %r", e)
                found = set()
            self.validators_missing = sorted(set(self.validators) - found)
            self.validators_present = sorted(found)
            self.metrics.set(
                "node_trainer_validators_missing",
                len(self.validators_missing),
                help="validators named with --validator that have no record in the run",
            )
            if self.validators_missing and time.monotonic() - warned >= VALIDATOR_WARN_S:
                warned = time.monotonic()
                logger.warning(
                    "validator(s) %s named with --validator are not in the run's DHT: this trainer "
                    "validates their share itself; start them with the trainer's current join line "
                    "(--role validator)",
                    ", ".join(v[:12] for v in self.validators_missing),
                )
            warned = max(warned, 0.0)

    def _load_validator(self, version: int) -> None:
        self.validator_version = -1  # a load that fails half-way leaves mixed weights: never label them
        with self.store_lock:  # the trainer prunes old versions: not while one is being read
            manifest = self.store.manifest(version)
            if manifest is None or version not in self.store.complete_versions():
                raise Rejected("stale_version", f"version {version} is no longer held here")
            tensors = load_checkpoint(self.store.folder(version), manifest)
        load_weights(self.validator.model, tensors)
        self.validator_version = version

    def _validate(self, batch: RolloutBatch, full: bool = False) -> Finding:
        if self.validator_version != batch.version:
            self._load_validator(batch.version)
        try:
            return self.validator.check(batch, full=full)
        finally:
            trim_freed()

    async def validate_forever(self) -> None:
        """Train only on what passed: every batch is checked against the exact version it claims. Nothing a batch
        does here stops the loop: an unexpected error drops that batch (counted, logged), nobody is banned for it."""
        while True:
            batch, slots, envelope = await self.pending.get(prefer=self.validator_version)
            try:
                await self._validate_one(batch, slots, envelope)
            except Exception:
                self.metrics.inc("node_trainer_validation_errors_total", help="batches dropped by an internal error")
                logger.exception(
                    "validation of node=%s version=%d batch=%d failed; batch dropped",
                    batch.node_id,
                    batch.version,
                    batch.batch_index,
                )
            finally:
                self.inflight.done((batch.node_id, batch.version, batch.batch_index), len(slots))
                self.metrics.set("node_trainer_batches_pending_validation", self.pending.qsize())

    def dispatch(self, batch: RolloutBatch, slots: list[int], envelope: bytes) -> None:
        """An admitted batch goes to the validators named in its acknowledgement (asked to check every completion
        when its producer's key is on probation and spot checks are on), or to this trainer's own queue when no
        validator is present."""
        newcomer = self.admission.on_probation(batch.node_id) and self.spec.verify.check_fraction < 1.0
        judges = self.choose_judges()
        digest = self.acknowledge(batch, envelope, judges, newcomer)
        if not judges:
            self.submit(batch, slots, envelope)
            return
        wait = self.waits[digest] = VerdictWait(judges, (batch.node_id, batch.version, batch.batch_index))
        task = asyncio.ensure_future(self._await_verdicts(batch, slots, envelope, digest, wait))
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def _await_verdicts(
        self, batch: RolloutBatch, slots: list[int], envelope: bytes, digest: str, wait: VerdictWait
    ) -> None:
        """The named validators' verdicts, off the trainer's path; judged here if they do not all come in time."""
        key = (batch.node_id, batch.version, batch.batch_index)
        handed_over = False
        try:
            try:
                await within(wait.done.wait(), self.spec.verify.verdict_wait_s)
            except TimeoutError:
                pass
            refusals = [(v, s) for v, s in wait.verdicts.values() if not v.ok]
            if refusals or len(wait.verdicts) == len(wait.judges):
                verdict, sealed = (refusals or list(wait.verdicts.values()))[0]
                self.metrics.inc(
                    "node_trainer_remote_verdicts_total", len(wait.verdicts), help="verdicts from validator nodes"
                )
                await self._apply(batch, slots, verdict, sealed)
                return
            self.metrics.inc("node_trainer_validation_fallbacks_total", help="validated here: no verdict in time")
            logger.info(
                "no verdict on node=%s version=%d batch=%d from %s within %.0fs; judging it here",
                batch.node_id,
                batch.version,
                batch.batch_index,
                ",".join(j[:8] for j in wait.judges),
                self.spec.verify.verdict_wait_s,
            )
            self.submit(batch, slots, envelope)
            handed_over = True
        except Exception:
            self.metrics.inc("node_trainer_validation_errors_total", help="batches dropped by an internal error")
            logger.exception(
                "applying the verdicts on node=%s version=%d batch=%d failed; batch dropped",
                batch.node_id,
                batch.version,
                batch.batch_index,
            )
        finally:
            self.waits.pop(digest, None)
            if not handed_over:
                self.inflight.done(key, len(slots))

    async def _validate_one(self, batch: RolloutBatch, slots: list[int], envelope: bytes) -> None:
        key = (batch.node_id, batch.version, batch.batch_index)
        if batch.node_id in self.banned:
            self.metrics.inc("node_trainer_groups_dropped_banned_total", len(slots))
            self.ledger("banned", key, len(slots))
            return
        if batch.version < self.fresh_floor():
            self.metrics.inc("node_trainer_groups_stale_dropped_total", len(slots))
            self.ledger("stale", key, len(slots))
            return
        started = time.monotonic()
        # a key on probation has every completion checked when spot checks are on
        newcomer = self.admission.on_probation(batch.node_id) and self.spec.verify.check_fraction < 1.0
        try:
            loop = asyncio.get_running_loop()
            finding = await loop.run_in_executor(self.pool, self._validate, batch, newcomer)
        except Rejected as e:
            self.metrics.inc("node_trainer_groups_stale_dropped_total", len(slots))
            self.ledger("stale", key, len(slots))
            logger.info("dropped batch node=%s version=%d: %s", batch.node_id, batch.version, e.detail)
            return
        finally:
            self.validate_s += time.monotonic() - started
        verdict = finding.verdict(batch, envelope)
        self.metrics.inc("node_validator_seconds_total", time.monotonic() - started)
        self.metrics.inc("node_trainer_self_verdicts_total", help="batches judged by the trainer itself")
        self.metrics.observe("node_validation_seconds", time.monotonic() - started, help="a batch judged")
        await self._apply(batch, slots, verdict, seal(self.identity, verdict))

    async def _apply(self, batch: RolloutBatch, slots: list[int], verdict: Verdict, sealed: bytes) -> None:
        """Act on a batch's verdict (from a validator node or this trainer): refuse and ban, or score and queue."""
        key = (batch.node_id, batch.version, batch.batch_index)
        if verdict.ok and batch.node_id in self.banned:  # banned for another batch while this one was judged
            self.metrics.inc("node_trainer_groups_dropped_banned_total", len(slots))
            self.ledger("banned", key, len(slots))
            return
        self.verdicts.append(sealed)
        if not verdict.ok:
            self.metrics.inc("node_validator_rejected_total", label=verdict.reason, help="batches failing checks")
            self.rejected_by_node[batch.node_id] += 1
            self.refusals.add(batch.node_id, verdict.reason or "invalid")
            self.ledger("invalid", key, len(slots))
            logger.warning(
                "validation failed node=%s version=%d batch=%d reason=%s detail=%s",
                batch.node_id,
                batch.version,
                batch.batch_index,
                verdict.reason,
                verdict.detail,
            )
            if self.spec.verify.ban and batch.node_id not in self.banned:
                self.banned[batch.node_id] = verdict.reason
                dropped = self.queue.drop_node(batch.node_id)
                self.metrics.inc("node_trainer_nodes_banned_total", help="nodes banned for cheating")
                self.metrics.inc("node_trainer_groups_dropped_banned_total", len(dropped))
                for g in dropped:
                    self.ledger("banned", g.key, 1)
                logger.warning(
                    "banned node=%s for the run: %s (%d queued groups dropped)",
                    batch.node_id,
                    verdict.reason,
                    len(dropped),
                )
            return
        if batch.version < self.fresh_floor():  # went stale while it was being judged
            self.metrics.inc("node_trainer_groups_stale_dropped_total", len(slots))
            self.ledger("stale", key, len(slots))
            return
        groups = await self._scored(batch, slots, verdict.batch_sha256)
        if groups is None:
            self.ledger("unscorable", key, len(slots))
            return
        if batch.version < self.fresh_floor():  # went stale while it was being scored
            self.metrics.inc("node_trainer_groups_stale_dropped_total", len(groups))
            self.ledger("stale", key, len(groups))
            return
        self.metrics.inc("node_validator_accepted_total", help="batches passing every check")
        self.admission.batch_passed(batch.node_id)
        self.accepted_by_node[batch.node_id] += len(groups)
        self.metrics.inc("node_trainer_groups_accepted_total", len(groups), help="rollout groups accepted")
        self.curve.accepted(key, groups)  # (a batch replayed after a resume is already in the curve)
        if self.spec.train.online_filter:  # all rewards equal: zero advantage, nothing to learn from
            kept = [g for g in groups if max(g.rewards) > min(g.rewards)]
            self.metrics.inc(
                "node_trainer_groups_filtered_total",
                len(groups) - len(kept),
                help="groups dropped by the online filter (all rewards equal)",
            )
            self.ledger("filtered", key, len(groups) - len(kept))
            groups = kept
        self.queue.add(batch.node_id, groups)

    async def _scored(self, batch: RolloutBatch, slots: list[int], digest: str) -> list[Group] | None:
        """Rewards, recomputed here only now that the batch passed validation, on the reward pool and within the
        run's per-batch budget; None (counted, logged, nobody banned) when scoring fails or runs over."""
        started = time.monotonic()
        deadline = started + self.spec.verify.reward_budget_s
        loop = asyncio.get_running_loop()
        try:
            groups = await loop.run_in_executor(self.reward_pool, self._score, batch, slots, deadline, digest)
        except Rejected as e:
            self.metrics.inc(
                "node_trainer_groups_unscored_total",
                len(slots),
                label=e.reason,
                help="validated groups dropped because scoring failed or ran over budget",
            )
            logger.warning(
                "dropped batch node=%s version=%d batch=%d: %s", batch.node_id, batch.version, batch.batch_index, e
            )
            return None
        except Exception as e:  # a completion our scoring cannot take: the batch is dropped, the node goes on
            self.metrics.inc("node_trainer_groups_unscored_total", len(slots), label="error")
            logger.warning(
                "could not score batch node=%s version=%d batch=%d: %r",
                batch.node_id,
                batch.version,
                batch.batch_index,
                e,
            )
            return None
        self.metrics.inc(
            "node_trainer_reward_seconds_total", time.monotonic() - started, help="time spent recomputing rewards"
        )
        return groups

    async def _verdicts(self, _request: web.Request) -> web.Response:
        """The newest signed verdicts, each a base64 envelope (check with intellect_protocol.envelope)."""
        return web.json_response({"verdicts": [base64.b64encode(v).decode() for v in self.verdicts]})
