"""A parent that serves nothing: a relay whose record offers the best place in a stripe (depth 1, free slots, a huge
upload), that grants the slot and keeps it alive, then sends each shard (and the manifest, or a true copy of the
manifest: it is the run key's to sign, anyone can pass it on) a byte a second; or one that answers every request at
once with 404, as a node does that has moved past the version (an inference node fetches only the versions it
needs). A newcomer attached below it must still hold every version, each within the stall budget (fetch.STALL_S) of
a first fetch: it leaves a parent at the first shard cut for coming too slowly and does not take it again soon, and
takes a shard its parent will not have from another source.

Real shard servers on loopback (the origin, the hostile relay), the real follower choosing, holding and leaving
parents from the records, and fetching as a relay does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.fetch import STALL_S
from intellect_node.weights.files import MANIFEST_NAME, write_checkpoint
from intellect_node.weights.follower import WeightFollower
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_protocol.identity import Identity
from intellect_protocol.messages import NodeRecord, RelayInfo

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id
STRIPES = 4


class _Records:
    def __init__(self, records: dict[str, NodeRecord]) -> None:
        self.records = records

    async def get_nodes(self) -> dict[str, NodeRecord]:
        return self.records


async def _hostile_relay(liar: Identity, manifests: Path | None, past: bool) -> tuple[web.AppRunner, str, list[str]]:
    """Grants every slot with a path from the origin, has no news, and trickles every shard (and the manifest,
    unless it passes on the true one from ``manifests``), or (``past``) answers each at once with 404. Returns the
    shards it was asked for."""
    asked: list[str] = []

    async def attach(request: web.Request) -> web.Response:
        return web.json_response({"depth": 1, "path": [RUN, liar.node_id], "token": "t"})

    async def detach(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def no_news(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def trickle(request: web.Request) -> web.StreamResponse:
        if past:
            asked.append(request.match_info["name"])
            raise web.HTTPNotFound()
        if manifests is not None and request.match_info["name"] == MANIFEST_NAME:
            return web.Response(body=(manifests / request.match_info["version"] / MANIFEST_NAME).read_bytes())
        asked.append(request.match_info["name"])
        resp = web.StreamResponse()
        resp.content_length = 1 << 20
        await resp.prepare(request)
        for _ in range(1 << 20):
            await resp.write(b"\0")
            await asyncio.sleep(1.0)
        return resp

    app = web.Application()
    app.router.add_post("/relay/attach", attach)
    app.router.add_delete("/relay/attach", detach)
    app.router.add_get("/relay/next", no_news)
    app.router.add_get("/weights/{version}/{name}", trickle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", asked


@pytest.mark.integration
@pytest.mark.parametrize(
    "true_manifest, past",
    [(False, False), (True, False), (False, True)],
    ids=["trickles-everything", "trickles-shards", "moved-past"],
)
def test_a_newcomer_below_a_parent_that_serves_nothing_holds_every_version_within_the_stall_budget(
    tmp_path: Path, true_manifest: bool, past: bool
) -> None:
    liar, me = Identity.generate(), Identity.generate()
    g = torch.Generator().manual_seed(0)

    async def main() -> tuple[list[float], list[str], dict[int, str | None]]:
        metrics = Metrics()
        origin = ShardServer(WeightStore(tmp_path / "origin", RUN), metrics, slots=STRIPES, node_id=RUN)
        origin.stripes, origin.path = STRIPES, lambda: [RUN]
        http = HttpServer(metrics, lambda: {}, origin.routes())
        url = f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}"
        runner, liar_url, asked = await _hostile_relay(liar, tmp_path / "origin" if true_manifest else None, past)
        records = {
            RUN: NodeRecord(
                run_id=RUN,
                node_id=RUN,
                role="trainer",
                updated=0.0,
                http_url=url,
                relay=RelayInfo(depth=0, slots_total=STRIPES, slots_free=STRIPES, stripes=STRIPES),
            ),
            liar.node_id: NodeRecord(
                run_id=RUN,
                node_id=liar.node_id,
                role="relay",
                updated=0.0,
                http_url=liar_url,
                relay=RelayInfo(depth=1, slots_total=64, slots_free=64, upload_bps=1e12, stripe=0, stripes=STRIPES),
            ),
        }
        follower = WeightFollower(
            me,
            RUN,
            _Records(records),
            WeightStore(tmp_path / "me", RUN),
            Metrics(),
            None,
            2,  # type: ignore[arg-type]
            None,
            lambda: asyncio.sleep(0),
        )
        took: list[float] = []
        try:
            async with aiohttp.ClientSession() as session:
                follower.start(session)
                keeping = asyncio.ensure_future(follower.keep_attached(session))
                try:
                    for version in range(2):  # one shard of 1 MiB: stripe 0's, where the hostile relay is at home
                        tensors = {"w": torch.rand(1 << 18, generator=g)}
                        write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, version, tensors, shard_bytes=1 << 20)
                        started = time.monotonic()
                        await follower.sync(version)  # a stalled fetch raises: the version was not held in time
                        took.append(time.monotonic() - started)
                    return took, asked, follower.parents()
                finally:
                    keeping.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await keeping
        finally:
            await runner.cleanup()
            await http.close()

    took, asked, parents = asyncio.run(main())
    assert len(asked) >= 1  # it was chosen and asked
    assert all(t < STALL_S for t in took), took
    if past:  # a parent past a version may serve the next: kept, asked once for each shard it will not have
        assert parents[0] == liar.node_id and asked.count("shard-00000.safetensors") == 2, (parents, asked)
    else:  # left, and not asked again for the next version
        assert parents[0] == RUN and liar.node_id not in parents.values()
        assert len(asked) == 1
