"""Gossip: the run's pubsub topics over the go-libp2p daemon's gossipsub, spoken on its control socket.

hivemind starts the daemon without pubsub and has no client for it. ``enable_pubsub`` (called in the DHT process
before the daemon starts) adds ``-pubsub``; ``Gossip`` speaks the daemon's PSRequest PUBLISH and SUBSCRIBE over
its control socket (a SUBSCRIBE connection then carries varint-delimited PSMessages).

What the daemon does not do, and so this module does (measured on hivemind 1.1.12's p2pd, go-libp2p-pubsub
0.10.0): it forwards messages to its mesh before we see them, runs no topic validators and scores no peers, drops
messages over 1 MiB silently, and a subscription whose reader falls 32 messages behind loses messages. So every
message is a small signed envelope, refused here before it is published when it is over the topic's limit, read
off the socket at once into a bounded queue, rate-limited per sending peer, and only then opened (signature
first) by the topic's handler. Every message is a hint: bodies travel over streams, checked against a digest,
and whoever needs a message to arrive sends it again until it is acknowledged.

Who may publish what: anyone may publish on any topic (the daemon does not stop them); what a message is worth
is decided by its envelope's signer (the run key for versions and acknowledgements, a registered producer for
announcements, a trusted validator for verdicts). Cost to us per message: one varint read, a token-bucket check
and, if within the sender's rate, one Ed25519 verification.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import read_unsigned_varint, write_pbmsg
from hivemind.proto import p2pd_pb2 as pb

from intellect_node.aio import raise_if_cancelled, within
from intellect_node.p2p.metrics import Metrics
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected
from intellect_protocol.records import topic

logger = logging.getLogger(__name__)
LIMITS = {"versions": Channel.GOSSIP.value, "rollouts": Channel.GOSSIP.value, "verdicts": Channel.VERDICT.value}
"""Largest message per topic: far under the daemon's silent 1 MiB cut."""
RATE_PER_PEER = 20.0
"""Messages per second a sending peer may have handled, on average (a burst of ``BURST`` is allowed)."""
BURST = 60.0
GLOBAL_RATE = 400.0
"""Messages per second handled on one topic from all rate-limited peers together: a flood from many identities
costs at most this many signature checks a second (what is dropped is counted; senders repeat what matters)."""
QUEUE = 1024
"""Messages read off a subscription and waiting for their handler; past this the oldest are dropped (counted)."""
RESUBSCRIBE_S = 1.0
CONTROL_TIMEOUT_S = 10.0

Handler = Callable[[bytes, str], Awaitable[None]]
"""Called with a message's bytes and the libp2p peer id (base58) that published it."""


def enable_pubsub() -> None:
    """In the process that starts the daemon, before it does: start it with gossipsub on."""
    if getattr(P2P, "_intellect_pubsub", False):
        return
    make = P2P._make_process_args

    def with_pubsub(*args: Any, **kwargs: Any) -> list[str]:
        return [*make(*args, **kwargs), "-pubsub=1", "-pubsubRouter=gossipsub"]

    P2P._make_process_args = staticmethod(with_pubsub)  # type: ignore[method-assign]
    P2P._intellect_pubsub = True  # type: ignore[attr-defined]


class TokenBuckets:
    """Token buckets per peer, bounded in number (the oldest idle ones go first)."""

    def __init__(self, rate: float, burst: float, size: int = 4096) -> None:
        self.rate, self.burst, self.size = rate, burst, size
        self._state: dict[str, tuple[float, float]] = {}

    def take(self, peer: str) -> bool:
        now = time.monotonic()
        tokens, at = self._state.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._state[peer] = (tokens - 1.0 if ok else tokens, now)
        while len(self._state) > self.size:
            self._state.pop(next(iter(self._state)))
        return ok

    def __len__(self) -> int:
        """Peers with a bucket (``size`` at most)."""
        return len(self._state)


class Gossip:
    """The run's topics on one daemon (through a replica of the node's P2P, in the node's process)."""

    def __init__(self, p2p: P2P, run_id: str, metrics: Metrics) -> None:
        self._connector = p2p._client.control.daemon_connector
        self.run_id = run_id
        self.metrics = metrics
        self._buckets = TokenBuckets(RATE_PER_PEER, BURST)
        self._all = TokenBuckets(GLOBAL_RATE, 2 * GLOBAL_RATE)  # one bucket per topic
        self._tasks: set[asyncio.Task[None]] = set()
        self.subscribed: dict[str, asyncio.Event] = {}
        self.unlimited: set[str] = set()
        """Peers whose messages are not rate-limited (a volunteer's trainer, which acknowledges every batch)."""

    async def _ask(self, request: pb.PSRequest) -> tuple[pb.Response, asyncio.StreamReader, asyncio.StreamWriter]:
        """Send one pubsub request on a new control connection; the daemon's answer and the open connection (the
        caller closes it; after SUBSCRIBE it carries the topic's messages)."""
        reader, writer = await within(self._connector.open_connection(), CONTROL_TIMEOUT_S)
        try:
            await write_pbmsg(writer, pb.Request(type=pb.Request.PUBSUB, pubsub=request))
            response = pb.Response()
            length = await within(read_unsigned_varint(reader), CONTROL_TIMEOUT_S)
            response.ParseFromString(await within(reader.readexactly(length), CONTROL_TIMEOUT_S))
            if response.type == pb.Response.ERROR:
                raise ConnectionError(f"the p2p daemon refused a pubsub request: {response.error.msg}")
        except BaseException:
            writer.close()
            raise
        return response, reader, writer

    async def _control(self, request: pb.PSRequest) -> pb.Response:
        response, _, writer = await self._ask(request)
        writer.close()
        return response

    async def publish(self, name: str, data: bytes) -> None:
        """Publish one message on the run's topic ``name``; refused here (Rejected 'oversized') over its limit,
        since the daemon would drop it without a word."""
        limit = LIMITS[name]
        if len(data) > limit:
            self.metrics.inc(
                "node_gossip_publish_refused_total", label="oversized", help="messages refused before publishing"
            )
            raise Rejected("oversized", f"{len(data)} bytes > the {name} topic's limit of {limit}")
        await self._control(pb.PSRequest(type=pb.PSRequest.PUBLISH, topic=topic(self.run_id, name), data=data))
        self.metrics.inc("node_gossip_published_total", label=name, help="messages published, by topic")
        self.metrics.inc("node_gossip_published_bytes_total", len(data), label=name)

    async def peers(self, name: str) -> list[str]:
        """Peers this daemon knows to be subscribed to ``name`` (base58)."""
        response = await self._control(pb.PSRequest(type=pb.PSRequest.LIST_PEERS, topic=topic(self.run_id, name)))
        return [PeerID(p).to_base58() for p in response.pubsub.peerIDs]

    def subscribe(self, name: str, handler: Handler) -> None:
        """Hand every message on ``name`` (within its sender's rate) to ``handler``, for as long as the node runs;
        a broken subscription is opened again. ``subscribed[name]`` is set once the daemon has said yes."""
        self.subscribed[name] = asyncio.Event()
        queue: asyncio.Queue[tuple[bytes, str]] = asyncio.Queue(QUEUE)
        for coro in (self._read(name, queue), self._handle(name, queue, handler)):
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _read(self, name: str, queue: asyncio.Queue[tuple[bytes, str]]) -> None:
        limit = LIMITS[name] + 1024  # the PSMessage around the data
        while True:
            writer = None
            try:
                request = pb.PSRequest(type=pb.PSRequest.SUBSCRIBE, topic=topic(self.run_id, name))
                _, reader, writer = await self._ask(request)
                raise_if_cancelled()
                self.subscribed[name].set()
                while True:
                    length = await read_unsigned_varint(reader)
                    raw = await reader.readexactly(length)  # the daemon delivers at most 1 MiB
                    if length > limit:
                        self.metrics.inc(
                            "node_gossip_dropped_total",
                            label="oversized",
                            help="gossip messages dropped before their handler",
                        )
                        continue
                    message = pb.PSMessage()
                    message.ParseFromString(raw)
                    if queue.full():
                        queue.get_nowait()
                        self.metrics.inc("node_gossip_dropped_total", label="queue_full")
                    queue.put_nowait((message.data, PeerID(getattr(message, "from")).to_base58()))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the daemon restarted or went away, a message we cannot parse: subscribe again
                raise_if_cancelled()
                self.subscribed[name].clear()
                self.metrics.inc("node_gossip_resubscribes_total", label=name)
                logger.debug("subscription to %s broke: %r", name, e)
                await asyncio.sleep(RESUBSCRIBE_S)
            finally:
                if writer is not None:
                    writer.close()

    async def _handle(self, name: str, queue: asyncio.Queue[tuple[bytes, str]], handler: Handler) -> None:
        while True:
            data, peer = await queue.get()
            if peer not in self.unlimited and not (self._buckets.take(peer) and self._all.take(name)):
                self.metrics.inc("node_gossip_dropped_total", label="rate")
                continue
            self.metrics.inc("node_gossip_received_total", label=name, help="gossip messages handled, by topic")
            self.metrics.inc("node_gossip_received_bytes_total", len(data), label=name)
            try:
                await handler(data, peer)
            except Rejected as e:
                raise_if_cancelled()
                self.metrics.inc("node_gossip_rejected_total", label=e.reason, help="gossip messages refused")
                logger.debug("refused a %s message from peer=%s: %s", name, peer, e)
            except Exception:  # a handler's own bug must not end the subscription
                raise_if_cancelled()
                self.metrics.inc("node_gossip_rejected_total", label="error")
                logger.exception("handling a %s message from peer=%s failed", name, peer)

    async def close(self) -> None:
        """Cancel the subscriptions; waits a moment for them, never longer (a node stopping must not hang here)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
