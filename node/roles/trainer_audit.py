"""What an auditor downloads from the trainer to replay a step (node/roles/audit.py, node/roles/auditor_node.py).

- ``GET /audit``: ``{"run_id", "epoch", "checkpoints": [steps held]}``. Anyone may ask; it costs a directory
  listing.
- ``GET /audit/checkpoint/<step>``: the checkpoint file ``step-<step>.pt`` as the trainer wrote it. Its SHA-256 is
  the ``state`` of the ledger entry of version ``step``, so the auditor checks what it got against the run key's
  signed chain before it reads a byte of it.
- ``GET /audit/spool/<step>``: ``spool-<step>.bin``, the batches accepted after that checkpoint was taken
  (length-prefixed envelopes, each signed by its producer; the auditor keeps only those whose SHA-256 the entry
  names).

Who may download: a request signed by a node key of the run (the headers of weights/auth.py; method and path are
signed, a nonce is never accepted twice), whose node is admitted, has a record in the run, and that record's role is
``auditor`` (the trainer's ``_may_audit``). How often, with how much: ``SERVING`` downloads at once in all (one
more: 503 with Retry-After), one at a time per key, ``PER_KEY_PER_HOUR`` per key per hour, each done within
``transfer_s`` of its size and each 1 MiB chunk taken within ``CHUNK_S`` (a reader slower than that is cut off).
What it costs us: a file streamed from disk a chunk at a time (1 MiB buffered per download), at most ``SERVING``
uploads of a checkpoint at a time. An attacker needs an admitted auditor key and downloads every byte it makes us
send. What it does not stop: auditor keys taking the slots in turn keep an honest auditor waiting; training never
waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from intellect_node.aio import within
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.auth import Refused, RequestAuth

logger = logging.getLogger(__name__)
SERVING = 2
"""Downloads served at once, all keys together."""
PER_KEY_PER_HOUR = 24
"""Downloads one key may start in an hour (an auditor needs three a step it replays: the spool and two checkpoints;
six audits an hour at the default 600 s, with room for retries)."""
MIN_RATE_BPS = 1_000_000
"""The slowest reader served: a download must finish within its size at this rate, plus ``GRACE_S``."""
GRACE_S = 60.0
CHUNK = 1 << 20
CHUNK_S = 30.0
"""A reader that takes no chunk (1 MiB) in this long is cut off, whatever its deadline: a stalled reader holds a
slot for at most this."""
KEYS = 10_000
"""Keys whose recent downloads are remembered (the oldest forgotten first)."""


def transfer_s(size: int) -> float:
    """How long a download of ``size`` bytes may take."""
    return GRACE_S + size / MIN_RATE_BPS


class AuditRoutes:
    def __init__(
        self,
        run_id: str,
        epoch: Callable[[], int],
        root: Path,
        members: Callable[[str], Awaitable[bool]],
        metrics: Metrics,
    ) -> None:
        self.run_id = run_id
        self.epoch = epoch
        self.root = root
        """The trainer's checkpoint directory (trainer_checkpoint.CheckpointDir.root)."""
        self.auth = RequestAuth(run_id, members)
        self.metrics = metrics
        self._serving: set[str] = set()
        self._recent: OrderedDict[str, deque[float]] = OrderedDict()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/audit", self._index),
            web.get(r"/audit/checkpoint/{step:\d{1,8}}", self._checkpoint),
            web.get(r"/audit/spool/{step:\d{1,8}}", self._spool),
        ]

    async def _index(self, _request: web.Request) -> web.Response:
        steps = sorted(int(p.name[5:13]) for p in self.root.glob("step-????????.pt"))
        return web.json_response({"run_id": self.run_id, "epoch": self.epoch(), "checkpoints": steps})

    async def _checkpoint(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self.root / f"step-{int(request.match_info['step']):08d}.pt", "checkpoint")

    async def _spool(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self.root / f"spool-{int(request.match_info['step']):08d}.bin", "spool")

    def _count(self, outcome: str) -> None:
        self.metrics.inc("node_audit_downloads_total", label=outcome, help="auditors' downloads, by outcome")

    def _admit(self, node_id: str) -> None:
        """Take a serving slot for ``node_id`` or raise the answer that says why not."""
        if node_id in self._serving:
            raise web.HTTPTooManyRequests(text="one download at a time per node: wait for the one you have running")
        if len(self._serving) >= SERVING:
            raise web.HTTPServiceUnavailable(
                text=f"{SERVING} audit downloads are running: try again in a minute", headers={"Retry-After": "60"}
            )
        now = time.monotonic()
        recent = self._recent.pop(node_id, deque())
        while recent and now - recent[0] > 3600:
            recent.popleft()
        self._recent[node_id] = recent
        while len(self._recent) > KEYS:
            self._recent.popitem(last=False)
        if len(recent) >= PER_KEY_PER_HOUR:
            raise web.HTTPTooManyRequests(
                text=f"{PER_KEY_PER_HOUR} audit downloads an hour per node: try again later",
                headers={"Retry-After": str(int(3600 - (now - recent[0])) + 1)},
            )
        recent.append(now)
        self._serving.add(node_id)

    async def _stream(
        self, request: web.Request, path: Path, size: int, last: Callable[[], None]
    ) -> tuple[web.StreamResponse, bool]:
        """Send ``size`` bytes of ``path`` a chunk at a time; False (the connection closed) for a reader that took
        longer than ``transfer_s`` in all or ``CHUNK_S`` for a chunk. ``last()`` is called before the last chunk is
        handed over: a reader that has every byte may ask again before this coroutine resumes."""
        deadline = time.monotonic() + transfer_s(size)
        with open(path, "rb") as f:  # opened before the answer starts: a file rotated away meanwhile is a 404
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.content_length = size
            await response.prepare(request)
            sent = 0
            try:
                while sent < size:
                    chunk = await asyncio.to_thread(f.read, min(CHUNK, size - sent))
                    if not chunk:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    if sent + len(chunk) >= size:
                        last()
                    await within(response.write(chunk), min(CHUNK_S, left))
                    sent += len(chunk)
            except TimeoutError:
                if request.transport is not None:
                    request.transport.close()
                return response, False
            await response.write_eof()
        return response, True

    async def _serve(self, request: web.Request, path: Path, what: str) -> web.StreamResponse:
        try:
            node_id = await self.auth.check(request)
        except Refused as e:
            self._count(e.reason)
            raise e.http() from None
        try:
            self._admit(node_id)
        except web.HTTPException:
            self._count("busy")
            raise
        try:
            try:
                size = path.stat().st_size
                response, whole = await self._stream(request, path, size, lambda: self._serving.discard(node_id))
            except FileNotFoundError:  # never held, or rotated away since
                self._count("not_held")
                held = sorted(int(p.name[5:13]) for p in self.root.glob("step-????????.pt"))
                raise web.HTTPNotFound(
                    text=f"no {what} {path.name} here (checkpoints held: {held}): the trainer keeps its last two"
                ) from None
            if not whole:
                self._count("too_slow")
                logger.info("audit download of %s by %s cut off: a reader too slow", path.name, node_id)
                return response
            self._count(what)
            self.metrics.inc("node_audit_bytes_sent_total", size, help="bytes of checkpoints and spools sent")
            logger.info("sent %s (%d bytes) to auditor %s", path.name, size, node_id)
            return response
        finally:
            self._serving.discard(node_id)
