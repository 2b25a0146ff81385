"""Reachability at join: a reachable peer (the trainer) dials the joining node back, as an outsider would.

``intellect-node/<run_id>/dialback/v1``: the node sends a signed ``DialBack`` naming its p2p addresses and HTTP
port; the trainer answers a signed ``Reachability`` after trying, from fresh connections of its own (not the
libp2p connection the request came over, which proves nothing about inbound reachability):

- p2p: a TCP connection to each claimed address whose IP is the one the request came from (or, when none is,
  that IP with the claimed port: a node behind NAT claims its private address), answered by a libp2p listener
  (the multistream-select header; nothing else of the node is trusted by this);
- HTTP: ``GET /health`` at that IP and the claimed port, answered ``{"ok": true}``.

The rules of the endpoint (``DialBackServer``):

- who: any peer, before it is admitted (a joining node asks first). A libp2p peer id costs nothing, so every
  limit counts the IP the stream came from (the daemon's remote address of the connection; IPv6 by its /64);
- how often: ``PER_IP_BURST`` requests per IP, then ``PER_IP_PER_MIN`` a minute; ``PER_IP_AT_ONCE`` in flight
  per IP and ``MAX_AT_ONCE`` in all. A request past a limit is answered at once, before its frame is read, with
  a signed ``Reachability`` whose ``refused`` says which (``rate``, ``busy``): nothing waits in a queue;
- with how much: one ``DialBack`` frame (its size capped by the channel); of its addresses, ``MAX_TARGETS``
  distinct ones at most are tried, only ever at the IP the request came from (never a third party, never
  through a relay);
- what it costs the trainer: per request, ``MAX_TARGETS`` TCP connections and one HTTP GET made at once under
  one ``PROBE_DEADLINE_S`` deadline (silent ports cost that deadline once, not once each), and the stream held
  ``REQUEST_DEADLINE_S`` at most from accept to close; in all, at most ``MAX_AT_ONCE`` such requests, and
  ``MAX_REFUSING`` refused streams held ``LINGER_S`` at most for the asker to read the refusal (past that, a
  refused stream is closed unanswered). Its bookkeeping: a token bucket per IP (4096 at most, the oldest idle
  dropped) and a count per IP with requests in flight (``MAX_AT_ONCE`` at most).

The asker (``ask_dialback``) waits ``ASK_TIMEOUT_S`` at most in all; a refusal raises ``Rejected`` with the
reason. A node announces only what a dial-back reached (node/roles/volunteer.py): its p2p addresses once the p2p
port answered, its HTTP URL and relay slots once both did (nobody can fetch weights from a node it could not
reach, so nobody must choose it as a parent). Refused or unanswered, it announces none of them and asks again
every ``RECHECK_S``. Either way it still produces rollouts: all its traffic is outbound (pushes to the trainer,
gossip over the connections it opened, weight fetches from its parent).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re

import aiohttp
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from intellect_node.aio import within
from intellect_node.p2p.gossip import TokenBuckets
from intellect_node.p2p.http import source_of
from intellect_node.p2p.metrics import Metrics
from intellect_node.p2p.transport import HEADER, LINGER_S, _read_frame, _write_frame, request
from intellect_protocol.codec import Channel
from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import DialBack, Reachability

logger = logging.getLogger(__name__)
MAX_TARGETS = 4
"""Distinct addresses tried per request, at most (a node lists a few: public, LAN, loopback)."""
READ_DEADLINE_S = 5.0
"""For the request's frame (a few hundred bytes, sent with the stream)."""
PROBE_DEADLINE_S = 5.0
"""One deadline for all of a request's connection attempts, made at once (a handshake and a header each)."""
REQUEST_DEADLINE_S = READ_DEADLINE_S + PROBE_DEADLINE_S + LINGER_S
"""A request's whole stream, from accept to close: reading the request, probing, answering, the asker's close."""
PER_IP_BURST = 8.0
PER_IP_PER_MIN = 8.0
"""Requests per IP: a burst (nodes behind one NAT joining together, each asks once), then this many a minute."""
PER_IP_AT_ONCE = 2
MAX_AT_ONCE = 16
"""Requests in flight (accept to close), per IP and in all; past either, a request is refused at once."""
MAX_REFUSING = 64
"""Refusals waiting for the asker to read them and close; past it, a refused stream is closed unanswered."""
ASK_TIMEOUT_S = REQUEST_DEADLINE_S + 5.0
"""The asker's one deadline for the whole exchange (the trainer answers within its own)."""
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


async def libp2p_listening(ip: str, port: int, timeout: float) -> bool:
    """Whether a libp2p listener answers at ip:port (its multistream-select header) on a fresh connection, within
    ``timeout`` in all."""

    async def exchange() -> bool:
        reader, writer = await asyncio.open_connection(ip, port)
        try:
            writer.write(MULTISTREAM)
            await writer.drain()
            return (await reader.readexactly(len(MULTISTREAM))) == MULTISTREAM
        finally:
            writer.close()

    try:
        return await within(exchange(), timeout)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False


async def http_healthy(ip: str, port: int, timeout: float) -> bool:
    """Whether ``GET /health`` at ip:port answers ``{"ok": true}``, within ``timeout`` in all."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(f"http://{ip}:{port}/health", allow_redirects=False) as resp:
                return resp.status == 200 and (await resp.json(content_type=None)) == {"ok": True}
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError):
        return False


def _targets(ask: DialBack, observed_ip: str) -> list[tuple[str, int]]:
    """The addresses to try: the claimed ones at the observed IP, else the observed IP at the claimed ports;
    ``MAX_TARGETS`` distinct ones at most."""
    claimed = [(m.group(1), int(m.group(2))) for m in (_IP4.match(a) for a in ask.p2p_maddrs) if m]
    same = [(ip, port) for ip, port in claimed if ip == observed_ip]
    ports = dict.fromkeys(port for _, port in claimed)
    return list(dict.fromkeys(same or [(observed_ip, port) for port in ports]))[:MAX_TARGETS]


def _source(addr: str) -> str:
    """What the limits count a stream against, from the remote multiaddr of its connection: its IP address as the
    public HTTP routes count one (http.source_of: the IPv4 address, the IPv6 /64), else one shared ``other``."""
    parts = addr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            ipaddress.ip_address(parts[2])
        except ValueError:
            return "other"
        return source_of(parts[2])
    return "other"


async def _linger(reader: asyncio.StreamReader) -> None:
    """Until the asker, having read the answer, closes its side (closing at once lost the answer now and then);
    LINGER_S at most. What it still sends (a refused request, unread) is discarded, one frame's worth at most."""
    left = HEADER + Channel.REPLY.value
    async with asyncio.timeout(LINGER_S):
        while left > 0 and (chunk := await reader.read(min(left, 1 << 16))):
            left -= len(chunk)


class DialBackServer:
    """Answers dial-back requests (the trainer runs one), within the limits in the module's docstring."""

    def __init__(self, p2p: P2P, identity: Identity, run_id: str, metrics: Metrics) -> None:
        self._p2p = p2p
        self.identity = identity
        self.run_id = run_id
        self.metrics = metrics
        self._buckets = TokenBuckets(PER_IP_PER_MIN / 60.0, PER_IP_BURST)
        self._in_flight: dict[str, int] = {}
        """Requests being handled, by source; a source leaves with its last one."""
        self._refusing = 0
        """Refusals written and waiting for the asker's close."""

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(dialback_protocol(self.run_id), self._on_stream)

    async def close(self) -> None:
        try:
            await self._p2p.remove_binary_stream_handler(dialback_protocol(self.run_id))
        except Exception as e:  # the daemon may already be gone at shutdown
            logger.debug("could not remove the dial-back handler: %r", e)

    def sources(self) -> tuple[int, int]:
        """How many sources the server keeps a rate for, and how many have requests in flight."""
        return len(self._buckets), len(self._in_flight)

    def _admit(self, source: str) -> str:
        """Empty when a request from ``source`` goes ahead (it is then in flight until ``_leave``), else why not."""
        if sum(self._in_flight.values()) >= MAX_AT_ONCE or self._in_flight.get(source, 0) >= PER_IP_AT_ONCE:
            return "busy"
        if not self._buckets.take(source):
            return "rate"
        self._in_flight[source] = self._in_flight.get(source, 0) + 1
        return ""

    def _leave(self, source: str) -> None:
        self._in_flight[source] -= 1
        if not self._in_flight[source]:
            del self._in_flight[source]

    async def check(self, ask: DialBack, observed_ip: str) -> Reachability:
        """Try the asker's addresses and its HTTP port all at once, under one PROBE_DEADLINE_S deadline."""
        async with asyncio.TaskGroup() as probes:
            p2p = [
                probes.create_task(libp2p_listening(ip, port, PROBE_DEADLINE_S))
                for ip, port in _targets(ask, observed_ip)
            ]
            http = (
                probes.create_task(http_healthy(observed_ip, ask.http_port, PROBE_DEADLINE_S))
                if ask.http_port
                else None
            )
        p2p_ok = any(t.result() for t in p2p)
        http_ok = http is not None and http.result()
        self.metrics.inc(
            "node_dialbacks_total",
            label=f"p2p={int(p2p_ok)},http={int(http_ok)}",
            help="dial-back requests, by outcome (checks) or by why they were refused",
        )
        return Reachability(node_id=ask.node_id, observed_ip=observed_ip, p2p_ok=p2p_ok, http_ok=http_ok)

    async def _answer(self, reader: asyncio.StreamReader, addr: str) -> Reachability:
        raw = await within(_read_frame(reader, Channel.REPLY.value), READ_DEADLINE_S)
        ask = open_signed(raw, DialBack).message
        if ask.run_id != self.run_id:
            raise Rejected("wrong_run", ask.run_id)
        m = _IP4.match(addr)
        if m is None or "/p2p-circuit" in addr:
            return Reachability(node_id=ask.node_id, detail=f"came over {addr[:200]}, not a direct IPv4/TCP connection")
        return await self.check(ask, m.group(1))

    async def _on_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer, addr = info.peer_id.to_base58(), str(info.addr)
        source = _source(addr)
        refused = self._admit(source)
        if refused and self._refusing >= MAX_REFUSING:
            writer.close()  # refusals are flooding in: this one goes unanswered rather than held
            self.metrics.inc("node_dialbacks_total", label=refused)
            return
        self._refusing += bool(refused)
        try:
            async with asyncio.timeout(REQUEST_DEADLINE_S):
                if refused:
                    self.metrics.inc("node_dialbacks_total", label=refused)
                    logger.debug("dial-back refused reason=%s peer=%s source=%s", refused, peer, source)
                    why = "too many checks at once" if refused == "busy" else "too many checks from this IP lately"
                    result = Reachability(node_id="", refused=refused, detail=f"{why}; ask again in a minute")
                else:
                    result = await self._answer(reader, addr)
                await _write_frame(writer, seal(self.identity, result))
                await _linger(reader)
        except Rejected as e:
            self.metrics.inc("node_dialbacks_total", label=e.reason)
            logger.debug("dial-back request from peer=%s refused: %s", peer, e)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            logger.debug("dial-back request from peer=%s broke: %r", peer, e)
        finally:
            writer.close()
            if refused:
                self._refusing -= 1
            else:
                self._leave(source)


async def ask_dialback(
    p2p: P2P, identity: Identity, run_id: str, peer_id: str, maddrs: list[str], http_port: int
) -> Reachability:
    """Ask ``peer_id`` (the trainer, whose key is the run key) to dial us back: its signed answer, within
    ASK_TIMEOUT_S in all. Raises Rejected with the trainer's reason when it refused to check (``busy``, ``rate``),
    and what ``request`` raises (ConnectionError, TimeoutError, ...) when it did not answer."""
    ask = DialBack(run_id=run_id, node_id=identity.node_id, p2p_maddrs=maddrs[:8], http_port=http_port)
    sent = request(p2p, peer_id, dialback_protocol(run_id), seal(identity, ask), Channel.REPLY.value, ASK_TIMEOUT_S)
    signed = open_signed(await within(sent, ASK_TIMEOUT_S), Reachability)
    r = signed.message
    if signed.signer_id != run_id:
        raise Rejected("foreign_reply", f"a reachability answer signed by {signed.signer_id}")
    if r.refused:
        raise Rejected(r.refused, r.detail)
    if r.node_id != identity.node_id:
        raise Rejected("foreign_reply", f"a reachability answer for {r.node_id}")
    return r
