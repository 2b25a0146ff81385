"""The node's HTTP server: ``/health``, ``/status`` (JSON), ``/metrics`` (Prometheus), plus the routes of
the services that share it (the shard server's ``/weights/``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from intellect_node.p2p.metrics import Metrics

logger = logging.getLogger(__name__)


class HttpServer:
    def __init__(
        self, metrics: Metrics, status: Callable[[], dict[str, Any]], routes: list[web.RouteDef] | None = None
    ) -> None:
        self._metrics = metrics
        self._status = status
        self._routes = routes or []
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        app = web.Application()
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

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _status_handler(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(text=self._metrics.render(), content_type="text/plain")
