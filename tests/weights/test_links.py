"""The attachment part on its own (links.Attachments): no follower around it, the records a fixed dict, the
parents stub HTTP servers on loopback that answer slot requests as told."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.fetch import ShardFetcher
from intellect_node.weights.links import Attachments
from intellect_node.weights.store import WeightStore
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RelayInfo

RUN = "0" * 32


class _Parent:
    """A relay that answers ``POST /relay/attach`` with ``answer`` (status, JSON body) and counts slots given back."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.answer: tuple[int, dict[str, Any]] = (409, {"reason": "full"})
        self.asked: list[str] = []
        self.given_back = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def attach(request: web.Request) -> web.Response:
            self.asked.append(request.query_string)
            status, body = self.answer
            return web.json_response(body, status=status)

        async def detach(request: web.Request) -> web.Response:
            self.given_back += 1
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/relay/attach", attach)
        app.router.add_delete("/relay/attach", detach)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def record(self, bps: float) -> NodeRecord:
        relay = RelayInfo(depth=1, parent=RUN, slots_total=2, slots_free=1, upload_bps=bps)
        return NodeRecord(run_id=RUN, node_id=self.node_id, role="relay", updated=0.0, http_url=self.url, relay=relay)


class _Host:
    """What a follower would hand the part: records, the version being fetched, background work and publishes."""

    def __init__(self, records: dict[str, NodeRecord]) -> None:
        self.records = records
        self.planned = 0
        self.published = 0
        self.tasks: set[asyncio.Future[object]] = set()

    async def read(self, max_age: float) -> dict[str, NodeRecord]:
        return self.records

    def plan(self, records: dict[str, NodeRecord]) -> None:
        self.planned += 1

    def background(self, work: Awaitable[object]) -> None:
        self.tasks.add(asyncio.ensure_future(work))

    def publish_soon(self) -> None:
        self.published += 1

    async def settled(self) -> None:
        while self.tasks:
            done = list(self.tasks)
            self.tasks.clear()
            await asyncio.gather(*done)


def _part(me: Identity, host: _Host, metrics: Metrics, tmp_path: Path) -> Attachments:
    return Attachments(
        me,
        RUN,
        metrics,
        WeightStore(tmp_path / "me", RUN),
        read_records=host.read,
        plan_stripes=host.plan,
        fetching=lambda: -1,
        moved_at=lambda: -1e9,
        background=host.background,
        publish_soon=host.publish_soon,
    )


def test_the_first_slot_given_with_a_path_from_the_origin_is_taken_and_a_cycle_is_left(tmp_path: Path) -> None:
    """``choose`` asks the faster relay first (it refuses), then the other, whose path and token it keeps; a
    keep-alive that finds this node in the parent's path leaves it (the slot given back, the parent avoided for
    CYCLE_AVOID_S) and chooses again at once, here the relay that refused before."""
    me = Identity.generate()
    a, b = _Parent(Identity.generate().node_id), _Parent(Identity.generate().node_id)

    async def main() -> dict[str, object]:
        await a.start()
        await b.start()
        host = _Host({})
        metrics = Metrics()
        part = _part(me, host, metrics, tmp_path)
        out: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as session:
                host.records = {a.node_id: a.record(9e6), b.node_id: b.record(1e6)}
                part.start(session, ShardFetcher(session, part.store, me.node_id, metrics))
                b.answer = (200, {"depth": 1, "path": [RUN, b.node_id], "token": "tb"})
                await part.choose(await host.read(0.0), set())
                link = part.home_link
                out["chosen"] = (link.parent.node_id if link.parent else None, link.path, link.depth, link.token)
                out["asked"] = (len(a.asked), len(b.asked), host.planned, host.published)
                a.answer = (200, {"depth": 1, "path": [RUN, a.node_id], "token": "ta"})
                b.answer = (200, {"depth": 2, "path": [RUN, me.node_id, b.node_id], "token": "tb"})
                await part.attach_once(session)
                await host.settled()
                out["after"] = (link.parent.node_id if link.parent else None, link.path, link.parent_was)
                out["avoiding"] = part.avoiding()
                out["given_back"] = (a.given_back, b.given_back)
                out["cycles"] = metrics.counter("node_relay_cycles_left_total")
                out["token_for"] = (part.token_for(a.node_id), part.token_for(b.node_id))
        finally:
            await a.runner.cleanup()  # type: ignore[union-attr]
            await b.runner.cleanup()  # type: ignore[union-attr]
        return out

    out = asyncio.run(main())
    assert out["chosen"] == (b.node_id, [RUN, b.node_id, me.node_id], 2, "tb")
    assert out["asked"] == (1, 1, 1, 1)  # the stripes planned once, the new parent published once
    assert out["after"] == (a.node_id, [RUN, a.node_id, me.node_id], b.node_id)
    assert out["avoiding"] == {b.node_id}
    assert out["given_back"] == (0, 1)
    assert out["cycles"] == 1.0
    assert out["token_for"] == ("ta", "")
