"""What the trainer's parts share, each piece with one owner that changes it and a small interface for the rest.

- ``TrainQueue``: validated, scored groups waiting to be trained. The judging pipeline adds to it (and drops a
  banned producer's groups), the learner takes from it, the door reads how much of a producer's work it holds.
- ``InFlight``: admitted batches whose verdict is not yet applied, and their groups per producer. The door adds a
  batch once it is admitted (or the replay after a restart does), the judging pipeline marks it done. It keeps a
  running estimate of how long a verdict takes, which the door hands to producers it answers ``busy``.
- ``RewardCurve``: the rewards of every rollout accepted since the last step (the learner's reported reward, not
  only the trained groups'); batches replayed after a restart are not counted twice.
- ``Refusals``: batches refused for good since the last step, by producer and reason: the door and the judging
  pipeline count them, the learner hands them to the step's contribution-ledger entry.
- ``Ledger``: what became of each accepted batch's groups: one log line per outcome, for accounting across
  restarts, and the batches none of whose groups were trained, for the step's contribution-ledger entry.
- ``Progress``: the step the learner reached and the newest version published, with a running estimate of the
  time between versions (what the door tells a producer that has to wait for the next one). The learner counts
  steps, durability publishes; the door, the judging pipeline and gossip read them.

None of them knows the trainer (node/roles/trainer.py), which wires them into its parts.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from intellect_node.p2p.metrics import BoundedCounter
from intellect_node.policy.engine import BatchKey, Group
from intellect_protocol.ledger import MAX_REFUSALS

STATUS_NODES = 1024
"""Node ids /status shows counts for (batches received, accepted, refused); the rest are summed as others."""
OPEN_BATCHES = 100_000
"""Acknowledged batches whose outcome ``Ledger`` follows at most (a few hundred bytes each)."""
MAX_DROPPED = 100_000
"""Batches dropped untrained one ledger entry names at most."""
FINAL_WAIT_S = 120.0
"""What a finished run (``max_steps`` made) tells a producer to wait before it sends again: the longest a producer
waits on one reply (inference.RETRY_HINT_MAX_S)."""
RUNNING_WEIGHT = 0.3
"""The weight of the newest sample in the trainer's running estimates (time to a verdict, time between versions)."""
UNESTIMATED_WAIT_MIN_S = 1.0
UNESTIMATED_WAIT_MAX_S = 8.0
"""Before its first verdict the trainer cannot say when a place frees; it tells a producer to wait half the age of
the oldest batch in flight, between these two (the waits grow as the judging takes long: a newcomer asked once a
second, 17 refusals in the demo's first minute; the cap keeps one that asked just before the verdict from sleeping
long past it, since its sleep is not cut short)."""
ledger_log = logging.getLogger("intellect_node.ledger")
"""One line per accepted batch and per outcome of its groups (trained, stale, banned, invalid, filtered,
unscorable): ``LEDGER <event> <epoch> <node> <version> <index> <groups> <step>``. benchmarks/chaos.py adds these up
across a trainer's lives to find accepted rollouts that were lost. Off unless $INTELLECT_NODE_LEDGER_LOG is 1
(config.LEDGER_LOG_ENV): at INFO they were most of a trainer's log."""


class TrainQueue:
    """Groups that passed judging and were scored, waiting for a training step, with a count per producer."""

    def __init__(self) -> None:
        self.groups: list[Group] = []
        self.by_node: Counter[str] = Counter()
        self.changed = asyncio.Event()
        """Set whenever groups are added: the learner waits on it for a full batch."""

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, node_id: str, groups: list[Group]) -> None:
        self.groups.extend(groups)
        self.by_node[node_id] += len(groups)
        self.changed.set()

    def drop_node(self, node_id: str) -> list[Group]:
        """Remove every group of ``node_id`` (banned); returns them."""
        dropped = [g for g in self.groups if g.node_id == node_id]
        self.groups = [g for g in self.groups if g.node_id != node_id]
        self.by_node.pop(node_id, None)
        return dropped

    def fresh(self, floor: int) -> int:
        """Groups of a version at least ``floor``: those that will still be trained."""
        return sum(1 for g in self.groups if g.version >= floor)

    def take(self, n: int, floor: int) -> tuple[list[Group] | None, list[Group]]:
        """Drop the groups older than ``floor`` (returned second), then take ``n`` groups, oldest version first
        (they go stale soonest), or None while fewer than ``n`` are fresh."""
        stale = [g for g in self.groups if g.version < floor]
        self.groups = [g for g in self.groups if g.version >= floor]
        batch: list[Group] | None = None
        if len(self.groups) >= n:
            self.groups.sort(key=lambda g: g.version)
            batch, self.groups = self.groups[:n], self.groups[n:]
        self.by_node = Counter(g.node_id for g in self.groups)
        return batch, stale


class InFlight:
    """Admitted batches whose verdict is not yet applied (judged here or by validators), by key, and their groups
    per producer (counts that fall to zero leave: a flood of keys leaves nothing behind), and a running estimate of
    the seconds from a batch's admission to its verdict (``judge_s``, 0 until one was judged)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.keys: dict[BatchKey, float] = {}
        """Each batch in flight, with when it was admitted (``clock``)."""
        self.groups_by_node = BoundedCounter()
        self.clock = clock
        self.judge_s = 0.0

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def add(self, key: BatchKey, groups: int) -> None:
        self.keys[key] = self.clock()
        self.groups_by_node[key[0]] += groups

    def done(self, key: BatchKey, groups: int) -> None:
        admitted = self.keys.pop(key, None)
        if admitted is None:
            return
        self.groups_by_node[key[0]] -= groups
        took = self.clock() - admitted
        self.judge_s = took if not self.judge_s else (1 - RUNNING_WEIGHT) * self.judge_s + RUNNING_WEIGHT * took

    def until_verdict(self, node_id: str | None = None) -> float:
        """Seconds until the oldest batch in flight (of ``node_id``, or of anyone) is expected to have its verdict,
        freeing a place: the running time to a verdict less its age. One already overdue (its judging waits behind
        a training step on the same cores, say) is given half the running time again. Before any verdict, half the
        oldest one's age (within ``UNESTIMATED_WAIT_MIN_S`` and ``UNESTIMATED_WAIT_MAX_S``); 0 with none in
        flight."""
        admitted = [at for key, at in self.keys.items() if node_id is None or key[0] == node_id]
        if not admitted:
            return 0.0
        age = self.clock() - min(admitted)
        if not self.judge_s:
            return min(UNESTIMATED_WAIT_MAX_S, max(UNESTIMATED_WAIT_MIN_S, age / 2))
        left = self.judge_s - age
        return left if left > 0 else self.judge_s / 2

    def of(self, node_id: str) -> int:
        """Batches of ``node_id`` in flight."""
        return sum(1 for key in self.keys if key[0] == node_id)

    def count(self, which: Callable[[str], bool]) -> int:
        """Batches in flight whose producer ``which`` selects."""
        return sum(1 for key in self.keys if which(key[0]))

    def groups(self) -> int:
        return sum(self.groups_by_node.values())

    def clear(self) -> None:
        self.keys.clear()
        self.groups_by_node.clear()


class RewardCurve:
    """The rewards of the rollouts accepted since the last step. A batch replayed after a restart whose rewards
    were counted before it (``replayed``) is not counted again."""

    def __init__(self, seen: Iterable[float] = ()) -> None:
        self.seen: list[float] = list(seen)
        self._counted: set[BatchKey] = set()

    def replayed(self, key: BatchKey) -> None:
        self._counted.add(key)

    def accepted(self, key: BatchKey, groups: list[Group]) -> None:
        if key in self._counted:
            self._counted.discard(key)
            return
        for g in groups:
            self.seen.extend(g.rewards)

    def drain(self) -> list[float]:
        """Every reward accepted since the last call."""
        seen, self.seen = self.seen, []
        return seen


NOT_DECIDED = frozenset({"busy", "backlog_full", "unknown_signer", "duplicate", "out_of_order"})
"""Refusals that decide nothing about a batch (sent again later, or already decided): not in the ledger."""
_REASON = re.compile(r"[a-z_]{1,32}")
_NODE = re.compile(r"[0-9a-f]{32}")


class Refusals:
    """Batches refused for good since the last ledger entry (protocol/ledger.py), by producer and reason. Bounded
    like an entry: past ``MAX_REFUSALS`` (producer, reason) pairs a new pair is not recorded (a flood of registered
    keys cannot grow an entry without bound)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, node_id: str, reason: str) -> None:
        if reason in NOT_DECIDED or not _NODE.fullmatch(node_id):
            return
        key = (node_id, reason if _REASON.fullmatch(reason) else "other")
        if key in self.counts:
            self.counts[key] = min(self.counts[key] + 1, 2**31 - 1)
        elif len(self.counts) < MAX_REFUSALS:
            self.counts[key] = 1

    def drain(self) -> dict[str, dict[str, int]]:
        """Every refusal counted since the last call: producer -> reason -> batches."""
        out: dict[str, dict[str, int]] = {}
        for (node, reason), n in self.counts.items():
            out.setdefault(node, {})[reason] = n
        self.counts = {}
        return out


@dataclass
class Progress:
    step: int = 0
    """Completed training steps: version ``step`` exists (published once ``published`` reaches it)."""
    published: int = -1
    """The newest version written, signed and announced."""
    clock: Callable[[], float] = time.monotonic
    published_at: float = -1.0
    """When ``published`` last moved (or the trainer started: ``clock`` at construction)."""
    version_s: float = 0.0
    """A running estimate of the seconds from one published version to the next (0 until two were)."""
    publishes: int = 0
    """Versions published in this life of the trainer."""
    final: bool = False
    """No version follows the newest: the trainer made its ``max_steps``."""

    def __post_init__(self) -> None:
        if self.published_at < 0:
            self.published_at = self.clock()

    def publish(self, version: int) -> None:
        """Version ``version`` was published now: the estimate of the time between versions takes it in (not the
        first one of this life, which waited for the swarm's first rollouts)."""
        now = self.clock()
        if self.publishes and version > self.published:
            took = now - self.published_at
            self.version_s = (
                took if not self.version_s else (1 - RUNNING_WEIGHT) * self.version_s + RUNNING_WEIGHT * took
            )
        self.published, self.published_at = version, now
        self.publishes += 1

    def stepped(self, seconds: float) -> None:
        """A training step took ``seconds``: the first estimate of the time between versions, until two versions
        of this life were published (a producer told to wait for the second version is told this)."""
        if not self.version_s:
            self.version_s = seconds

    def until_version(self) -> float:
        """Seconds until the next version is expected: the running time between versions less the time since the
        last. One already overdue is given a quarter of the running time again. 0 without an estimate;
        ``FINAL_WAIT_S`` once no version follows (told "next in 0 s", producers of a finished run sent their batch
        four times a second until stopped)."""
        if self.final:
            return FINAL_WAIT_S
        if not self.version_s:
            return 0.0
        left = self.version_s - (self.clock() - self.published_at)
        return left if left > 0 else self.version_s / 4


class Ledger:
    """What became of each acknowledged batch's groups: ``LEDGER`` lines (``ledger_log``) for run epoch ``epoch``,
    each with the step ``step`` returns, and the batches whose every group was dropped untrained, for the next
    contribution-ledger entry (``drain_dropped``). Every acknowledged group ends in exactly one event: trained,
    stale, banned, invalid, unscorable or filtered."""

    def __init__(self, epoch: int, step: Callable[[], int]) -> None:
        self.epoch = epoch
        self.step = step
        self.open: OrderedDict[BatchKey, list[Any]] = OrderedDict()
        """Acknowledged batches with groups still undecided: [digest, groups undecided, groups trained, the last
        reason one was dropped], the oldest first, at most OPEN_BATCHES."""
        self.dropped: list[tuple[str, str, str]] = []

    def __call__(self, event: str, key: BatchKey, groups: int, digest: str = "") -> None:
        if groups > 0 and ledger_log.isEnabledFor(logging.INFO):
            ledger_log.info("LEDGER %s %d %s %d %d %d %d", event, self.epoch, *key, groups, self.step())
        if event == "acked":
            self.follow(key, groups, digest)
            return
        account = self.open.get(key) if groups > 0 else None
        if account is None:  # accepted before a restart: its outcome is not tracked
            return
        account[1] -= groups
        if event == "trained":
            account[2] += groups
        else:
            account[3] = event
        if account[1] <= 0:
            del self.open[key]
            if account[2] == 0 and len(self.dropped) < MAX_DROPPED:
                self.dropped.append((key[0], account[0], account[3]))

    def follow(self, key: BatchKey, groups: int, digest: str) -> None:
        """Follow the outcome of ``groups`` undecided groups of batch ``key`` (an acknowledged one, or one replayed
        whole after a restart), none trained yet."""
        if digest and groups > 0:
            self.open[key] = [digest, groups, 0, ""]
            while len(self.open) > OPEN_BATCHES:  # bounded: the oldest is forgotten (never reported dropped)
                self.open.popitem(last=False)

    def drain_dropped(self) -> list[tuple[str, str, str]]:
        """The batches dropped untrained since the last call: (producer, digest, reason)."""
        out, self.dropped = self.dropped, []
        return out


@dataclass
class Shared:
    """What the trainer's parts share, made once by the trainer and handed to each part that needs it."""

    queue: TrainQueue
    inflight: InFlight
    curve: RewardCurve
    ledger: Ledger
    progress: Progress = field(default_factory=Progress)
    refusals: Refusals = field(default_factory=Refusals)
    banned: dict[str, str] = field(default_factory=dict)
    """Nodes caught cheating, with why: refused for the rest of the run (``verify.ban``). The judging pipeline
    bans; the door, gossip and the origin's slots refuse a banned key. Changed in place, never replaced."""
    accepted_by_node: BoundedCounter = field(default_factory=lambda: BoundedCounter(STATUS_NODES))
    rejected_by_node: BoundedCounter = field(default_factory=lambda: BoundedCounter(STATUS_NODES))
    received_by_node: BoundedCounter = field(default_factory=lambda: BoundedCounter(STATUS_NODES))
