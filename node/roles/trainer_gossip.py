"""The trainer on the run's gossip topics: version notices out, announcements in, acknowledgements out, verdicts in.

- ``versions``: each published version is announced with a ``VersionNotice`` signed by the run key, and the
  newest is repeated every ``NOTICE_REPEAT_S`` (a late joiner, or a node whose copy was lost, hears it soon).
- ``rollouts``: producers announce each batch (``BatchAnnounce``). The trainer takes the body from the producer's
  push; an announced batch not pushed within ``PULL_AFTER_S`` is pulled from its producer by the rollout source
  (``RolloutSource.pull``, node/p2p/rollouts: by digest, ``node/p2p/batches.py``) and goes through the same door.
  An announcement of a batch already admitted is answered with its acknowledgement again (the producer missed it),
  at most every ``ACK_REPEAT_S``, and only when its producer announces it: anyone else's announcement of that
  digest is refused before anything is signed.
- ``verdicts``: every admitted batch is acknowledged with a ``BatchAck`` (signed by the run key) that names the
  validators asked to judge it: one trusted validator in turn, or two for a ``verify.second_opinion`` share of
  batches when two are present. Their signed ``Verdict`` messages come back on the same topic. The batch is trained
  on once every named judge accepted it; a refusal from any of them refuses it; when they have not all answered
  within ``verify.verdict_wait_s``, the trainer judges the batch itself (``trainer_validation.py``).

Who may publish what: a notice or an acknowledgement counts only when signed by the run key, an announcement only
from a registered inference node (``NodeRegistry``, a bounded-cost DHT read) for its own batch, a verdict only
from a validator named with ``--validator``. Before any pull the announcer passes the same door as a push
(not banned, admitted by the run's policy, room for it if on probation); then at most ``PULLS_PER_NODE`` of its
announced batches and ``MAX_PULLS`` of everybody's wait to be fetched, and each body fetched takes a place in the
trainer's ``Intake`` (the source's), the budget pushes draw on too: however many keys announce, the bodies in
memory stay bounded. Each fetch pulls at most one batch and is made once per digest.

``TrainerGossip`` is one part of the trainer (node/roles/trainer.py wires it), with its own state (the digests it
knows, the envelopes it serves, the pulls under way, the newest notice); it is handed what it reads of the other
parts (the registry, the admission policy, the bans, the judging pipeline's verdict waits), the door's capacity
check (``check_room``, made before a pull as before a push, with the producer's share: a batch the door would
refuse as backlog_full is not pulled) and, at ``start``, the rollout source that pulls an
announced batch and puts it through the door.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from intellect_node.aio import raise_if_cancelled
from intellect_node.p2p.batches import BatchServer
from intellect_node.p2p.gossip import LIMITS, Gossip
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.reach import DialBackServer
from intellect_node.p2p.rollouts import RolloutSource
from intellect_node.roles.admission import Admission
from intellect_node.roles.trainer_registry import NodeRegistry
from intellect_node.weights.store import WeightStore
from intellect_protocol.envelope import Rejected, kind_of, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import BatchAck, BatchAnnounce, RolloutBatch, Verdict, VersionNotice

logger = logging.getLogger(__name__)
NOTICE_REPEAT_S = 5.0
PULL_AFTER_S = 3.0
"""An announced batch that was not pushed within this long is fetched from its producer."""
ACK_REPEAT_S = 2.0
"""At most one repeated acknowledgement per batch in this long, however often it is announced."""
PULLS_PER_NODE = 1
MAX_PULLS = 16
"""Announced batches waiting to be fetched, all producers together; more are not fetched (they announce again)."""
KNOWN = 8192
"""Digests remembered (admitted, or being fetched): what tells a repeated announcement from a new one."""


@dataclass
class Known:
    """What the trainer knows of a digest: the batch it names once admitted (None while it is being fetched), the
    judges asked, when it was last acknowledged, whether its producer was on probation (the ack's ``full``), and
    the node whose batch it is (its producer, or the announcer being fetched from)."""

    key: tuple[str, int, int] | None
    judges: list[str]
    acked: float
    full: bool
    node_id: str


class VerdictWait:
    """The named judges' verdicts on one admitted batch."""

    def __init__(self, judges: list[str], key: tuple[str, int, int]) -> None:
        self.judges = judges
        self.key = key
        self.verdicts: dict[str, tuple[Verdict, bytes]] = {}
        self.done = asyncio.Event()

    def add(self, signer: str, verdict: Verdict, sealed: bytes) -> None:
        if (verdict.node_id, verdict.version, verdict.batch_index) != self.key:
            raise Rejected("foreign_verdict", "a verdict naming another batch than its digest")
        if signer in self.judges and signer not in self.verdicts:
            self.verdicts[signer] = (verdict, sealed)
            if not verdict.ok or len(self.verdicts) == len(self.judges):
                self.done.set()


class TrainerGossip:
    """The trainer on the run's gossip topics (module docstring): ``start`` once the libp2p daemon and the rollout
    source are up,
    ``repeat_notices`` for the trainer's lifetime, ``announce_version`` for each version published, ``admitted``
    for each batch the door admits (its acknowledgement names the judges)."""

    def __init__(
        self,
        run_id: str,
        epoch: int,
        identity: Identity,
        metrics: Metrics,
        store: WeightStore,
        registry: NodeRegistry,
        admission: Admission,
        banned: dict[str, str],
        validators: list[str],
        waits: dict[str, VerdictWait],
        check_room: Callable[[str], None],
    ) -> None:
        self.run_id = run_id
        self.epoch = epoch
        self.identity = identity
        self.metrics = metrics
        self.store = store
        self.registry = registry
        self.admission = admission
        self.banned = banned
        self.validators = validators
        """The keys named with ``--validator``: the only ones whose verdicts count."""
        self.waits = waits
        """The judging pipeline's: by digest, the batches named validators are judging."""
        self.check_room = check_room
        self.p2p: Any = None
        self.source: RolloutSource | None = None
        """Pulls an announced batch and puts it through the door (within the intake budget pushes use)."""
        self.gossip: Gossip | None = None
        self.batch_server: BatchServer | None = None
        self.dialback: DialBackServer | None = None
        self.known: OrderedDict[str, Known] = OrderedDict()
        """Admitted batches, and announced ones being fetched, by digest."""
        self.held: OrderedDict[str, bytes] = OrderedDict()
        """Admitted batches' envelopes by digest, the newest ``KNOWN``: served to the validators that judge them."""
        self._notice: bytes = b""
        self._pulling: Counter[str] = Counter()
        """Announced batches being fetched, by producer: at most PULLS_PER_NODE each (a producer announcing made-up
        digests gets one fetch at a time, each read only up to the size it announced)."""
        self._tasks: set[asyncio.Future[None]] = set()
        """Acknowledgements being published and pulls in flight: cancelled at ``stop``, their errors logged (a pull
        that failed as the daemon went away printed "Task exception was never retrieved" at one stop in five)."""

    async def start(self, p2p: Any, source: RolloutSource) -> None:
        self.p2p = p2p
        self.source = source
        self.gossip = Gossip(self.p2p, self.run_id, self.metrics)
        self.gossip.subscribe("rollouts", self._on_announce)
        self.gossip.subscribe("verdicts", self._on_verdict)
        self.batch_server = BatchServer(self.p2p, self.run_id, self.held.get, self.metrics)
        await self.batch_server.start()
        self.dialback = DialBackServer(self.p2p, self.identity, self.run_id, self.metrics)  # joiners' reachability
        await self.dialback.start()

    def _spawn(self, work: Coroutine[Any, Any, None], what: str) -> asyncio.Future[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)

        def ended(t: asyncio.Future[None]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.metrics.inc("node_errors_total", label=what)
                logger.warning("%s failed: %r", what, t.exception())

        task.add_done_callback(ended)
        return task

    async def stop(self) -> None:
        for task in list(self._tasks):  # before the daemon they talk to goes
            task.cancel()
        if self.batch_server is not None:
            await self.batch_server.close()
        if self.dialback is not None:
            await self.dialback.close()
        if self.gossip is not None:
            await self.gossip.close()

    async def _gossip_out(self, name: str, data: bytes) -> None:
        if self.gossip is None:
            return
        try:
            await self.gossip.publish(name, data)
        except (OSError, TimeoutError, Rejected) as e:  # the daemon restarting: whoever needs it asks again
            raise_if_cancelled()
            self.metrics.inc("node_gossip_publish_failures_total", label=name)
            logger.warning("could not publish on %s: %r", name, e)

    async def announce_version(self, version: int) -> None:
        manifest = self.store.manifest(version)
        if manifest is None:
            return
        notice = VersionNotice(
            run_id=self.run_id,
            epoch=self.epoch,
            version=version,
            checkpoint_sha256=manifest.checkpoint_sha256,
            issued=time.time(),
        )
        self._notice = seal(self.identity, notice)
        await self._gossip_out("versions", self._notice)

    async def repeat_notices(self, published: int) -> None:
        """Announce ``published`` now, then the newest notice again every NOTICE_REPEAT_S (gossip loses messages
        sent before a mesh forms)."""
        await self.announce_version(published)
        while True:
            await asyncio.sleep(NOTICE_REPEAT_S)
            if self._notice:
                await self._gossip_out("versions", self._notice)

    def status(self) -> dict[str, Any]:
        """The trainer's /status fields about gossip: duplicates heard, pulls by outcome, messages received."""
        m = self.metrics
        return {
            "duplicates": {
                "announcement": int(m.counter("node_trainer_duplicates_total", "announcement")),
                "body": int(m.by_label("node_trainer_batches_rejected_total").get("duplicate", 0)),
            },
            "pulls": m.by_label("node_trainer_pulls_total"),
            "gossip_received": int(sum(m.by_label("node_gossip_received_total").values())),
        }

    def _remember(self, digest: str, entry: Known) -> None:
        self.known[digest] = entry
        self.known.move_to_end(digest)
        while len(self.known) > KNOWN:
            self.known.popitem(last=False)

    def admitted(self, batch: RolloutBatch, envelope: bytes, judges: list[str], full: bool = False) -> str:
        """Record an admitted batch and acknowledge it on gossip (the push's reply already told its producer)."""
        digest = hashlib.sha256(envelope).hexdigest()
        key = (batch.node_id, batch.version, batch.batch_index)
        self._remember(digest, Known(key, judges, time.monotonic(), full, batch.node_id))
        self.held[digest] = envelope
        while len(self.held) > KNOWN // 8:
            self.held.popitem(last=False)
        self._spawn(self._ack(batch, digest, judges, full), "acknowledgement")
        return digest

    async def _ack(self, batch: RolloutBatch, digest: str, judges: list[str], full: bool = False) -> None:
        ack = BatchAck(
            run_id=self.run_id,
            epoch=self.epoch,
            node_id=batch.node_id,
            version=batch.version,
            batch_index=batch.batch_index,
            batch_sha256=digest,
            judges=judges,
            full=full,
            issued=time.time(),
        )
        await self._gossip_out("verdicts", seal(self.identity, ack))

    async def _on_announce(self, data: bytes, peer: str) -> None:
        signed = open_signed(data, BatchAnnounce)
        a = signed.message
        if a.run_id != self.run_id or a.epoch != self.epoch:
            raise Rejected("wrong_run", f"announcement for run {a.run_id} epoch {a.epoch}")
        if signed.signer_id != a.node_id:
            raise Rejected("signer_mismatch", "an announcement of another node's batch")
        self.metrics.inc("node_trainer_announcements_total", help="batch announcements heard")
        known = self.known.get(a.batch_sha256)
        if known is not None:
            if known.node_id != a.node_id:  # someone else's batch: only its producer may ask for the ack again
                raise Rejected("foreign_announcement", "an announcement of a digest that is another node's batch")
            self.metrics.inc(
                "node_trainer_duplicates_total",
                label="announcement",
                help="announcements and bodies of batches already held",
            )
            if known.key is not None and time.monotonic() - known.acked > ACK_REPEAT_S:  # the producer missed it
                known.acked = time.monotonic()
                await self._ack(self._keyed(known.key), a.batch_sha256, known.judges, known.full)
            return
        record = await self.registry.registered(a.node_id)
        if record is None or record.role != "inference":
            raise Rejected("unknown_signer", "no inference record for this key in the run's DHT")
        if a.node_id in self.banned:
            raise Rejected("banned", "an announcement from a banned node")
        self.admission.check(record)  # the run's policy and proof of work, as for a push
        self.check_room(a.node_id)  # the probation limits, as for a push, and the producer's share
        if self._pulling[a.node_id] >= PULLS_PER_NODE or sum(self._pulling.values()) >= MAX_PULLS:
            self.metrics.inc("node_trainer_pulls_total", label="busy")
            return  # its batch is being fetched, or many are: it announces this one again later
        self._remember(a.batch_sha256, Known(None, [], 0.0, False, a.node_id))
        self._pulling[a.node_id] += 1
        task = self._spawn(self._pull(a, peer), "pull")
        task.add_done_callback(lambda _: self._forget_pull(a.node_id))

    def _forget_pull(self, node_id: str) -> None:
        self._pulling[node_id] -= 1
        if self._pulling[node_id] <= 0:
            del self._pulling[node_id]

    @staticmethod
    def _keyed(key: Any) -> RolloutBatch:
        """A stand-in carrying a batch key's fields, for re-acknowledging (the groups are not needed)."""
        node_id, version, index = key
        return RolloutBatch.model_construct(node_id=node_id, version=version, batch_index=index)

    async def _pull(self, a: BatchAnnounce, peer: str) -> None:
        """Fetch an announced batch that was not pushed, and put it through the door like a pushed one."""
        await asyncio.sleep(PULL_AFTER_S)
        known = self.known.get(a.batch_sha256)
        if known is not None and known.key is not None:
            return  # pushed meanwhile
        assert self.source is not None
        outcome = await self.source.pull(peer, a.batch_sha256, a.size)
        self.metrics.inc(
            "node_trainer_pulls_total", label=outcome, help="announced batches fetched from their producer, by outcome"
        )
        if outcome != "ok":
            self.known.pop(a.batch_sha256, None)  # the next announcement tries again

    async def _on_verdict(self, data: bytes, peer: str) -> None:
        if kind_of(data, LIMITS["verdicts"]) != Verdict.KIND:
            return  # an acknowledgement (ours, or a replay): nothing to do here
        signed = open_signed(data, Verdict)
        if signed.signer_id not in self.validators:
            raise Rejected("untrusted_validator", f"verdict signed by {signed.signer_id}")
        v = signed.message
        wait = self.waits.get(v.batch_sha256)
        if wait is None or v.run_id != self.run_id:
            self.metrics.inc("node_trainer_verdicts_unmatched_total", help="verdicts for no batch awaiting one")
            return
        wait.add(signed.signer_id, v, data)
