"""The rollout transport's two ends: how a producer's sealed batches reach the trainer, and its reply comes back.

- ``RolloutSink``: the producer's end (node/roles/inference.py). It hands each batch it seals to ``offer`` (and
  to ``reoffer`` while the trainer has not acknowledged it), sends it with ``push`` and gets the trainer's reply;
  ``start`` takes the call to make when the trainer acknowledges one of its batches apart from a push's reply.
- ``RolloutSource``: the trainer's end (node/roles/trainer.py). ``start`` takes a ``Receiver``: the door every
  batch goes through (``on_batch``), the refusal of one refused before the door (``reject``: busy, oversized)
  and the trainer's ``Intake``, the one budget of batch bodies being received at once, however they come in.
  ``pull`` takes a batch its producer offered but did not push, and puts it through the same door.

What stays with the roles, whatever the transport: what a reply means (retry, pause, next index), which batches
are still worth delivering, who may offer (the trainer's gossip part checks an announcer before any pull), and
every check the door makes. A transport moves bytes: every batch is a signed envelope of at most
``Channel.ROLLOUT_BATCH`` bytes and every reply a ``SubmitReply`` the run key signed, whatever carries them.

Adding a transport: a module with a sink and a source class, each built from an ``Endpoint``, and one line in
``TRANSPORTS`` (node/p2p/rollouts/__init__.py). The built-in one is ``libp2p`` (node/p2p/rollouts/libp2p.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from intellect_node.p2p.gossip import Gossip
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.transport import Intake
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RolloutBatch, SubmitReply

Acknowledged = Callable[[str], None]
"""Called with a batch's SHA-256 (hex) when the trainer acknowledged it apart from a push's reply."""


@dataclass(frozen=True)
class Endpoint:
    """What a transport's end is built from: this node's libp2p daemon, its gossip (None on the trainer, whose
    gossip part owns its own), its key, the run and the node's metrics."""

    p2p: Any
    identity: Identity
    run_id: str
    metrics: Metrics
    gossip: Gossip | None = None


@dataclass(frozen=True)
class Receiver:
    """Where a source hands what it receives: the trainer's door."""

    on_batch: Callable[[bytes, str], Awaitable[SubmitReply]]
    """A batch's envelope and the peer it came from; the reply to send back (ok, or why it was refused)."""
    reject: Callable[[Rejected, str], SubmitReply]
    """The reply to a batch refused before the door (busy, oversized, malformed), counted against its peer."""
    intake: Intake
    """Batch bodies being received at once, pushed or pulled: a source takes a place before it reads a body."""


class RolloutSink(ABC):
    """The producer's end (module docstring). Only ``push`` is required: a transport that only pushes keeps the
    defaults of the others."""

    async def start(self, acknowledged: Acknowledged) -> None:
        """Begin: serve what is offered, and call ``acknowledged`` with the digest of each of this node's batches
        the trainer acknowledges apart from a push's reply."""
        return None

    async def offer(self, batch: RolloutBatch, data: bytes) -> bool:
        """A batch just sealed (``data``, its envelope): make it available to the trainer, for when a push does not
        arrive. True when it was announced; never raises for the network (it is offered again)."""
        return False

    async def reoffer(self, batch: RolloutBatch, data: bytes) -> bool:
        """An offered batch the trainer has not acknowledged yet, offered again (every few seconds, until it is
        acknowledged or goes stale). True when it was announced."""
        return False

    @abstractmethod
    async def push(self, trainer: NodeRecord, data: bytes) -> SubmitReply:
        """Deliver one batch to ``trainer`` and return its reply, checked to be signed by the run key. Raises one
        of ``DELIVERY_ERRORS`` (node/p2p/transport.py) or ``Rejected`` when nothing was decided: the producer
        sends the same batch again later."""

    async def push_sealed(self, trainer: NodeRecord, data: bytes) -> tuple[SubmitReply, bytes]:
        """``push``, with the reply as the trainer sealed it when the transport has it (else empty bytes): a
        producer keeps a refusal's signed reply as evidence (node/roles/credit.py)."""
        return await self.push(trainer, data), b""

    async def close(self) -> None:
        """Stop serving what was offered."""
        return None


class RolloutSource(ABC):
    """The trainer's end (module docstring)."""

    @abstractmethod
    async def start(self, receiver: Receiver) -> None:
        """Begin receiving: every batch to ``receiver.on_batch``, each reply back to its producer."""

    async def pull(self, peer: str, digest: str, size: int) -> str:
        """Take the batch of SHA-256 ``digest`` (at most ``size`` bytes) that ``peer`` offered and did not push,
        and put it through the door. Returns the outcome: ``ok``, the door's refusal reason, or why nothing
        reached the door (``intake_full``, ``missing``, ``unreachable``, ...). A transport that only pushes has
        nothing to take."""
        return "unsupported"

    async def close(self) -> None:
        """Stop receiving."""
        return None
