"""The built-in rollout transport: libp2p streams for bodies, the run's gossip for announcements and acks.

Producer (``Libp2pSink``): ``offer`` keeps the batch among the ``HELD`` newest served by digest
(``intellect-node/<run_id>/batch/v1``, node/p2p/batches.py: the trainer's pull and the validators that judge it
read it there) and announces it on the ``rollouts`` topic (``BatchAnnounce``: digest and size, signed);
``reoffer`` announces it again. ``push`` is ``submit`` (node/p2p/transport.py): one frame on
``intellect-node/<run_id>/submit/v1`` to the trainer's peer, the reply signed by the run key. The trainer's
``BatchAck`` for this node's batches, heard on the ``verdicts`` topic and signed by the run key, is passed on.

Trainer (``Libp2pSource``): a ``RolloutServer`` on the submit protocol (deadlines, size limit, the ``Intake``
budget, per-peer strikes and tarpit, signed replies) calls the door; ``pull`` fetches an announced batch from its
producer by digest within the same ``Intake`` budget and puts it through the same door. Who may be pulled from is
decided before, by the trainer's gossip part (node/roles/trainer_gossip.py), which hears the announcements.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict

from intellect_node.aio import raise_if_cancelled
from intellect_node.p2p.batches import BatchServer, fetch_batch
from intellect_node.p2p.gossip import LIMITS
from intellect_node.p2p.rollouts.base import Acknowledged, Endpoint, Receiver, RolloutSink, RolloutSource
from intellect_node.p2p.transport import RolloutServer, submit_sealed
from intellect_protocol.envelope import Rejected, kind_of, open_signed, seal
from intellect_protocol.messages import BatchAck, BatchAnnounce, NodeRecord, RolloutBatch, SubmitReply

logger = logging.getLogger(__name__)
HELD = 32
"""The producer's newest batches served by digest: to the trainer's pull, and to the validators that judge them."""


class Libp2pSink(RolloutSink):
    def __init__(self, endpoint: Endpoint) -> None:
        if endpoint.gossip is None:
            raise ValueError("the libp2p sink announces on the run's gossip: start the node's Gossip first")
        self.endpoint = endpoint
        self.gossip = endpoint.gossip
        self.held: OrderedDict[str, bytes] = OrderedDict()
        """The last HELD batches offered, by digest."""
        self._server = BatchServer(endpoint.p2p, endpoint.run_id, self.held.get, endpoint.metrics)
        self._acknowledged: Acknowledged = lambda digest: None

    async def start(self, acknowledged: Acknowledged) -> None:
        self._acknowledged = acknowledged
        self.gossip.subscribe("verdicts", self._on_ack)
        await self._server.start()

    async def close(self) -> None:
        await self._server.close()

    async def _on_ack(self, data: bytes, peer: str) -> None:
        """The trainer's acknowledgement of one of our batches: it need not be announced or sent again."""
        if kind_of(data, LIMITS["verdicts"]) != BatchAck.KIND:
            return  # a validator's verdict: nothing for a producer to do
        signed = open_signed(data, BatchAck)
        if signed.signer_id != self.endpoint.run_id:
            raise Rejected("foreign_ack", f"an acknowledgement signed by {signed.signer_id}")
        if signed.message.node_id != self.endpoint.identity.node_id:
            return
        self.endpoint.metrics.inc("node_inference_acks_total", help="acknowledgements of our batches heard on gossip")
        self._acknowledged(signed.message.batch_sha256)

    async def offer(self, batch: RolloutBatch, data: bytes) -> bool:
        self.held[hashlib.sha256(data).hexdigest()] = data
        while len(self.held) > HELD:
            self.held.popitem(last=False)
        return await self.reoffer(batch, data)

    async def reoffer(self, batch: RolloutBatch, data: bytes) -> bool:
        digest = hashlib.sha256(data).hexdigest()
        a = BatchAnnounce(
            run_id=self.endpoint.run_id,
            epoch=batch.epoch,
            node_id=batch.node_id,
            version=batch.version,
            batch_index=batch.batch_index,
            batch_sha256=digest,
            size=len(data),
            issued=time.time(),
        )
        try:
            await self.gossip.publish("rollouts", seal(self.endpoint.identity, a))
        except (OSError, TimeoutError, Rejected) as e:  # the daemon restarting: announced again later
            raise_if_cancelled()
            logger.warning("could not announce batch %s: %r", digest[:12], e)
            return False
        return True

    async def push(self, trainer: NodeRecord, data: bytes) -> SubmitReply:
        return (await self.push_sealed(trainer, data))[0]

    async def push_sealed(self, trainer: NodeRecord, data: bytes) -> tuple[SubmitReply, bytes]:
        peer_id = trainer.p2p_maddrs[0].rsplit("/p2p/", 1)[-1]
        run_id = self.endpoint.run_id
        return await submit_sealed(self.endpoint.p2p, peer_id, run_id, data, run_id)


class Libp2pSource(RolloutSource):
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._server: RolloutServer | None = None
        self._receiver: Receiver | None = None

    async def start(self, receiver: Receiver) -> None:
        e = self.endpoint
        self._receiver = receiver
        self._server = RolloutServer(
            e.p2p, e.identity, e.run_id, receiver.on_batch, receiver.reject, intake=receiver.intake
        )
        await self._server.start()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    async def pull(self, peer: str, digest: str, size: int) -> str:
        receiver = self._receiver
        assert receiver is not None, "pull before start"
        if not receiver.intake.take(peer):  # as many bodies on their way as the trainer holds at once
            return "intake_full"
        e = self.endpoint
        try:
            body = await fetch_batch(e.p2p, e.identity, e.run_id, peer, digest, size)
        except (ConnectionError, TimeoutError, Rejected) as err:
            logger.debug("could not fetch announced batch %s from peer=%s: %r", digest[:12], peer, err)
            return getattr(err, "reason", "unreachable")
        finally:
            receiver.intake.give_back(peer)
        if body is None:
            return "missing"
        reply = await receiver.on_batch(body, peer)
        return "ok" if reply.ok else reply.reason
