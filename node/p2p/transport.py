"""Requests over hivemind's libp2p streams: one request, one reply, both size-bounded.

Framing: an 8-byte big-endian length, then that many bytes; the length is checked against the channel limit
before a byte of the body is read. Protocols:

- ``intellect-node/<run_id>/submit/v1``: a signed RolloutBatch envelope to the trainer, a signed SubmitReply back.
- ``intellect-node/<run_id>/validate/v1``: the trainer forwards a producer's RolloutBatch envelope, unchanged,
  to a validator; the reply is the validator's signed Verdict (or a signed SubmitReply saying why it could not
  judge, e.g. it does not hold the version).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import SubmitReply, WireModel

logger = logging.getLogger(__name__)
HEADER = 8
IO_TIMEOUT_S = 60.0
MAX_CONCURRENT_STREAMS = 16
"""Submissions handled at once; more wait (each holds up to one batch in memory)."""

DELIVERY_ERRORS = (OSError, TimeoutError, asyncio.IncompleteReadError, P2PDaemonError, P2PHandlerError)
"""What a failed delivery can raise: the caller counts it and tries again later."""

BatchHandler = Callable[[bytes, str], Awaitable[WireModel]]
RejectHandler = Callable[[Rejected, str], WireModel]


def submit_protocol(run_id: str) -> str:
    return f"intellect-node/{run_id}/submit/v1"


def validate_protocol(run_id: str) -> str:
    return f"intellect-node/{run_id}/validate/v1"


async def _write_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(len(data).to_bytes(HEADER, "big"))
    writer.write(data)
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    length = int.from_bytes(await reader.readexactly(HEADER), "big")
    if length > limit:
        raise Rejected("oversized", f"{length} bytes > limit of {limit}")
    return await reader.readexactly(length)


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
    ) -> None:
        self._p2p = p2p
        self._identity = identity
        self._name = protocol(run_id)
        self._handle = handle
        self._reject = reject
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_STREAMS)

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(self._name, self._on_stream)

    async def close(self) -> None:
        try:
            await self._p2p.remove_binary_stream_handler(self._name)
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("could not remove stream handler: %s", e)

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            async with self._slots:
                await self._serve(peer, reader, writer)
        finally:
            writer.close()

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                data = await asyncio.wait_for(_read_frame(reader, Channel.ROLLOUT_BATCH.value), IO_TIMEOUT_S)
            except Rejected as e:
                reply = self._reject(e, peer)
            else:
                reply = await self._handle(data, peer)
            await asyncio.wait_for(_write_frame(writer, seal(self._identity, reply)), IO_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.debug("submit stream from peer=%s broke: %r", peer, e)


async def request(
    p2p: P2P, peer_id: str, protocol: str, data: bytes, limit: int, timeout: float = IO_TIMEOUT_S
) -> bytes:
    """Send one frame to ``peer_id`` on ``protocol``; returns the reply frame (at most ``limit`` bytes).

    A peer that cannot be reached (gone, restarted at another address) raises ConnectionError, like any socket:
    the daemon's own error types never reach the caller's loop."""
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol), IO_TIMEOUT_S
        )
    except (P2PDaemonError, P2PHandlerError) as e:  # ControlFailure (dial failed) is a P2PDaemonError
        raise ConnectionError(f"cannot reach peer {peer_id}: {e}") from e
    try:
        await asyncio.wait_for(_write_frame(writer, data), IO_TIMEOUT_S)
        return await asyncio.wait_for(_read_frame(reader, limit), timeout)
    finally:
        writer.close()


async def submit(p2p: P2P, peer_id: str, run_id: str, data: bytes, trainer_id: str) -> SubmitReply:
    """Send one signed batch to ``peer_id``; the reply must be signed by ``trainer_id``'s key."""
    raw = await request(p2p, peer_id, submit_protocol(run_id), data, Channel.REPLY.value)
    signed = open_signed(raw, SubmitReply)
    if signed.signer_id != trainer_id:
        raise Rejected("foreign_reply", f"reply signed by {signed.signer_id}, not the trainer {trainer_id}")
    return signed.message
