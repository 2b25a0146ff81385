"""Rollout batch bodies by digest: ``intellect-node/<run_id>/batch/v1``.

Gossip carries only a batch's announcement (its SHA-256 and size); whoever needs the body (a validator named to
judge it, the trainer when the producer's push did not arrive) asks a peer that holds it: the producer, or the
trainer once it admitted it. The request is a signed ``BatchRequest``; the reply is the producer's signed
envelope itself, or an empty frame when the peer does not hold it. The asker checks the digest, so a peer that
serves other bytes only wastes one read.

Who may ask: any peer, ``PER_PEER`` requests at once and ``RATE`` a second each (token bucket), ``MAX_SERVING``
in all; each answer costs us a dictionary lookup and one frame of at most a batch's size.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from intellect_node.aio import within
from intellect_node.p2p.gossip import TokenBuckets
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.transport import (
    HEADER_TIMEOUT_S,
    IO_TIMEOUT_S,
    LINGER_S,
    _read_frame,
    _write_frame,
    request,
)
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import BatchRequest

logger = logging.getLogger(__name__)
PER_PEER = 2
RATE = 10.0
MAX_SERVING = 16
FETCH_TIMEOUT_S = 30.0

Lookup = Callable[[str], bytes | None]
"""A batch's signed envelope by its SHA-256 (hex), if held."""


def batch_protocol(run_id: str) -> str:
    return f"intellect-node/{run_id}/batch/v1"


class BatchServer:
    def __init__(self, p2p: P2P, run_id: str, lookup: Lookup, metrics: Metrics) -> None:
        self._p2p = p2p
        self.run_id = run_id
        self._lookup = lookup
        self.metrics = metrics
        self._serving: dict[str, int] = {}
        self._buckets = TokenBuckets(RATE, RATE)

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(batch_protocol(self.run_id), self._on_stream)

    async def close(self) -> None:
        try:
            await self._p2p.remove_binary_stream_handler(batch_protocol(self.run_id))
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("could not remove the batch handler: %r", e)

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            if (
                self._serving.get(peer, 0) >= PER_PEER
                or sum(self._serving.values()) >= MAX_SERVING
                or not self._buckets.take(peer)
            ):
                self.metrics.inc("node_batches_served_total", label="busy", help="batch body requests, by outcome")
                return  # closed unanswered: the asker tries another holder, or later
            self._serving[peer] = self._serving.get(peer, 0) + 1
            try:
                raw = await within(_read_frame(reader, Channel.REPLY.value), HEADER_TIMEOUT_S)
                ask = open_signed(raw, BatchRequest).message
                if ask.run_id != self.run_id:
                    raise Rejected("wrong_run", ask.run_id)
                body = self._lookup(ask.batch_sha256) or b""
                self.metrics.inc("node_batches_served_total", label="found" if body else "missing")
                self.metrics.inc("node_batches_served_bytes_total", len(body), help="batch bodies served by digest")
                await within(_write_frame(writer, body), IO_TIMEOUT_S)
                await within(reader.read(1), LINGER_S)  # until the asker has read it (transport.py)
            finally:
                self._serving[peer] -= 1
                if not self._serving[peer]:
                    del self._serving[peer]
        except Rejected as e:
            self.metrics.inc("node_batches_served_total", label=e.reason)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            logger.debug("batch request from peer=%s broke: %r", peer, e)
        finally:
            writer.close()


async def fetch_batch(
    p2p: P2P, identity: Identity, run_id: str, peer_id: str, digest: str, limit: int = Channel.ROLLOUT_BATCH.value
) -> bytes | None:
    """The batch of SHA-256 ``digest`` from ``peer_id``: its exact envelope (at most ``limit`` bytes are read), or
    None when the peer does not hold it. Raises ConnectionError (unreachable, busy), or Rejected: 'bad_digest'
    when the bytes are not that batch, 'oversized' past ``limit``."""
    ask = seal(identity, BatchRequest(run_id=run_id, batch_sha256=digest))
    try:
        body = await request(p2p, peer_id, batch_protocol(run_id), ask, limit, FETCH_TIMEOUT_S)
    except asyncio.IncompleteReadError as e:
        raise ConnectionError(f"peer {peer_id} did not answer (busy or gone)") from e
    if not body:
        return None
    if hashlib.sha256(body).hexdigest() != digest:
        raise Rejected("bad_digest", f"peer {peer_id} served other bytes for batch {digest[:12]}")
    return body
