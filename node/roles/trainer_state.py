"""What the trainer's parts share, each piece with one owner that changes it and a small interface for the rest.

- ``TrainQueue``: validated, scored groups waiting to be trained. The judging pipeline adds to it (and drops a
  banned producer's groups), the learner takes from it, the door reads how much of a producer's work it holds.
- ``InFlight``: admitted batches whose verdict is not yet applied, and their groups per producer. The door adds a
  batch once it is admitted (or the replay after a restart does), the judging pipeline marks it done.
- ``RewardCurve``: the rewards of every rollout accepted since the last step (the learner's reported reward, not
  only the trained groups'); batches replayed after a restart are not counted twice.
- ``Ledger``: one log line per accepted batch and per outcome of its groups, for accounting across restarts.
- ``Progress``: the step the learner reached and the newest version published. The learner counts steps,
  durability publishes; the door, the judging pipeline and gossip read them.

None of them knows the trainer (node/roles/trainer.py), which wires them into its parts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from intellect_node.p2p.metrics import BoundedCounter
from intellect_node.policy.engine import BatchKey, Group

STATUS_NODES = 1024
"""Node ids /status shows counts for (batches received, accepted, refused); the rest are summed as others."""
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
    per producer (counts that fall to zero leave: a flood of keys leaves nothing behind)."""

    def __init__(self) -> None:
        self.keys: set[BatchKey] = set()
        self.groups_by_node = BoundedCounter()

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def add(self, key: BatchKey, groups: int) -> None:
        self.keys.add(key)
        self.groups_by_node[key[0]] += groups

    def done(self, key: BatchKey, groups: int) -> None:
        self.keys.discard(key)
        self.groups_by_node[key[0]] -= groups

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


@dataclass
class Progress:
    step: int = 0
    """Completed training steps: version ``step`` exists (published once ``published`` reaches it)."""
    published: int = -1
    """The newest version written, signed and announced."""


class Ledger:
    """``LEDGER`` lines (``ledger_log``) for run epoch ``epoch``, each with the step ``step`` returns."""

    def __init__(self, epoch: int, step: Callable[[], int]) -> None:
        self.epoch = epoch
        self.step = step

    def __call__(self, event: str, key: BatchKey, groups: int) -> None:
        if groups > 0 and ledger_log.isEnabledFor(logging.INFO):
            ledger_log.info("LEDGER %s %d %s %d %d %d %d", event, self.epoch, *key, groups, self.step())


@dataclass
class Shared:
    """What the trainer's parts share, made once by the trainer and handed to each part that needs it."""

    queue: TrainQueue
    inflight: InFlight
    curve: RewardCurve
    ledger: Ledger
    progress: Progress = field(default_factory=Progress)
    banned: dict[str, str] = field(default_factory=dict)
    """Nodes caught cheating, with why: refused for the rest of the run (``verify.ban``). The judging pipeline
    bans; the door, gossip and the origin's slots refuse a banned key. Changed in place, never replaced."""
    accepted_by_node: BoundedCounter = field(default_factory=lambda: BoundedCounter(STATUS_NODES))
    rejected_by_node: BoundedCounter = field(default_factory=lambda: BoundedCounter(STATUS_NODES))
    received_by_node: BoundedCounter = field(default_factory=lambda: BoundedCounter(STATUS_NODES))
