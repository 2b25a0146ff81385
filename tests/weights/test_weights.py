"""Checkpoints end to end on loopback: signed manifests, shards verified, served by the node's shard server.

The fetcher is driven with a fixed source list here; the relay tree that plans sources is tested in
test_tree.py and, with real nodes, in test_relay_tree.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from intellect_node.p2p.http import HttpServer, decimal
from intellect_node.p2p.metrics import Metrics
from intellect_node.weights import relay
from intellect_node.weights import store as store_module
from intellect_node.weights.auth import signed_headers
from intellect_node.weights.fetch import ShardFetcher
from intellect_node.weights.files import MANIFEST_NAME, load_checkpoint, verify_manifest, write_checkpoint
from intellect_node.weights.pacing import _SIOCOUTQNSD, UNSENT_LOWAT, bound_unsent
from intellect_node.weights.relay import ShardServer
from intellect_node.weights.store import WeightStore
from intellect_node.weights.tree import Candidate
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity

RUN_KEY = Identity.generate()
RUN = RUN_KEY.node_id


def _tensors(seed: int = 0, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(n)}


def test_write_splits_into_shards_and_round_trips(tmp_path: Path) -> None:
    tensors = _tensors()
    manifest = write_checkpoint(tmp_path, RUN_KEY, RUN, 0, tensors, shard_bytes=40_000)
    assert len(manifest.shards) == 2  # 64x64 fp32 is 16 KiB: two tensors fit in 40 KB, a third would not
    folder = tmp_path / "0"
    assert verify_manifest((folder / MANIFEST_NAME).read_bytes(), RUN, 0) == manifest
    loaded = load_checkpoint(folder, manifest)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_a_small_model_is_cut_so_that_every_stripe_has_a_shard(tmp_path: Path) -> None:
    """A version under ``shard_bytes`` was one shard: with four stripes, relays at home in three of them had nothing
    to serve. It is cut into about one shard per stripe (never below files.MIN_SPLIT_BYTES)."""
    tensors = {f"layer{i}.weight": torch.zeros(128, 128) for i in range(16)}  # 64 KiB each, 1 MiB in all
    manifest = write_checkpoint(tmp_path, RUN_KEY, RUN, 0, tensors, shard_bytes=64 << 20, stripes=4)
    assert len(manifest.shards) == 4 and {i % 4 for i in range(len(manifest.shards))} == {0, 1, 2, 3}
    assert len(write_checkpoint(tmp_path, RUN_KEY, RUN, 1, tensors, shard_bytes=64 << 20).shards) == 1  # 1 stripe
    small = {"w": torch.zeros(16, 16)}  # 1 KiB: not cut further (one tensor is one shard at least)
    assert len(write_checkpoint(tmp_path, RUN_KEY, RUN, 2, small, shard_bytes=64 << 20, stripes=4).shards) == 1
    loaded = load_checkpoint(tmp_path / "0", manifest)
    assert loaded.keys() == tensors.keys()


def test_manifest_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, Identity.generate(), RUN, 0, _tensors(), shard_bytes=1 << 20)
    with pytest.raises(Rejected) as e:
        verify_manifest((tmp_path / "0" / MANIFEST_NAME).read_bytes(), RUN, 0)
    assert e.value.reason == "foreign_manifest"


def test_manifest_of_another_version_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, RUN_KEY, RUN, 3, _tensors(), shard_bytes=1 << 20)
    with pytest.raises(Rejected) as e:
        verify_manifest((tmp_path / "3" / MANIFEST_NAME).read_bytes(), RUN, 4)
    assert e.value.reason == "wrong_version"


def test_prune_keeps_the_newest_within_the_disk_budget(tmp_path: Path) -> None:
    store = WeightStore(tmp_path, RUN)
    for v in range(5):
        write_checkpoint(tmp_path, RUN_KEY, RUN, v, _tensors(v, 2), shard_bytes=1 << 20)
    store.prune(keep=3)
    assert store.complete_versions() == [2, 3, 4]
    store.prune(keep=3, max_bytes=40_000)  # one version is ~33 KB: only the newest fits
    assert store.complete_versions() == [4]


def test_a_store_holds_one_run_epoch_and_drops_the_others(tmp_path: Path) -> None:
    """Issue 13 item 1: after the run was started over, version 3 names other weights. A node holding the old
    epoch's version 3 (a volunteer rejoining with its old data dir) deletes it instead of trusting the number."""
    old, new = 1_000, 2_000
    write_checkpoint(tmp_path, RUN_KEY, RUN, 3, _tensors(1, 2), shard_bytes=1 << 20, epoch=old)
    write_checkpoint(tmp_path, RUN_KEY, RUN, 5, _tensors(2, 2), shard_bytes=1 << 20, epoch=old)
    (tmp_path / "7.partial").mkdir()  # a version of the old epoch half received
    store = WeightStore(tmp_path, RUN, epoch=old)
    assert store.complete_versions() == [3, 5]
    store.set_epoch(new)
    assert store.complete_versions() == [] and not (tmp_path / "7.partial").exists()
    manifest_data = write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 3, _tensors(3, 2), 1 << 20, epoch=new)
    data = (tmp_path / "origin" / "3" / MANIFEST_NAME).read_bytes()
    assert store.begin(3, data)[0] == manifest_data
    write_checkpoint(tmp_path / "stale", RUN_KEY, RUN, 4, _tensors(4, 2), 1 << 20, epoch=old)
    with pytest.raises(Rejected, match="epoch"):  # a parent still on the old epoch is not believed
        store.begin(4, (tmp_path / "stale" / "4" / MANIFEST_NAME).read_bytes())
    # a store made at start-up for the new epoch drops what another epoch left there
    write_checkpoint(tmp_path / "mixed", RUN_KEY, RUN, 1, _tensors(5, 2), 1 << 20, epoch=old)
    write_checkpoint(tmp_path / "mixed", RUN_KEY, RUN, 2, _tensors(6, 2), 1 << 20, epoch=new)
    assert WeightStore(tmp_path / "mixed", RUN, epoch=new).complete_versions() == [2]


@contextlib.asynccontextmanager
async def _origin(root: Path, **server_args: float) -> AsyncIterator[tuple[str, Metrics]]:
    metrics = Metrics()
    server = ShardServer(WeightStore(root, RUN), metrics, slots=int(server_args.pop("slots", 4)), **server_args)
    http = HttpServer(metrics, lambda: {}, server.routes())
    port = await http.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        await http.close()


async def _fetch(
    dest: Path,
    version: int,
    sources: list[Candidate],
    metrics: Metrics | None = None,
    timeout: float = 30.0,
    stall_s: float = 30.0,
) -> WeightStore:
    store = WeightStore(dest, RUN)

    async def find(exclude: set[str]) -> list[Candidate]:
        return [c for c in sources if c.node_id not in exclude]

    async with aiohttp.ClientSession() as session:
        fetcher = ShardFetcher(session, store, "c" * 32, metrics or Metrics(), stall_s=stall_s)
        await fetcher.fetch(version, find, timeout=timeout)
    return store


def test_fetch_verifies_every_shard_and_loads(tmp_path: Path) -> None:
    tensors = _tensors()
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 7, tensors, shard_bytes=20_000)

    async def main() -> WeightStore:
        async with _origin(tmp_path / "origin") as (url, _):
            return await _fetch(tmp_path / "client", 7, [Candidate("a" * 32, url, 0, True)])

    store = asyncio.run(main())
    manifest = store.manifest(7)
    assert store.complete_versions() == [7] and manifest is not None and len(manifest.shards) == 4
    loaded = load_checkpoint(store.folder(7), manifest)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_a_source_serving_bad_bytes_is_banned_and_the_shard_comes_from_elsewhere(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "good", RUN_KEY, RUN, 1, _tensors(), shard_bytes=20_000)
    write_checkpoint(tmp_path / "bad", RUN_KEY, RUN, 1, _tensors(), shard_bytes=20_000)
    for shard in sorted((tmp_path / "bad" / "1").glob("*.safetensors")):  # same manifest, corrupted bytes
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    metrics = Metrics()

    async def main() -> WeightStore:
        async with _origin(tmp_path / "good") as (good, _), _origin(tmp_path / "bad") as (bad, _):
            liar = Candidate("b" * 32, bad, 1, True)  # the parent, tried first
            return await _fetch(tmp_path / "client", 1, [liar, Candidate("a" * 32, good, 0, False)], metrics)

    store = asyncio.run(main())
    assert store.complete_versions() == [1]
    assert metrics.counter("node_relay_bans_total") == 1


def test_forged_manifest_is_never_acted_on(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "origin", Identity.generate(), RUN, 2, _tensors(), shard_bytes=1 << 20)

    async def main() -> None:
        async with _origin(tmp_path / "origin") as (url, _):
            await _fetch(tmp_path / "client", 2, [Candidate("a" * 32, url, 0, True)], metrics, timeout=1.0)

    metrics = Metrics()
    with pytest.raises(Rejected) as e:
        asyncio.run(main())
    assert e.value.reason == "no_source" and metrics.counter("node_relay_bans_total") == 1
    assert not (tmp_path / "client" / "2.partial").exists()
    assert WeightStore(tmp_path / "client", RUN).complete_versions() == []


def test_partial_shard_resumes_with_range(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 4, _tensors(n=1), shard_bytes=1 << 20)
    manifest_data = (tmp_path / "origin" / "4" / MANIFEST_NAME).read_bytes()
    shard = verify_manifest(manifest_data, RUN, 4).shards[0]
    client = WeightStore(tmp_path / "client", RUN)
    client.begin(4, manifest_data)
    half = (tmp_path / "origin" / "4" / shard.name).read_bytes()[: shard.size // 2]
    client.part_path(4, shard.name).write_bytes(half)
    metrics = Metrics()

    async def main() -> WeightStore:
        async with _origin(tmp_path / "origin") as (url, origin_metrics):
            store = await _fetch(tmp_path / "client", 4, [Candidate("a" * 32, url, 0, True)], metrics)
            assert origin_metrics.counter("node_relay_bytes_sent_total") == shard.size - len(half)
            return store

    assert asyncio.run(main()).complete_versions() == [4]
    assert metrics.counter("node_relay_bytes_received_total") == shard.size - len(half)


def test_verified_shards_survive_a_restart(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 5, _tensors(), shard_bytes=20_000)
    manifest_data = (tmp_path / "origin" / "5" / MANIFEST_NAME).read_bytes()
    first = WeightStore(tmp_path / "client", RUN)
    manifest, missing = first.begin(5, manifest_data)
    for shard in manifest.shards[:3]:  # as if three shards arrived before the node was killed
        first.part_path(5, shard.name).write_bytes((tmp_path / "origin" / "5" / shard.name).read_bytes())
        asyncio.run(first.mark_verified(5, shard.name))
    _, missing = WeightStore(tmp_path / "client", RUN).begin(5, manifest_data)
    assert [s.name for s in missing] == [manifest.shards[3].name]


def test_a_slow_fsync_stops_nothing_else_the_node_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard made durable (and then the version) waits for the disk in a thread: with the fsync in the event
    loop a busy disk stopped every upload and cut-through of the node for as long as it took, and a swarm's nodes
    on one disk all at once. A disk that takes 0.3 s an fsync here: the loop goes on ticking meanwhile."""
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 5, _tensors(), shard_bytes=20_000)
    manifest_data = (tmp_path / "origin" / "5" / MANIFEST_NAME).read_bytes()
    store = WeightStore(tmp_path / "client", RUN)
    manifest, _ = store.begin(5, manifest_data)
    real_fsync = store_module.fsync_file

    def slow_fsync(path: Path) -> None:
        time.sleep(0.3)
        real_fsync(path)

    monkeypatch.setattr(store_module, "fsync_file", slow_fsync)

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        for shard in manifest.shards:
            store.part_path(5, shard.name).write_bytes((tmp_path / "origin" / "5" / shard.name).read_bytes())
            await store.mark_verified(5, shard.name)
        await store.finish(5)
        ticker.cancel()
        return ticks

    fsyncs = len(manifest.shards) + 1  # every shard's, the manifest's (a folder's is fsync_dir)
    assert asyncio.run(main()) >= fsyncs * 0.3 / 0.01 / 2
    assert store.complete_versions() == [5]


def test_a_republished_version_replaces_the_held_copy(tmp_path: Path) -> None:
    """A trainer restarted with the same key republishes version numbers; clients must not keep stale bytes."""
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 1, {"w": torch.zeros(8)}, shard_bytes=1 << 20)

    async def main() -> WeightStore:
        async with _origin(tmp_path / "origin") as (url, _):
            return await _fetch(tmp_path / "client", 1, [Candidate("a" * 32, url, 0, True)])

    asyncio.run(main())
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 1, {"w": torch.ones(8)}, shard_bytes=1 << 20)
    store = asyncio.run(main())
    manifest = store.manifest(1)
    assert manifest is not None and torch.equal(load_checkpoint(store.folder(1), manifest)["w"], torch.ones(8))


def test_a_version_its_sources_dropped_is_given_up_not_waited_for_forever(tmp_path: Path) -> None:
    """Sources keep only their newest versions: a node that fell behind must move on to the newest one."""
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 3, _tensors(), shard_bytes=20_000)
    for shard in (tmp_path / "origin" / "3").glob("*.safetensors"):
        shard.unlink()  # pruned between announcing the manifest and serving the shards

    async def main() -> None:
        async with _origin(tmp_path / "origin") as (url, _):
            await _fetch(tmp_path / "client", 3, [Candidate("a" * 32, url, 0, True)], timeout=60, stall_s=1.0)

    with pytest.raises(Rejected) as e:
        asyncio.run(main())
    assert e.value.reason == "stalled"


@contextlib.asynccontextmanager
async def _relay(root: Path, metrics: Metrics) -> AsyncIterator[tuple[str, WeightStore]]:
    """A relay's store and shard server in this event loop (its fetcher is driven by the test)."""
    store = WeightStore(root, RUN)
    http = HttpServer(metrics, lambda: {}, ShardServer(store, metrics, slots=4).routes())
    port = await http.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", store
    finally:
        await http.close()


async def _through_relay(
    tmp_path: Path,
    upstream: list[Candidate],
    relay: str,
    relay_store: WeightStore,
    relay_metrics: Metrics,
    child_metrics: Metrics,
    session: aiohttp.ClientSession,
) -> WeightStore:
    """The relay fetches version 1 from ``upstream`` while a child fetches it from the relay only."""

    async def find_upstream(exclude: set[str]) -> list[Candidate]:
        return [c for c in upstream if c.node_id not in exclude]

    relaying = asyncio.create_task(ShardFetcher(session, relay_store, "r" * 32, relay_metrics).fetch(1, find_upstream))
    child = await _fetch(tmp_path / "child", 1, [Candidate("r" * 32, relay, 1, True)], child_metrics)
    await relaying
    return child


def test_a_relay_passes_a_shard_on_while_it_is_still_arriving(tmp_path: Path) -> None:
    """Cut-through: the child's copy of the shard starts before the relay has it all (one 800 kB shard, the
    origin's upload capped at 400 kB/s), and the child still verifies it against the signed manifest."""
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 1, _tensors(n=50), shard_bytes=1 << 20)
    relay_metrics, child_metrics = Metrics(), Metrics()

    async def main() -> WeightStore:
        async with (
            _origin(tmp_path / "origin", upload_limit_bps=400_000) as (origin, _),
            _relay(tmp_path / "relay", relay_metrics) as (relay, relay_store),
            aiohttp.ClientSession() as session,
        ):
            upstream = [Candidate("a" * 32, origin, 0, True)]
            return await _through_relay(tmp_path, upstream, relay, relay_store, relay_metrics, child_metrics, session)

    child = asyncio.run(main())
    manifest = child.manifest(1)
    assert child.complete_versions() == [1] and manifest is not None
    assert relay_metrics.counter("node_relay_streams_total") >= 1
    assert child_metrics.counter("node_relay_bytes_received_total") == manifest.total_size
    assert child_metrics.counter("node_relay_bans_total") == 0


def test_unverified_bad_bytes_cost_a_relay_a_strike_not_a_ban(tmp_path: Path) -> None:
    """A relay that passes on bytes from a lying upstream is not to blame for them: its child retries; the relay
    bans the liar, takes the shard from the origin, and the child gets it from the relay."""
    write_checkpoint(tmp_path / "good", RUN_KEY, RUN, 1, _tensors(n=50), shard_bytes=1 << 20)
    write_checkpoint(tmp_path / "bad", RUN_KEY, RUN, 1, _tensors(n=50), shard_bytes=1 << 20)
    for shard in (tmp_path / "bad" / "1").glob("*.safetensors"):
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    relay_metrics, child_metrics = Metrics(), Metrics()

    async def main() -> WeightStore:
        async with (
            _origin(tmp_path / "good") as (good, _),
            _origin(tmp_path / "bad", upload_limit_bps=400_000) as (bad, _),
            _relay(tmp_path / "relay", relay_metrics) as (relay, relay_store),
            aiohttp.ClientSession() as session,
        ):
            upstream = [Candidate("b" * 32, bad, 0, True), Candidate("a" * 32, good, 0, False)]
            return await _through_relay(tmp_path, upstream, relay, relay_store, relay_metrics, child_metrics, session)

    child = asyncio.run(main())
    assert child.complete_versions() == [1]
    assert relay_metrics.counter("node_relay_bans_total") == 1  # the relay banned the liar
    assert child_metrics.counter("node_relay_bans_total") == 0  # the child did not ban the relay
    assert relay_metrics.counter("node_relay_streams_total") >= 1


def test_only_files_the_signed_manifest_names_are_served(tmp_path: Path) -> None:
    """A file dropped into a published version folder (a program run for a code reward copying the node key
    there was the attack) is not a shard: the shard server answers 404 for it, with or without a child header."""
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 3, _tensors(), shard_bytes=20_000)
    (tmp_path / "origin" / "3" / "node.key").write_bytes(b"secret key bytes")
    (tmp_path / "origin" / "3" / "shard-99999.safetensors").write_bytes(b"not in the manifest")

    async def main() -> list[int]:
        async with _origin(tmp_path / "origin") as (url, _), aiohttp.ClientSession() as session:
            codes = []
            asks: list[tuple[str, dict[str, str]]] = [
                ("node.key", {}),
                ("shard-99999.safetensors", {}),
                ("node.key", {"X-Intellect-Node": "c" * 32}),
                ("shard-00000.safetensors", {}),
            ]
            for name, headers in asks:
                async with session.get(f"{url}/weights/3/{name}", headers=headers) as resp:
                    codes.append(resp.status)
            return codes

    assert asyncio.run(main()) == [404, 404, 404, 200]


def test_numbers_in_a_strangers_request_that_are_not_plain_decimal_get_a_clear_refusal_not_a_500(
    tmp_path: Path,
) -> None:
    """Anyone may ask a relay for news and shards: a version that ``str.isdigit`` takes but ``int`` does not (a
    superscript two, Arabic-Indic digits, a doubled minus) is refused as a bad request (each such request was a
    500, and aiohttp logged its traceback at ERROR)."""
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 3, _tensors(), shard_bytes=20_000)

    async def main() -> list[int]:
        async with _origin(tmp_path / "origin") as (url, _), aiohttp.ClientSession() as session:
            codes = []
            for path in (
                "/relay/next?after=%C2%B2",
                "/relay/next?after=--5",
                "/relay/next?after=%D9%A3",
                "/relay/next?after=+3",
                "/weights/%C2%B2/manifest.msgpack",
                "/weights/%D9%A3/manifest.msgpack",
                "/weights/3/manifest.msgpack",
            ):
                async with session.get(url + path) as resp:
                    codes.append(resp.status)
            return codes

    assert asyncio.run(main()) == [400, 400, 400, 400, 404, 404, 200]
    assert [decimal(x, 3) for x in ("12", "²", "-1", "1234", "", "٣")] == [12, None, None, None, None, None]
    assert decimal("-12", 3, negative=True) == -12 and decimal("--1", 3, negative=True) is None


def test_a_parent_that_trickles_is_cut_blamed_and_the_shards_come_from_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: a parent chosen first sends a byte now and then, never silent long enough for a per-read
    timeout, so the node never finished a version. Each shard now has a whole-transfer deadline."""
    from intellect_node.weights import fetch

    monkeypatch.setattr(fetch, "SHARD_SLACK_S", 1.0)
    monkeypatch.setattr(fetch, "MIN_SHARD_BPS", 1e6)
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN, 2, _tensors(), shard_bytes=20_000)
    manifest_bytes = (tmp_path / "origin" / "2" / MANIFEST_NAME).read_bytes()

    async def trickle(request: web.Request) -> web.StreamResponse:
        if request.match_info["name"] == MANIFEST_NAME:
            return web.Response(body=manifest_bytes)
        resp = web.StreamResponse()
        resp.content_length = 20_000
        await resp.prepare(request)
        for _ in range(20_000):
            await resp.write(b"\0")
            await asyncio.sleep(0.3)
        return resp

    async def main() -> tuple[WeightStore, Metrics, float]:
        slow = HttpServer(Metrics(), lambda: {}, [web.get("/weights/{version}/{name}", trickle)])
        slow_url = f"http://127.0.0.1:{await slow.start('127.0.0.1', 0)}"
        metrics = Metrics()
        started = asyncio.get_running_loop().time()
        try:
            async with _origin(tmp_path / "origin") as (url, _):
                sources = [Candidate("t" * 32, slow_url, 1, True), Candidate("a" * 32, url, 0, False)]
                store = await _fetch(tmp_path / "client", 2, sources, metrics, timeout=60)
        finally:
            await slow.close()
        return store, metrics, asyncio.get_running_loop().time() - started

    store, metrics, seconds = asyncio.run(main())
    assert store.complete_versions() == [2]
    assert metrics.counter("node_weights_slow_sources_total") >= 1
    assert seconds < 30


def test_a_relay_keeps_little_of_a_response_unsent_in_the_kernel() -> None:
    """A cut-through relay's bytes queue behind whatever the kernel holds unsent for that child: a level of the
    tree adds that queue's drain time. With ``bound_unsent`` (as every relay response does) the kernel holds
    at most about ``UNSENT_LOWAT`` unsent while a slow reader takes 8 MiB; the rest waits in the process."""

    async def main(bounded: bool) -> int:
        worst = 0

        async def handler(request: web.Request) -> web.StreamResponse:
            nonlocal worst
            resp = web.StreamResponse()
            await resp.prepare(request)
            if bounded:
                bound_unsent(request)
            sock = request.transport.get_extra_info("socket")  # type: ignore[union-attr]
            for _ in range(32):
                await resp.write(b"x" * (256 * 1024))
                unsent = fcntl.ioctl(sock.fileno(), _SIOCOUTQNSD, b"\0\0\0\0")
                worst = max(worst, int.from_bytes(unsent, "little"))
            return resp

        http = HttpServer(Metrics(), lambda: {}, [web.get("/slow", handler)])
        port = await http.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/slow") as r:
                while await r.content.read(64 * 1024):
                    await asyncio.sleep(0.002)  # the reader's pace (a slow link, about 30 MB/s), not a wait
        finally:
            await http.close()
        return worst

    assert asyncio.run(main(bounded=True)) <= UNSENT_LOWAT + 64 * 1024
    assert asyncio.run(main(bounded=False)) > 4 * UNSENT_LOWAT  # what the test would see without it


def test_an_alternate_uses_a_free_slot_while_it_is_served(tmp_path: Path) -> None:
    """A node that is not our child (another's child using us as an alternate, or an anonymous client) is served
    only while a slot is free, and the slot is its own while the response lasts: a second one is refused 503
    meanwhile, and served once the first is done. Before, every alternate was served at once: in the simulator
    1,558 nodes took their last shard from one early finisher, each at 1/1,558 of its upload, for 2,000 s."""
    g = torch.Generator().manual_seed(0)
    write_checkpoint(tmp_path, RUN_KEY, RUN, 1, {"w": torch.rand(4 << 20, generator=g)}, shard_bytes=32 << 20)
    shard = "/weights/1/shard-00000.safetensors"

    async def main() -> list[int]:
        server = ShardServer(WeightStore(tmp_path, RUN), Metrics(), slots=1)
        http = HttpServer(Metrics(), lambda: {}, server.routes())
        url = f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}"
        other = {"X-Intellect-Node": "a" * 32}
        codes = []
        try:
            async with aiohttp.ClientSession() as s1, aiohttp.ClientSession() as s2:
                async with s1.get(url + shard, headers=other) as first:  # 16 MiB: in flight until it is read
                    codes.append(first.status)
                    for headers in (other, {}):  # another alternate, an anonymous client: no slot for them
                        async with s2.get(url + shard, headers=headers) as r:
                            codes.append(r.status)
                    codes.append(len(await first.read()) > 16 << 20)
                # on the first one's connection: the server reads it once the first response's handler returned
                async with s1.get(url + shard, headers=other) as r:
                    codes.append(r.status)
        finally:
            await http.close()
        return codes

    assert asyncio.run(main()) == [200, 503, 503, True, 200]


async def _one_slot_origin(tmp_path: Path) -> tuple[ShardServer, HttpServer, str]:
    """An origin serving ``tmp_path`` with one upload slot, on loopback."""
    server = ShardServer(WeightStore(tmp_path, RUN), Metrics(), slots=1, node_id=RUN)
    server.path = lambda: [RUN]
    http = HttpServer(Metrics(), lambda: {}, server.routes())
    return server, http, f"http://127.0.0.1:{await http.start('127.0.0.1', 0)}"


def test_a_member_hogging_free_slots_with_slow_downloads_keeps_no_child_out(tmp_path: Path) -> None:
    """The grudge: hold every free slot of the origin with downloads read slowly, so others are refused. It
    refuses other alternates while it lasts (that is the rule), but a child still attaches and is served: a
    request uses a free slot, it never keeps one from a child."""
    g = torch.Generator().manual_seed(1)
    write_checkpoint(tmp_path, RUN_KEY, RUN, 1, {"w": torch.rand(4 << 20, generator=g)}, shard_bytes=32 << 20)
    shard = "/weights/1/shard-00000.safetensors"
    child = Identity.generate()

    async def main() -> list[object]:
        server, http, url = await _one_slot_origin(tmp_path)
        out: list[object] = []
        try:
            async with aiohttp.ClientSession() as hog, aiohttp.ClientSession() as s:
                async with hog.get(url + shard) as held:  # anonymous, never read: the slot stays in use
                    out.append(held.status)
                    async with s.get(url + shard, headers={"X-Intellect-Node": "b" * 32}) as r:
                        out.append(r.status)
                    query = "/relay/attach?stripe=0"
                    async with s.post(url + query, headers=signed_headers(child, "POST", query, RUN)) as r:
                        out.append(r.status)
                        token = (await r.json())["token"]
                    headers = {"X-Intellect-Node": child.node_id, "X-Intellect-Token": token}
                    async with s.get(url + shard, headers=headers) as r:
                        out.append((r.status, len(await r.read()) > 16 << 20))
        finally:
            await http.close()
        return out

    assert asyncio.run(main()) == [200, 503, 200, (200, True)]


def test_a_reader_that_reads_nothing_loses_its_slot_and_gets_a_cut_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grudge above, kept up: a download never read would hold the relay's free slot for ever (a write
    waiting on a full socket has no end of its own). A response that cannot move on for ``STREAM_STALL_S`` is
    cut: the slot serves the next alternate, and the reader gets a short body, never a complete wrong one."""
    monkeypatch.setattr(relay, "STREAM_STALL_S", 0.5)
    g = torch.Generator().manual_seed(1)
    write_checkpoint(tmp_path, RUN_KEY, RUN, 1, {"w": torch.rand(8 << 20, generator=g)}, shard_bytes=64 << 20)
    shard = "/weights/1/shard-00000.safetensors"

    async def main() -> list[object]:
        server, http, url = await _one_slot_origin(tmp_path)
        out: list[object] = []
        try:
            async with aiohttp.ClientSession() as hog, aiohttp.ClientSession() as s:
                async with hog.get(url + shard) as held:
                    out.append(held.status)
                    async with s.get(url + shard, headers={"X-Intellect-Node": "b" * 32}) as r:
                        out.append(r.status)  # the slot is in use
                    for _ in range(200):  # until the relay cuts the response that does not move
                        if server._lent == 0:
                            break
                        await asyncio.sleep(0.05)
                    async with s.get(url + shard, headers={"X-Intellect-Node": "b" * 32}) as r:
                        out.append((r.status, len(await r.read())))
                    try:
                        out.append(len(await held.read()))
                    except aiohttp.ClientPayloadError:
                        out.append("cut")
        finally:
            await http.close()
        return out

    size = (WeightStore(tmp_path, RUN).shard_file(1, shard.rsplit("/", 1)[1]) or Path()).stat().st_size
    assert asyncio.run(main()) == [200, 503, (200, size), "cut"]
