"""Spare upload and the endgame: a relay lends upload no child of its own is using to other nodes (relay.py), and a
fetcher done with its own stripe takes the last shards of a lagging one from there, not from that stripe's parent
(fetch.pick_spare). Real shard servers on loopback, real fetches."""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from intellect_node.p2p.http import HttpServer
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights.auth import signed_headers
from intellect_node.weights.fetch import ShardFetcher
from intellect_node.weights.files import write_checkpoint
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.sources import Source, pick_spare
from intellect_node.weights.store import WeightStore
from intellect_node.weights.tree import Candidate
from intellect_protocol.identity import Identity

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id


def _shard(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def _checkpoint(root: Path, shards: int, shard_mib: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    per = int(shard_mib * (1 << 20)) // 4
    tensors = {f"t{i}": torch.rand(per, generator=g) for i in range(shards)}
    write_checkpoint(root, RUN_KEY, RUN, 1, tensors, shard_bytes=per * 4)


async def _server(
    root: Path, node: Identity, slots: int, stripes: int, home: int | None = None, bps: float | None = None
) -> tuple[ShardServer, HttpServer, str, Metrics]:
    metrics = Metrics()
    server = ShardServer(WeightStore(root, RUN), metrics, slots=slots, node_id=node.node_id, upload_limit_bps=bps)
    server.path, server.stripes, server.home = (lambda: [node.node_id]), stripes, (lambda: home)
    http = HttpServer(Metrics(), lambda: {}, server.routes())
    return server, http, f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}", metrics


async def _attach(session: aiohttp.ClientSession, url: str, me: Identity, to: str, stripe: int) -> str:
    query = f"/relay/attach?stripe={stripe}"
    async with session.post(url + query, headers=signed_headers(me, "POST", query, to)) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["token"])


@pytest.mark.integration
def test_a_node_with_every_slot_held_lends_idle_upload_and_takes_it_back_for_a_child(tmp_path: Path) -> None:
    """Every slot of the relay is held by a child, none of them being sent anything: an alternate (another node's
    child, or anyone) is served on that idle upload; while a child is being sent a shard, one is refused (503);
    and a response on spare upload is cut short the moment a child's starts (the alternate resumes elsewhere)."""
    _checkpoint(tmp_path, 4, 4.0)
    relay, child = Identity.generate(), Identity.generate()

    async def main() -> list[object]:
        server, http, url, metrics = await _server(tmp_path, relay, slots=1, stripes=1, bps=2e6)
        alternate = {"X-Intellect-Node": "a" * 32}
        out: list[object] = []
        try:
            async with aiohttp.ClientSession() as kid, aiohttp.ClientSession() as other:
                mine = {
                    "X-Intellect-Node": child.node_id,
                    "X-Intellect-Token": await _attach(kid, url, child, relay.node_id, 0),
                }
                async with other.get(f"{url}/weights/1/{_shard(0)}", headers=alternate) as lent:
                    out.append(lent.status)  # the only slot is the child's, but it is idle
                    await lent.content.readexactly(64 * 1024)
                    async with kid.get(f"{url}/weights/1/{_shard(1)}", headers=mine) as own:
                        out.append(own.status)
                        await own.content.readexactly(64 * 1024)  # being sent: the relay is in its response
                        async with other.get(f"{url}/weights/1/{_shard(2)}", headers={}) as r:
                            out.append(r.status)  # anyone: no spare upload while a child is sent something
                        try:
                            await lent.read()
                            out.append("whole")
                        except aiohttp.ClientPayloadError:
                            out.append("cut")
                        out.append(len(await own.read()) + 64 * 1024)
                out.append(metrics.counter("node_relay_spare_yielded_total"))
        finally:
            await http.close()
        return out

    size = (WeightStore(tmp_path, RUN).shard_file(1, _shard(1)) or Path()).stat().st_size
    assert asyncio.run(main()) == [200, 200, 503, "cut", size, 1.0]


def test_pick_spare_passes_over_the_stripes_parent_and_who_had_no_spare_upload() -> None:
    now = time.monotonic()
    parent = Source("p", "u", 1, True, frozenset({1}), bps=6e6, ok=9)
    other = Source("q", "u", 1, True, frozenset({0}), bps=6e6, ok=9)  # our parent in another stripe
    origin = Source("o", "u", 0, False)  # an alternate, as every holder of the whole version
    holder = Source("h", "u", 2, False, bps=1e6, ok=3)
    assert pick_spare([parent, other, origin, holder], {}, now, 1) is origin
    origin.spare_until = now + 1.0  # it had no spare upload a moment ago
    assert pick_spare([parent, other, origin, holder], {}, now, 1) is holder
    assert pick_spare([parent, other, origin, holder], {"h": now + 300}, now, 1) is None  # banned
    # never the stripe's parent (it streams the stripe already), nor another's (it may be receiving it still)
    assert pick_spare([parent, other], {}, now, 1) is None


@pytest.mark.integration
def test_a_fetcher_done_with_its_stripe_takes_a_lagging_stripes_last_shards_from_spare_upload(tmp_path: Path) -> None:
    """Two stripes: our parent in stripe 0 is fast, our parent in stripe 1 has a thin upload, and the origin's only
    slot is another node's, which it is sending nothing. The worker done with stripe 0 takes stripe 1's last shards
    from the origin's spare upload while stripe 1's own worker goes on with its parent from the first: the origin
    sends most of stripe 1, the slow parent the rest, and every shard is verified. (Before, that worker asked the
    slow parent too, splitting its upload: it sent 7 of stripe 1's 8 shards, a probe of the origin the other.)"""
    _checkpoint(tmp_path / "o", 16, 0.25)
    for copy in ("f", "p"):
        shutil.copytree(tmp_path / "o", tmp_path / copy)
    origin, fast, slow, me, other = RUN_KEY, *(Identity.generate() for _ in range(4))

    async def main() -> tuple[list[float], list[int]]:
        servers = [
            await _server(tmp_path / "o", origin, slots=1, stripes=2),
            await _server(tmp_path / "f", fast, slots=1, stripes=2, home=0),
            await _server(tmp_path / "p", slow, slots=1, stripes=2, home=1, bps=256e3),
        ]
        (_, _, o_url, _), (_, _, f_url, _), (_, _, p_url, _) = servers
        store = WeightStore(tmp_path / "me", RUN)
        try:
            async with aiohttp.ClientSession() as session:
                await _attach(session, o_url, other, origin.node_id, 0)  # the origin's slot: idle
                tokens = {
                    fast.node_id: await _attach(session, f_url, me, fast.node_id, 0),
                    slow.node_id: await _attach(session, p_url, me, slow.node_id, 1),
                }
                sources = [
                    Candidate(fast.node_id, f_url, 1, True, frozenset({0})),
                    Candidate(slow.node_id, p_url, 1, True, frozenset({1})),
                    Candidate(origin.node_id, o_url, 0, False),
                ]

                async def find(exclude: set[str]) -> list[Candidate]:
                    return [c for c in sources if c.node_id not in exclude]

                fetcher = ShardFetcher(session, store, me.node_id, Metrics())
                fetcher.stripes, fetcher.token_for = 2, lambda node: tokens.get(node, "")
                await fetcher.fetch(1, find, timeout=60)
        finally:
            for _, http, _, _ in servers:
                await http.close()
        return [m.counter("node_relay_shards_served_total") for _, _, _, m in servers], store.complete_versions()

    (from_origin, from_fast, from_slow), held = asyncio.run(main())
    assert held == [1]
    assert from_origin + from_fast + from_slow == 16 and from_slow <= 4  # without the endgame: 7 (a probe took 1)


@pytest.mark.integration
def test_a_holder_that_trickles_holds_an_endgame_shard_only_briefly(tmp_path: Path) -> None:
    """The grudge: a node whose record says it holds the version answers the endgame at once and then sends a
    kilobyte now and then. A shard on spare upload must come at half our slowest parent's rate or at least
    ``MIN_SHARD_BPS`` after ``SPARE_SLACK_S`` (no long poll to wait for): it is cut, and the bytes so far resumed
    from the parent, so the version completes well within a timeout the ordinary deadline (20 s and more a shard)
    would overrun."""
    _checkpoint(tmp_path / "o", 16, 0.25)
    for copy in ("f", "p"):
        shutil.copytree(tmp_path / "o", tmp_path / copy)
    fast, slow, me = (Identity.generate() for _ in range(3))
    shards = WeightStore(tmp_path / "o", RUN)

    async def trickle(request: web.Request) -> web.StreamResponse:
        path = shards.shard_file(int(request.match_info["version"]), request.match_info["name"])
        if path is None:
            raise web.HTTPNotFound()
        data = path.read_bytes()
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await resp.prepare(request)
        for i in range(0, len(data), 1024):
            await resp.write(data[i : i + 1024])
            await asyncio.sleep(0.5)
        return resp

    async def main() -> tuple[list[int], float]:
        app = web.Application()
        app.router.add_get("/weights/{version}/{name}", trickle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        liar_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        servers = [
            await _server(tmp_path / "f", fast, slots=1, stripes=2, home=0),
            await _server(tmp_path / "p", slow, slots=1, stripes=2, home=1, bps=1e6),
        ]
        (_, _, f_url, _), (_, _, p_url, _) = servers
        store = WeightStore(tmp_path / "me", RUN)
        metrics = Metrics()
        try:
            async with aiohttp.ClientSession() as session:
                tokens = {
                    fast.node_id: await _attach(session, f_url, me, fast.node_id, 0),
                    slow.node_id: await _attach(session, p_url, me, slow.node_id, 1),
                }
                sources = [
                    Candidate(fast.node_id, f_url, 1, True, frozenset({0})),
                    Candidate(slow.node_id, p_url, 1, True, frozenset({1})),
                    Candidate("l" * 32, liar_url, 1, False),
                ]

                async def find(exclude: set[str]) -> list[Candidate]:
                    return [c for c in sources if c.node_id not in exclude]

                fetcher = ShardFetcher(session, store, me.node_id, metrics)
                fetcher.stripes, fetcher.token_for = 2, lambda node: tokens.get(node, "")
                await fetcher.fetch(1, find, timeout=15)
        finally:
            for _, http, _, _ in servers:
                await http.close()
            await runner.cleanup()
        return store.complete_versions(), metrics.counter("node_weights_slow_sources_total")

    held, cut = asyncio.run(main())
    assert held == [1] and cut >= 1


@pytest.mark.integration
def test_children_sent_whole_shards_share_the_upload_though_the_kernel_never_holds_their_bytes(tmp_path: Path) -> None:
    """Two children fetch whole shards at once: each response has its bytes here, so the link (here the node's
    upload limit) is what holds it, and both are paced at an equal share in the kernel. Counted only while the
    kernel held unsent bytes, they were almost never: a saturated link's queue is past the socket (the tbf in
    netns, a modem), and at the origin one to four of the four roots counted from moment to moment, each left
    unpaced or at a half share, and a root fell up to 3 MB behind the others (netns N=16)."""
    _checkpoint(tmp_path, 2, 8.0)  # 4.2 s for both at the upload limit
    relay, a, b = (Identity.generate() for _ in range(3))

    async def main() -> list[int]:
        server, http, url, _ = await _server(tmp_path, relay, slots=2, stripes=1, home=0, bps=4e6)
        caps: list[int] = []
        try:
            async with aiohttp.ClientSession() as sa, aiohttp.ClientSession() as sb:
                tokens = [await _attach(s, url, w, relay.node_id, 0) for w, s in ((a, sa), (b, sb))]
                heads = [
                    {"X-Intellect-Node": w.node_id, "X-Intellect-Token": t} for w, t in zip((a, b), tokens, strict=True)
                ]
                ra = await sa.get(f"{url}/weights/1/{_shard(0)}", headers=heads[0])
                rb = await sb.get(f"{url}/weights/1/{_shard(0)}", headers=heads[1])  # the same place: equal shares
                reads = [asyncio.create_task(r.read()) for r in (ra, rb)]

                def kernel_caps() -> list[int]:
                    socks = [r.transport.get_extra_info("socket") for r in server.fair._requests.values()]  # type: ignore[union-attr]
                    return [struct.unpack("I", s.getsockopt(socket.SOL_SOCKET, 47, 4))[0] for s in socks]

                async with asyncio.timeout(4.0):  # the shards take 4.2 s: both paced well before the end
                    while len(now := kernel_caps()) < 2 or 0xFFFFFFFF in now:  # the upload's peak measured first
                        await asyncio.sleep(0.05)
                caps.extend(now)
                await asyncio.gather(*reads)
        finally:
            await http.close()
        return caps

    caps = asyncio.run(main())
    assert len(caps) == 2  # both counted
    assert all(0 < c < 4e6 for c in caps)  # each paced below the whole upload (its share, weighed by its place)
