"""Reachability at join: a reachable peer (the trainer) dials the joining node back, as an outsider would.

``intellect-node/<run_id>/dialback/v1``: the node sends a signed ``DialBack`` naming its p2p addresses and HTTP
port; the trainer answers a signed ``Reachability`` after trying, from fresh connections of its own (not the
libp2p connection the request came over, which proves nothing about inbound reachability):

- p2p: a TCP connection to each claimed address whose IP is the one the request came from (or, when none is,
  that IP with the claimed port: a node behind NAT claims its private address), answered by a libp2p listener
  (the multistream-select header; nothing else of the node is trusted by this);
- HTTP: ``GET /health`` at that IP and the claimed port, answered ``{"ok": true}``.

A node found unreachable announces no HTTP URL and no relay slots (nobody can fetch weights from it, so nobody
must choose it as a parent) and still produces rollouts: all its traffic is outbound (pushes to the trainer,
gossip over the connections it opened, weight fetches from its parent). What it costs the trainer: at most
``MAX_TARGETS`` connection attempts of ``PROBE_TIMEOUT_S`` per request, ``PER_PEER_PER_MIN`` requests a minute per
peer, ``MAX_PROBING`` at once; it only ever connects to the address the request came from (never a third party).
"""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from intellect_node.aio import within
from intellect_node.p2p.gossip import TokenBuckets
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.transport import HEADER_TIMEOUT_S, IO_TIMEOUT_S, LINGER_S, _read_frame, _write_frame, request
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import DialBack, Reachability

logger = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 3.0
MAX_TARGETS = 4
PER_PEER_PER_MIN = 4.0
PER_PEER_BURST = 3.0
MAX_PROBING = 4
MULTISTREAM = b"\x13/multistream/1.0.0\n"
_IP4 = re.compile(r"^/ip4/([0-9.]+)/tcp/([0-9]+)")


def announced(host: str, announce: str | None, maddrs: list[str], http_port: int) -> tuple[list[str], str]:
    """The libp2p addresses and HTTP URL a node announces: at ``announce`` when given (first, before what the
    daemon lists); for a wildcard ``host`` (0.0.0.0), at the first non-loopback IPv4 address the daemon listens on."""
    wildcard = host in ("0.0.0.0", "::", "")
    usable = [m for m in maddrs if "/ip4/0.0.0.0/" not in m and "/ip6/::/" not in m]
    target = announce or host
    if not announce and wildcard:
        found = [m.group(1) for m in (_IP4.match(a) for a in usable) if m and not m.group(1).startswith("127.")]
        target = found[0] if found else "127.0.0.1"
    if announce and maddrs and "/tcp/" in maddrs[0] and "/p2p/" in maddrs[0]:
        port, peer = maddrs[0].split("/tcp/", 1)[1].split("/", 1)[0], maddrs[0].rsplit("/p2p/", 1)[1]
        usable = [f"/ip4/{announce}/tcp/{port}/p2p/{peer}", *usable]
    return list(dict.fromkeys(usable)), f"http://{target}:{http_port}"


def dialback_protocol(run_id: str) -> str:
    return f"intellect-node/{run_id}/dialback/v1"


async def libp2p_listening(ip: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a libp2p listener answers at ip:port (its multistream-select header), on a fresh connection."""
    try:
        reader, writer = await within(asyncio.open_connection(ip, port), timeout)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(MULTISTREAM)
        await writer.drain()
        return (await within(reader.readexactly(len(MULTISTREAM)), timeout)) == MULTISTREAM
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


async def http_healthy(ip: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(f"http://{ip}:{port}/health", allow_redirects=False) as resp:
                return resp.status == 200 and (await resp.json(content_type=None)) == {"ok": True}
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError):
        return False


def _targets(ask: DialBack, observed_ip: str) -> list[tuple[str, int]]:
    """The addresses to try: the claimed ones at the observed IP, else the observed IP at the claimed ports."""
    claimed = [(m.group(1), int(m.group(2))) for m in (_IP4.match(a) for a in ask.p2p_maddrs) if m]
    same = [(ip, port) for ip, port in claimed if ip == observed_ip]
    ports = dict.fromkeys(port for _, port in claimed)
    return (same or [(observed_ip, port) for port in ports])[:MAX_TARGETS]


class DialBackServer:
    """Answers dial-back requests (the trainer runs one)."""

    def __init__(self, p2p: P2P, identity: Identity, run_id: str, metrics: Metrics) -> None:
        self._p2p = p2p
        self.identity = identity
        self.run_id = run_id
        self.metrics = metrics
        self._buckets = TokenBuckets(PER_PEER_PER_MIN / 60.0, PER_PEER_BURST)
        self._probing = asyncio.Semaphore(MAX_PROBING)

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(dialback_protocol(self.run_id), self._on_stream)

    async def close(self) -> None:
        try:
            await self._p2p.remove_binary_stream_handler(dialback_protocol(self.run_id))
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("could not remove the dial-back handler: %r", e)

    async def check(self, ask: DialBack, observed_ip: str) -> Reachability:
        async with self._probing:
            p2p_ok = False
            for ip, port in _targets(ask, observed_ip):
                if await libp2p_listening(ip, port):
                    p2p_ok = True
                    break
            http_ok = bool(ask.http_port) and await http_healthy(observed_ip, ask.http_port)
        self.metrics.inc("node_dialbacks_total", label=f"p2p={int(p2p_ok)},http={int(http_ok)}",
                         help="dial-back checks made for joining nodes, by outcome")  # fmt: skip
        return Reachability(node_id=ask.node_id, observed_ip=observed_ip, p2p_ok=p2p_ok, http_ok=http_ok)

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            if not self._buckets.take(peer):
                self.metrics.inc("node_dialbacks_total", label="rate")
                return
            m = _IP4.match(str(info.addr))
            raw = await within(_read_frame(reader, Channel.REPLY.value), HEADER_TIMEOUT_S)
            ask = open_signed(raw, DialBack).message
            if ask.run_id != self.run_id:
                raise Rejected("wrong_run", ask.run_id)
            result = (
                await self.check(ask, m.group(1))
                if m
                else Reachability(node_id=ask.node_id, detail=f"came over {str(info.addr)[:200]}, not IPv4/TCP")
            )
            await within(_write_frame(writer, seal(self.identity, result)), IO_TIMEOUT_S)
            await within(reader.read(1), LINGER_S)
        except Rejected as e:
            self.metrics.inc("node_dialbacks_total", label=e.reason)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            logger.debug("dial-back request from peer=%s broke: %r", peer, e)
        finally:
            writer.close()


async def ask_dialback(p2p: P2P, identity: Identity, run_id: str, peer_id: str, maddrs: list[str],
                       http_port: int) -> Reachability:  # fmt: skip
    """Ask ``peer_id`` (the trainer, whose key is the run key) to dial us back; its signed answer."""
    ask = DialBack(run_id=run_id, node_id=identity.node_id, p2p_maddrs=maddrs[:8], http_port=http_port)
    raw = await request(p2p, peer_id, dialback_protocol(run_id), seal(identity, ask), Channel.REPLY.value, 30.0)
    signed = open_signed(raw, Reachability)
    if signed.signer_id != run_id or signed.message.node_id != identity.node_id:
        raise Rejected("foreign_reply", f"a reachability answer signed by {signed.signer_id}")
    return signed.message
