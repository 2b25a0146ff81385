"""Invites redeemed at join: the trainer's door for them, and the volunteer's call to it.

Protocol ``intellect-node/<run>/redeem/v1`` (framing and limits of node/p2p/transport.py): a ``Redeem`` signed by
the joining node, carrying the invite its operator gave it; the answer is a ``SubmitReply`` signed by the run key
(ok, or the reason: ``not_admitted``, ``bad_invite``, ``invite_expired``, ``invite_used_up``).

Who may call it: anyone (a newcomer has no standing yet). How often and with how much: frames of at most
``Channel.REPLY`` bytes, one read at a time per peer and 8 in all, ``RATE_PER_PEER`` requests a second per libp2p
peer (past that, refused as ``rate``, which counts as a strike: three and the peer's streams are held unread, then
its connection dropped, as for unusable frames) and ``RATE_ALL`` from everybody together (refused as busy), both
before anything is verified. What a call costs us: two Ed25519 verifications (the request, then the invite), and,
for a redemption that takes a use, one small fsynced file write; redemptions are serialized, so an invite's uses
cannot be over-counted by racing requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.p2p import P2P

from intellect_node.p2p.gossip import TokenBuckets
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.transport import Intake, RolloutServer, submit
from intellect_node.roles.admission import Admission
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import Redeem, SubmitReply

logger = logging.getLogger(__name__)
RATE_PER_PEER = 1.0
"""Redeem requests per second one libp2p peer may make (a burst of ``BURST``): a joiner needs one."""
BURST = 5.0
RATE_ALL = 20.0
"""Redeem requests per second from everybody together."""
FIXES = {
    "not_admitted": "this run admits invited nodes only: ask its operator for an invite and join with --invite TOKEN",
    "bad_invite": "the invite is not one of this run's: copy the whole token the run's operator gave you, and check "
    "--run-id",
    "invite_expired": "the invite has expired: ask the run's operator for a new one (intellect-node invite)",
    "invite_used_up": "the invite was already used by as many nodes as it admits: ask the run's operator for a new "
    "one (intellect-node invite --uses N)",
    "banned": "the trainer banned this node's key: its rollouts failed verification against the run's model; run the "
    "run's model and backend unmodified (`intellect-node doctor`), and ask the run's operator",
    "pow": "this node's proof of work was not accepted: restart it (it makes a new one for the run's epoch)",
    "stale_version": "its batches arrive too late for the trainer's staleness limit: a faster machine, or fewer "
    "--threads taken by other programs, keeps up",
    "wrong_epoch": "the run was started over: the node follows the new start within seconds; if not, restart it",
}
"""What a volunteer is told to do about each refusal."""


def redeem_protocol(run_id: str) -> str:
    return f"intellect-node/{run_id}/redeem/v1"


class InviteDoor:
    """The trainer's side: redeems invites into its ``Admission``."""

    def __init__(self, p2p: P2P, identity: Identity, run_id: str, admission: Admission, metrics: Metrics) -> None:
        self.run_id = run_id
        self.admission = admission
        self.metrics = metrics
        self._per_peer = TokenBuckets(RATE_PER_PEER, BURST)
        self._all = TokenBuckets(RATE_ALL, 2 * RATE_ALL)
        self._lock = asyncio.Lock()
        self._server = RolloutServer(
            p2p,
            identity,
            run_id,
            self.on_redeem,
            self.refuse,
            redeem_protocol,
            intake=Intake(total=8, per_peer=1),
            limit=Channel.REPLY.value,
        )

    async def start(self) -> None:
        await self._server.start()

    async def close(self) -> None:
        await self._server.close()

    def refuse(self, e: Rejected, peer: str) -> SubmitReply:
        self.metrics.inc("node_trainer_redeems_total", label=e.reason, help="invite redemptions, by outcome")
        logger.debug("refused an invite redemption peer=%s reason=%s detail=%s", peer, e.reason, e.detail)
        return SubmitReply(ok=False, reason=e.reason, detail=e.detail[:500])

    async def on_redeem(self, data: bytes, peer: str) -> SubmitReply:
        try:
            if not self._per_peer.take(peer):  # a joiner asks once: a peer past this is penalized (tarpit, then cut)
                raise Rejected("rate", "too many invite redemptions from this peer; wait a minute")
            if not self._all.take("all"):
                raise Rejected("busy", "too many invite redemptions; try again in a few seconds")
            signed = open_signed(data, Redeem)
            r = signed.message
            if signed.signer_id != r.node_id:
                raise Rejected("signer_mismatch", "a redemption for another node than its signer")
            if r.run_id != self.run_id:
                raise Rejected("wrong_run", f"a redemption for run {r.run_id}")
            async with self._lock:  # one at a time: an invite's uses are counted and written in order
                await asyncio.to_thread(self.admission.redeem, r.node_id, r.invite)
        except Rejected as e:
            return self.refuse(e, peer)
        self.metrics.inc("node_trainer_redeems_total", label="ok")
        logger.info("admitted node=%s peer=%s", r.node_id, peer)
        return SubmitReply(ok=True)


async def call_redeem(p2p: P2P, identity: Identity, run_id: str, trainer_peer: str, invite: bytes) -> SubmitReply:
    """The volunteer's side: ask the trainer to admit this node with ``invite`` (empty: admitted before?)."""
    ask = Redeem(run_id=run_id, node_id=identity.node_id, invite=invite, issued=time.time())
    return await submit(p2p, trainer_peer, run_id, seal(identity, ask), run_id, protocol=redeem_protocol)
