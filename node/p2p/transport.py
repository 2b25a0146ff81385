"""Requests over hivemind's libp2p streams: one request, one reply, both size-bounded.

Framing: an 8-byte big-endian length, then that many bytes; the length is checked against the channel limit
before a byte of the body is read. Protocols:

- ``intellect-node/<run_id>/submit/v1``: a signed RolloutBatch envelope to the trainer, a signed SubmitReply back.
- ``intellect-node/<run_id>/redeem/v1``: a signed Redeem (an invite bound to its signer) to the trainer, a signed
  SubmitReply back (node/roles/invites.py).

Validators get their batches by digest (node/p2p/batches.py) once the trainer's gossiped acknowledgement names
them (node/p2p/gossip.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from intellect_node.aio import within
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import SubmitReply, WireModel

logger = logging.getLogger(__name__)
HEADER = 8
IO_TIMEOUT_S = 60.0
MAX_CONCURRENT_STREAMS = 16
"""Submissions handled at once, once read; more wait (each holds one batch in memory)."""
HEADER_TIMEOUT_S = 10.0
MIN_SEND_BPS = 256 * 1024
"""A frame must arrive at this rate at least (a 16 MiB batch in 64 s): a peer that trickles is cut off."""
MAX_READING = 32
"""Batch bodies being received at once, over all peers, pushed or pulled: bounds memory (each up to one frame)
whatever peers do."""
MAX_READING_PER_PEER = 2
LINGER_S = 5.0
STRIKES = 3
PENALTY_S = 60.0
DISCONNECTS_PER_S = 20
DISCONNECT_AFTER_S = 2.0
TARPIT_S = 10.0
TARPIT_PER_PEER = 2
TARPIT_MAX = 64
PENALIZED = frozenset({"malformed", "oversized", "bad_signature", "version", "kind", "schema", "banned", "rate"})
"""Replies that say a frame was unusable, came from a banned key, or came faster than one peer may send (a
protocol's own rate per peer, far above what an honest node asks): they count against the peer that sent it
(never a refusal honest work can get)."""
LARGE_FRAME = 256 * 1024
"""Frames past this size are opened (signature, decoding) in a thread, off the event loop."""

DELIVERY_ERRORS = (OSError, TimeoutError, asyncio.IncompleteReadError, P2PDaemonError, P2PHandlerError)
"""What a failed delivery can raise: the caller counts it and tries again later."""

T = TypeVar("T")
BatchHandler = Callable[[bytes, str], Awaitable[WireModel]]
RejectHandler = Callable[[Rejected, str], WireModel]


def submit_protocol(run_id: str) -> str:
    return f"intellect-node/{run_id}/submit/v1"


async def _write_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(len(data).to_bytes(HEADER, "big"))
    writer.write(data)
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    length = int.from_bytes(await reader.readexactly(HEADER), "big")
    if length > limit:
        raise Rejected("oversized", f"{length} bytes > limit of {limit}")
    return await reader.readexactly(length)


ENVELOPE_FIRST_BYTE = 0x85
"""Every frame on these protocols is a signed envelope: a msgpack map of five entries (protocol/envelope.py)."""


async def read_frame_within(reader: asyncio.StreamReader, limit: int) -> bytes:
    """A frame from a peer under deadlines: the header within ``HEADER_TIMEOUT_S``, the body at ``MIN_SEND_BPS``
    or better. Raises TimeoutError for a peer that stalls or trickles; a body that does not start as an envelope
    is refused before the rest of it is read."""
    length = int.from_bytes(await within(reader.readexactly(HEADER), HEADER_TIMEOUT_S), "big")
    if length > limit:
        raise Rejected("oversized", f"{length} bytes > limit of {limit}")
    if length == 0:
        raise Rejected("malformed", "an empty frame")
    deadline = HEADER_TIMEOUT_S + length / MIN_SEND_BPS
    first = await within(reader.readexactly(1), deadline)
    if first[0] != ENVELOPE_FIRST_BYTE:
        raise Rejected("malformed", "not a signed envelope")
    return first + await within(reader.readexactly(length - 1), deadline)


async def off_loop_if_large(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a thread when it works on a large frame (a 16 MiB signature check or decode would stall
    every other peer's requests)."""
    if size > LARGE_FRAME:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class Intake:
    """The budget of batch bodies being received at once (``MAX_READING``, ``MAX_READING_PER_PEER`` each), shared by
    every way a body comes in: a producer's push and the trainer's pull of an announced batch."""

    def __init__(self, total: int = MAX_READING, per_peer: int = MAX_READING_PER_PEER) -> None:
        self.total, self.per_peer = total, per_peer
        self._reading: dict[str, int] = {}

    def take(self, peer: str) -> bool:
        """One body from ``peer`` may be received now (give it back with ``give_back``); False when either the peer
        or everybody together is at the limit."""
        if sum(self._reading.values()) >= self.total or self._reading.get(peer, 0) >= self.per_peer:
            return False
        self._reading[peer] = self._reading.get(peer, 0) + 1
        return True

    def give_back(self, peer: str) -> None:
        self._reading[peer] -= 1
        if not self._reading[peer]:
            del self._reading[peer]

    def __len__(self) -> int:
        return sum(self._reading.values())


class RolloutServer:
    """Accepts rollout batches on one of the run's protocols (submit by default) and answers each with a signed
    reply."""

    def __init__(
        self,
        p2p: P2P,
        identity: Identity,
        run_id: str,
        handle: BatchHandler,
        reject: RejectHandler,
        protocol: Callable[[str], str] = submit_protocol,
        intake: Intake | None = None,
        limit: int = Channel.ROLLOUT_BATCH.value,
    ) -> None:
        self._p2p = p2p
        self._limit = limit
        self._identity = identity
        self._name = protocol(run_id)
        self._handle = handle
        self._reject = reject
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_STREAMS)
        self.intake = intake or Intake()
        self._strikes: dict[str, list[float]] = {}
        self._drop_budget, self._drop_at = float(DISCONNECTS_PER_S), time.monotonic()
        self._held: dict[str, int] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        self.refused_busy = 0
        self.disconnects = 0

    def _strike(self, peer: str) -> None:
        now = time.monotonic()
        if len(self._strikes) > 10_000:
            self._strikes = {p: t for p, t in self._strikes.items() if t and now - t[-1] < PENALTY_S}
        self._strikes[peer] = [t for t in self._strikes.get(peer, []) if now - t < PENALTY_S][-STRIKES:] + [now]

    def _penalized(self, peer: str) -> bool:
        """A peer that sent STRIKES unusable frames within PENALTY_S is refused unread until that has passed."""
        recent = [t for t in self._strikes.get(peer, []) if time.monotonic() - t < PENALTY_S]
        return len(recent) >= STRIKES

    async def _tarpit(self, peer: str) -> None:
        """Hold a penalized peer's stream unread for TARPIT_S before refusing it (TARPIT_PER_PEER streams per
        peer, TARPIT_MAX in all; past that, refused at once and disconnected). Refused at once, a peer sending
        4 MiB frames in a loop had 55 of them a second through our daemon (30% of the training rate); held, its
        stream's flow-control window fills and it waits, at the cost of one idle coroutine here."""
        held = self._held.get(peer, 0)
        if held >= TARPIT_PER_PEER or sum(self._held.values()) >= TARPIT_MAX:
            return
        self._held[peer] = held + 1
        try:
            await asyncio.sleep(TARPIT_S)
        finally:
            self._held[peer] -= 1
            if not self._held[peer]:
                del self._held[peer]

    def _disconnect(self, peer_id: PeerID) -> None:
        """Drop a penalized peer's connection (at most DISCONNECTS_PER_S of them a second, all peers together). On
        a live connection its streams' flow-control windows have grown, so each 4 MiB frame it sends arrives whole
        and is decrypted by our daemon before we refuse it unread (envelope bombs cost 30% of the training rate);
        on a fresh connection each frame gets the initial window only, after a handshake."""
        peer, now = peer_id.to_base58(), time.monotonic()
        self._drop_budget = min(DISCONNECTS_PER_S, self._drop_budget + (now - self._drop_at) * DISCONNECTS_PER_S)
        self._drop_at = now
        if self._drop_budget < 1:
            return
        self._drop_budget -= 1
        self.disconnects += 1

        async def drop() -> None:
            try:
                await within(self._p2p._client.disconnect(peer_id), IO_TIMEOUT_S)
            except Exception as e:  # the daemon's errors, a peer already gone: nothing to do
                logger.debug("could not disconnect peer=%s: %r", peer, e)

        task = asyncio.ensure_future(drop())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(self._name, self._on_stream)

    async def close(self) -> None:
        try:
            await self._p2p.remove_binary_stream_handler(self._name)
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("could not remove stream handler: %s", e)

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read the whole frame first, under deadlines and per-peer caps, and only then take a handling slot: a
        peer holding streams open without sending cannot take the handling slots from the others."""
        peer = info.peer_id.to_base58()
        penalized = self._penalized(peer)
        try:
            reply: WireModel | None = None
            if penalized:
                self.refused_busy += 1
                await self._tarpit(peer)
                reply = self._reject(Rejected("busy", "too many malformed frames from this peer; wait a minute"), peer)
            elif not self.intake.take(peer):
                self.refused_busy += 1
                reply = self._reject(Rejected("busy", "too many streams open; send again shortly"), peer)
            else:
                try:
                    data = await read_frame_within(reader, self._limit)
                except Rejected as e:
                    reply = self._reject(e, peer)
                finally:
                    self.intake.give_back(peer)
                if reply is None:
                    async with self._slots:
                        reply = await self._handle(data, peer)
                if getattr(reply, "reason", "") in PENALIZED:
                    self._strike(peer)
            await within(_write_frame(writer, seal(self._identity, reply)), IO_TIMEOUT_S)
            # Close only once the peer has read the reply and closed its side (or after LINGER_S): closing at
            # once after the write lost the reply's body now and then (the daemon dropped what it had not sent).
            await within(reader.read(1), LINGER_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.debug("stream from peer=%s broke: %r", peer, e)
        finally:
            writer.close()
            if penalized:  # a while after the reply (it says why): the daemon still has to deliver it, and the
                # frame's unread bytes end the linger at once (a disconnect right away lost the reply now and then)
                asyncio.get_running_loop().call_later(DISCONNECT_AFTER_S, self._disconnect, info.peer_id)


async def request(
    p2p: P2P, peer_id: str, protocol: str, data: bytes, limit: int, timeout: float = IO_TIMEOUT_S
) -> bytes:
    """Send one frame to ``peer_id`` on ``protocol``; returns the reply frame (at most ``limit`` bytes).

    A peer that cannot be reached (gone, restarted at another address) raises ConnectionError, like any socket:
    the daemon's own error types never reach the caller's loop."""
    try:
        _, reader, writer = await within(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol), IO_TIMEOUT_S
        )
    except (P2PDaemonError, P2PHandlerError) as e:  # ControlFailure (dial failed) is a P2PDaemonError
        raise ConnectionError(f"cannot reach peer {peer_id}: {e}") from e
    try:
        await within(_write_frame(writer, data), IO_TIMEOUT_S)
        return await within(_read_frame(reader, limit), timeout)
    finally:
        writer.close()


async def submit(
    p2p: P2P,
    peer_id: str,
    run_id: str,
    data: bytes,
    trainer_id: str,
    protocol: Callable[[str], str] = submit_protocol,
) -> SubmitReply:
    """Send one signed request (a batch, by default) to ``peer_id``; the reply must be signed by ``trainer_id``'s
    key."""
    return (await submit_sealed(p2p, peer_id, run_id, data, trainer_id, protocol))[0]


async def submit_sealed(
    p2p: P2P,
    peer_id: str,
    run_id: str,
    data: bytes,
    trainer_id: str,
    protocol: Callable[[str], str] = submit_protocol,
) -> tuple[SubmitReply, bytes]:
    """``submit``, with the reply as the trainer sealed it (its signed word, to keep as evidence)."""
    raw = await request(p2p, peer_id, protocol(run_id), data, Channel.REPLY.value)
    signed = open_signed(raw, SubmitReply)
    if signed.signer_id != trainer_id:
        raise Rejected("foreign_reply", f"reply signed by {signed.signer_id}, not the trainer {trainer_id}")
    return signed.message, raw
