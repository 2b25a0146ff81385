"""The attachment part on its own (links.Attachments): no follower around it, the records a fixed dict, the
parents stub HTTP servers on loopback that answer slot requests as told."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from intellect_node.p2p.metrics import Metrics
from intellect_node.weights import links
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
        self.headers: dict[str, str] = {}
        self.asked: list[str] = []
        self.given_back = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def attach(request: web.Request) -> web.Response:
            self.asked.append(request.query_string)
            status, body = self.answer
            return web.json_response(body, status=status, headers=self.headers)

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


def test_a_node_without_a_parent_asks_less_and_less_often_and_at_once_when_a_slot_comes(tmp_path: Path) -> None:
    """A stripe's only candidate is full (503, naming nobody). The keep-alive loop asked it every second, for as
    long as the node had no parent: the red team's relay asked the origin about three times a second all run, was
    past its key's allowance within a minute, and then was answered 429 whatever came free. Now a round that finds
    no parent waits ASK_BACKOFF_S, doubled each time: over 10 s the full node is asked at most 5 times (10 before).
    A new candidate with a free slot is asked at once, and taken."""
    me = Identity.generate()
    full, free = _Parent(Identity.generate().node_id), _Parent(Identity.generate().node_id)

    async def main() -> dict[str, object]:
        await full.start()
        await free.start()
        host = _Host({full.node_id: full.record(1e6)})
        metrics = Metrics()
        part = _part(me, host, metrics, tmp_path)
        out: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as session:
                part.start(session, ShardFetcher(session, part.store, me.node_id, metrics))
                full.answer = (503, {"children": []})
                link = part.home_link
                keeping = asyncio.ensure_future(part.keep_link(session, link))
                try:
                    await asyncio.sleep(10.0)
                    out["asked"] = len(full.asked)
                    free.answer = (200, {"depth": 1, "path": [RUN, free.node_id], "token": "tf"})
                    host.records = {**host.records, free.node_id: free.record(1e6)}
                    start = time.monotonic()
                    while link.parent is None and time.monotonic() - start < 5.0:
                        await asyncio.sleep(0.05)
                    out["parent"] = (link.parent.node_id if link.parent else None, time.monotonic() - start)
                finally:
                    keeping.cancel()
                    await asyncio.gather(keeping, return_exceptions=True)
                    await host.settled()
        finally:
            await full.runner.cleanup()  # type: ignore[union-attr]
            await free.runner.cleanup()  # type: ignore[union-attr]
        return out

    out = asyncio.run(main())
    assert 2 <= out["asked"] <= 5  # type: ignore[operator]
    parent, after = out["parent"]  # type: ignore[misc]
    assert parent == free.node_id and after < links.KEEPALIVE_S + 1.0


def test_a_refusal_with_retry_after_is_not_asked_again_before_it(tmp_path: Path) -> None:
    """A candidate that refuses with 429 and Retry-After: 5 (a key past its allowance, auth.KEY_RETRY_AFTER_S) is
    left out of the rounds of asking for that long, even when the node's own backoff would ask again; another
    candidate is still asked. A Retry-After of a day counts as MAX_RETRY_AFTER_S. A 503's Retry-After (no slot in
    one stripe) holds nothing back: the other stripes may have room, and the backoff spaces the asking."""
    me = Identity.generate()
    busy, other = _Parent(Identity.generate().node_id), _Parent(Identity.generate().node_id)

    async def main() -> list[int]:
        await busy.start()
        await other.start()
        host = _Host({busy.node_id: busy.record(9e6), other.node_id: other.record(1e6)})
        metrics = Metrics()
        part = _part(me, host, metrics, tmp_path)
        try:
            async with aiohttp.ClientSession() as session:
                part.start(session, ShardFetcher(session, part.store, me.node_id, metrics))
                busy.answer, busy.headers = (429, {}), {"Retry-After": "5"}
                other.answer = (503, {"children": []})
                link = part.home_link
                counts = []
                for retry_after in ("5", "86400"):
                    busy.headers = {"Retry-After": retry_after}
                    part._retry_at.clear()
                    for _ in range(2):
                        link.ask_after = 0.0  # the node's own backoff over: only the Retry-After holds it back
                        await part.choose(await host.read(0.0), set(), link)
                    counts += [len(busy.asked), len(other.asked)]
                    busy.asked.clear()
                    other.asked.clear()
                held = round(max(part._retry_at.values()) - time.monotonic())
                part._retry_at.clear()
                busy.answer = (503, {"children": []})
                for _ in range(2):
                    link.ask_after = 0.0
                    await part.choose(await host.read(0.0), set(), link)
                return [*counts, held, len(busy.asked)]
        finally:
            await busy.runner.cleanup()  # type: ignore[union-attr]
            await other.runner.cleanup()  # type: ignore[union-attr]

    assert asyncio.run(main()) == [1, 2, 1, 2, links.MAX_RETRY_AFTER_S, 2]
