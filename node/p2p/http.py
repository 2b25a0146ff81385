"""The node's HTTP server: ``/health``, ``/status`` (JSON), ``/metrics`` (Prometheus), plus the routes of
the services that share it (the shard server's ``/weights/``)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from intellect_node.p2p.gossip import TokenBuckets
from intellect_node.p2p.metrics import Metrics

logger = logging.getLogger(__name__)


class EncodedList(list[Any]):
    """An append-only list that keeps each item's JSON text as it is appended. ``/status`` is public and carries
    the trainer's whole step history, which grows with the run: encoded again at each request, it costs about 30%
    of the trainer's main thread for one client polling (measured: benchmarks/adversary.py). Encoded here once."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        super().__init__()
        self._texts: list[str] = []
        self._stale = False
        self.extend(items)

    def append(self, item: Any) -> None:
        super().append(item)
        self._texts.append(json.dumps(item))

    def extend(self, items: Iterable[Any]) -> None:
        for item in items:
            self.append(item)

    def texts(self, start: int, end: int) -> list[str]:
        """The JSON text of items ``start`` to ``end`` (a checkpoint writer's thread reads it: nothing changes)."""
        if self._stale or len(self._texts) < end:
            return [json.dumps(item) for item in self[start:end]]
        return self._texts[start:end]

    def json(self, start: int = 0) -> str:
        """The items from ``start`` on, as a JSON array."""
        if self._stale or len(self._texts) != len(self):  # changed some other way than append: encode again
            self._texts, self._stale = [json.dumps(item) for item in self], False
        return "[" + ",".join(self._texts[start:]) + "]"

    def _changed(name: str) -> Any:  # type: ignore[misc]  # noqa: N805 (a decorator factory used in the body)
        method = getattr(list, name)

        def changed(self: EncodedList, *args: Any) -> Any:
            self._stale = True
            return method(self, *args)

        return changed

    __setitem__ = _changed("__setitem__")
    __delitem__ = _changed("__delitem__")
    __iadd__ = _changed("__iadd__")
    insert = _changed("insert")
    pop = _changed("pop")
    remove = _changed("remove")
    clear = _changed("clear")
    sort = _changed("sort")
    reverse = _changed("reverse")
    del _changed


class EncodedTail:
    """The items of an ``EncodedList`` from ``start`` on, spliced into a status as they were encoded."""

    def __init__(self, items: EncodedList, start: int) -> None:
        self.items = items
        self.start = start

    def json(self) -> str:
        return self.items.json(self.start)


_DECIMAL = re.compile(r"-?[0-9]+")


def decimal(raw: str, digits: int, negative: bool = False) -> int | None:
    """``raw`` as an integer when it is plain ASCII decimal of at most ``digits`` digits (a leading ``-`` only when
    ``negative``), else None. A query or path value is a peer's: ``str.isdigit`` also accepts digits ``int`` refuses
    (``'²'``), and a check by it let ``/relay/next?after=²`` answer 500 and log a traceback, anonymously."""
    if not _DECIMAL.fullmatch(raw) or (raw.startswith("-") and not negative) or len(raw.lstrip("-")) > digits:
        return None
    return int(raw)


def history_since(status: dict[str, Any], since: str) -> dict[str, Any]:
    """``status`` with its ``history`` cut to the entries from index ``since`` on, for a client that holds the first
    ``since`` already (the dashboard: a long run's history is megabytes, and it asks every 2 s); ``history_from`` and
    ``history_len`` say which part it is. Raises ValueError for a ``since`` that is not a count."""
    count = decimal(since, 12)
    if count is None:
        raise ValueError("since must be a count of history entries")
    history = status.get("history")
    if not isinstance(history, EncodedList):  # a role without a history, or one kept otherwise: the whole status
        return status
    start = min(count, len(history))
    return {**status, "history": EncodedTail(history, start), "history_from": start, "history_len": len(history)}


def encode_status(status: dict[str, Any]) -> bytes:
    """``status`` as JSON; values that are ``EncodedList`` or ``EncodedTail`` are spliced in as already encoded."""
    encoded = {k: v for k, v in status.items() if isinstance(v, (EncodedList, EncodedTail))}
    text = json.dumps({k: v for k, v in status.items() if k not in encoded})
    if encoded:
        parts = [f"{json.dumps(k)}:{v.json()}" for k, v in encoded.items()]
        text = text[:-1] + ("," if len(text) > 2 else "") + ",".join(parts) + "}"
    return text.encode()


PUBLIC_RATE_PER_ADDRESS = 20.0
"""Requests a second one remote address may make to a node's public routes (the dashboard, /health, /status,
/metrics, and those a role adds: /ledger, /audit), in bursts of twice that; past it, 429 with Retry-After. Anyone may
call them, and without a bound a client asking in a loop had the trainer answer as fast as it could: the red team's
auditor keys polled the unsigned /audit listing 2,400 times a second (23 CPU-s of the trainer's in 60 s), and
/status carries the whole step history (~0.5 kB a step), megabytes for a request of a few bytes in a long run. A
dashboard asks every 2 s, Prometheus every 15 s."""
SELF_PACED = ("/weights/", "/relay/")
"""Routes bounded on their own: shards and news paced per child, slot requests signed and limited per address
(node/weights/pacing.py, node/weights/auth.py)."""
UNLIMITED = frozenset({"/health"})
"""Answered whatever the rate: a constant costs less than a refusal would, and a flood from a shared address (a NAT,
Docker's proxy) must not make a node look dead to its container's health check or to the trainer's dial-back."""


def source_of(remote: str | None) -> str:
    """What the public routes' rate counts a request against: the IPv4 address, the IPv6 /64 (one subscriber's
    usual share: a client rotating through its own /64 gets no fresh bursts)."""
    if not remote:
        return "?"
    try:
        ip = ipaddress.ip_address(remote)
    except ValueError:
        return remote
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # an IPv4 client of a dual-stack socket
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


TARPIT_S = 1.0
"""How long the answer to a request refused for its rate is held before it goes out."""
TARPIT_PER_SOURCE = 8
"""Answers held at once per address (as ``source_of`` counts them) ..."""
TARPIT_MAX = 256
"""... and in all; past either, the refusal goes out at once and the connection is closed after it."""


class Tarpit:
    """Holds the answers to requests refused for their rate (``TARPIT_S``), so that a flood costs its sender time
    rather than getting refusals as fast as it asks: a refusal costs a node about what the request cost its sender,
    and a client answered at once asks again at once (the red team's strangers had 69,487 slot requests refused in
    60 s, at 0.51 of the attacker's CPU and an honest training rate 0.78 of the usual; auditor keys 361,977 /audit
    listings, at 0.99). An HTTP/1.1 connection carries one request at a time, so a held answer stalls its
    connection: a sender gets about one request a second per connection it opens. Held answers are bounded
    (``TARPIT_PER_SOURCE`` per address, ``TARPIT_MAX`` in all: an idle coroutine and a socket each); past the
    bound the refusal goes out at once and closes its connection, so every further request costs its sender a new
    TCP connection. Honest clients are refused only past a rate they never need, and wait as Retry-After says.
    Each rate has its own (the public routes', and each ``RequestAuth``: a trainer's relay slots and audit
    downloads), so the bounds hold per tarpit. aiohttp does not cancel a handler whose client left: a held
    answer is held its whole time, and a sender that hangs up frees no room sooner."""

    def __init__(self, hold_s: float = TARPIT_S, per_source: int = TARPIT_PER_SOURCE, total: int = TARPIT_MAX) -> None:
        self.hold_s = hold_s
        self.per_source = per_source
        self.total = total
        self._held: Counter[str] = Counter()
        self._holding = 0

    @property
    def holding(self) -> int:
        """Answers held now."""
        return self._holding

    async def hold(self, request: web.Request) -> bool:
        """Wait ``hold_s`` before a refusal goes out; False at once when there is no room (the caller closes the
        connection after its answer: ``refuse``)."""
        source = source_of(request.remote)
        if self._held[source] >= self.per_source or self._holding >= self.total:
            return False
        self._held[source] += 1
        self._holding += 1
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self._holding -= 1
            self._held[source] -= 1
            if self._held[source] <= 0:
                del self._held[source]
        return True

    async def refuse(self, request: web.Request, response: web.Response) -> web.Response:
        """``response`` (a refusal for the rate), held first, or closing its connection when none can be held."""
        if not await self.hold(request):
            response.force_close()
        return response


DASHBOARD = (Path(__file__).parent / "dashboard.html").read_bytes()
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:"
)
"""The page may talk to its own node only: peer-controlled strings it shows are escaped, and even a slip there
could not load or send anything elsewhere."""


class HttpServer:
    def __init__(
        self,
        metrics: Metrics,
        status: Callable[[], dict[str, Any]],
        routes: list[web.RouteDef] | None = None,
        rate: float = PUBLIC_RATE_PER_ADDRESS,
        burst: float | None = None,
    ) -> None:
        self._metrics = metrics
        self._status = status
        self._routes = routes or []
        self._runner: web.AppRunner | None = None
        self.rate = rate
        self._buckets = TokenBuckets(rate, 2 * rate if burst is None else burst)
        self.tarpit = Tarpit()
        self.started = time.time()
        self.port = 0

    @web.middleware
    async def _limit(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The public routes' rate per remote address (``PUBLIC_RATE_PER_ADDRESS``), checked before any work; a
        refusal is held (``Tarpit``)."""
        path = request.rel_url.path
        if not (path.startswith(SELF_PACED) or path in UNLIMITED) and not self._buckets.take(source_of(request.remote)):
            self._metrics.inc("node_http_refused_total", label="rate", help="HTTP requests refused, by reason")
            refusal = web.json_response(
                {"error": "rate", "detail": f"at most {self.rate:g} requests a second per address"},
                status=429,
                headers={"Retry-After": "1"},
            )
            return await self.tarpit.refuse(request, refusal)
        response: web.StreamResponse = await handler(request)
        return response

    async def start(self, host: str, port: int) -> int:
        app = web.Application(middlewares=[self._limit])
        app.router.add_get("/", self._dashboard)
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status_handler)
        app.router.add_get("/metrics", self._metrics_handler)
        app.add_routes(self._routes)
        # on close, requests still running (long polls, shard streams: receivers resume) get 2 s, not 60
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as e:
            msg = f"cannot listen for HTTP on {host}:{port} ({e.strerror}); pick another --http-port"
            raise SystemExit(msg) from None
        server: Any = site._server  # aiohttp keeps the bound asyncio.Server here; port 0 needs the real port
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _dashboard(self, request: web.Request) -> web.Response:
        """The dashboard: one self-contained page (no CDN, no build step) that reads /status every 2 s."""
        return web.Response(
            body=DASHBOARD,
            content_type="text/html",
            charset="utf-8",
            headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"},
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _status_handler(self, request: web.Request) -> web.Response:
        """The role's status; ``?since=N``: the history from entry N on (``history_since``). ``started``: when this
        server started, so a client that keeps the history it read knows when to read it whole again."""
        status = {**self._status(), "started": self.started}
        since = request.query.get("since")
        if since is not None:
            try:
                status = history_since(status, since)
            except ValueError as e:
                return web.json_response({"error": "since", "detail": str(e)}, status=400)
        return web.Response(body=encode_status(status), content_type="application/json")

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(text=self._metrics.render(), content_type="text/plain")
