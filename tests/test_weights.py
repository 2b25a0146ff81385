"""Checkpoints: signed manifests, verified shards, served by the node's real HTTP server on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from intellect_node.metrics import Metrics
from intellect_node.status import HttpServer
from intellect_node.weights import (
    HTTP_TIMEOUT,
    MANIFEST_NAME,
    fetch_checkpoint,
    held_versions,
    load_checkpoint,
    prune,
    verify_manifest,
    write_checkpoint,
)
from intellect_protocol.envelope import Rejected
from intellect_protocol.identity import Identity

RUN_KEY = Identity.generate()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}


def test_write_splits_into_shards_and_round_trips(tmp_path: Path) -> None:
    tensors = _tensors()
    manifest = write_checkpoint(tmp_path, RUN_KEY, RUN_KEY.node_id, 0, tensors, shard_bytes=40_000)
    assert len(manifest.shards) == 2  # 64x64 fp32 is 16 KiB: two tensors fit in 40 KB, a third would not
    folder = tmp_path / "0"
    assert verify_manifest((folder / MANIFEST_NAME).read_bytes(), RUN_KEY.node_id, 0) == manifest
    loaded = load_checkpoint(folder, manifest)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_manifest_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, Identity.generate(), RUN_KEY.node_id, 0, _tensors(), shard_bytes=1 << 20)
    with pytest.raises(Rejected) as e:
        verify_manifest((tmp_path / "0" / MANIFEST_NAME).read_bytes(), RUN_KEY.node_id, 0)
    assert e.value.reason == "foreign_manifest"


def test_manifest_of_another_version_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, RUN_KEY, RUN_KEY.node_id, 3, _tensors(), shard_bytes=1 << 20)
    with pytest.raises(Rejected) as e:
        verify_manifest((tmp_path / "3" / MANIFEST_NAME).read_bytes(), RUN_KEY.node_id, 4)
    assert e.value.reason == "wrong_version"


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for v in range(5):
        write_checkpoint(tmp_path, RUN_KEY, RUN_KEY.node_id, v, {"w": torch.zeros(2)}, shard_bytes=1 << 20)
    prune(tmp_path, keep=2)
    assert held_versions(tmp_path) == [3, 4]


async def _serve_and_fetch(origin: Path, dest: Path, version: int) -> tuple[object, Path]:
    server = HttpServer(Metrics(), lambda: {}, origin)
    port = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
            return await fetch_checkpoint(session, f"http://127.0.0.1:{port}", RUN_KEY.node_id, version, dest)
    finally:
        await server.close()


def test_fetch_over_http_verifies_every_shard(tmp_path: Path) -> None:
    tensors = _tensors()
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN_KEY.node_id, 7, tensors, shard_bytes=40_000)
    manifest, folder = asyncio.run(_serve_and_fetch(tmp_path / "origin", tmp_path / "client", 7))
    loaded = load_checkpoint(folder, manifest)  # type: ignore[arg-type]
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert held_versions(tmp_path / "client") == [7]


def test_corrupted_shard_is_refused_and_not_kept(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN_KEY.node_id, 1, _tensors(), shard_bytes=40_000)
    shard = sorted((tmp_path / "origin" / "1").glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(Rejected) as e:
        asyncio.run(_serve_and_fetch(tmp_path / "origin", tmp_path / "client", 1))
    assert e.value.reason == "bad_shard"
    assert held_versions(tmp_path / "client") == []


def test_forged_manifest_on_the_server_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "origin", Identity.generate(), RUN_KEY.node_id, 2, _tensors(), shard_bytes=1 << 20)
    with pytest.raises(Rejected) as e:
        asyncio.run(_serve_and_fetch(tmp_path / "origin", tmp_path / "client", 2))
    assert e.value.reason == "foreign_manifest"
    assert held_versions(tmp_path / "client") == []


def test_a_republished_version_replaces_the_held_copy(tmp_path: Path) -> None:
    """A trainer restarted with the same key republishes version numbers; clients must not keep stale bytes."""
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN_KEY.node_id, 1, {"w": torch.zeros(8)}, shard_bytes=1 << 20)
    asyncio.run(_serve_and_fetch(tmp_path / "origin", tmp_path / "client", 1))
    write_checkpoint(tmp_path / "origin", RUN_KEY, RUN_KEY.node_id, 1, {"w": torch.ones(8)}, shard_bytes=1 << 20)
    manifest, folder = asyncio.run(_serve_and_fetch(tmp_path / "origin", tmp_path / "client", 1))
    assert torch.equal(load_checkpoint(folder, manifest)["w"], torch.ones(8))  # type: ignore[arg-type]
