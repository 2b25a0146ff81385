"""Checkpoints as plain static files: the trainer writes them, any HTTP server can serve them, clients verify.

Layout under a node's weight root, one folder per version::

    <version>/manifest.msgpack        the Manifest in a signed envelope (run key)
    <version>/shard-00000.safetensors  ... every shard the manifest names

A version folder appears only once complete (written as ``<version>.partial`` and renamed), so a server
never exposes a half-written checkpoint. A client acts on a manifest only if the run key signed it, and on a
shard only once its size and SHA-256 match the manifest.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from pathlib import Path

import aiohttp
import torch
from safetensors.torch import load_file, save_file

from intellect_protocol.envelope import Rejected, open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import Manifest, ShardEntry

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.msgpack"
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10, sock_read=30)
_CHUNK = 1 << 20


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_digest(shards: list[ShardEntry]) -> str:
    return hashlib.sha256(b"".join(bytes.fromhex(s.sha256) for s in shards)).hexdigest()


def _split(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def write_checkpoint(
    root: Path, identity: Identity, run_id: str, version: int, tensors: dict[str, torch.Tensor], shard_bytes: int
) -> Manifest:
    """Write ``tensors`` as version ``version`` under ``root`` with a manifest signed by ``identity``."""
    final = root / str(version)
    tmp = root / f"{version}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries = []
    for i, part in enumerate(_split(tensors, shard_bytes)):
        name = f"shard-{i:05d}.safetensors"
        save_file(part, str(tmp / name))
        entries.append(ShardEntry(name=name, size=(tmp / name).stat().st_size, sha256=_sha256_file(tmp / name)))
    manifest = Manifest(
        run_id=run_id,
        version=version,
        created=time.time(),
        shards=entries,
        total_size=sum(e.size for e in entries),
        checkpoint_sha256=checkpoint_digest(entries),
    )
    (tmp / MANIFEST_NAME).write_bytes(seal(identity, manifest))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return manifest


def held_versions(root: Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / MANIFEST_NAME).exists())


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` versions; drop older ones and any leftover partial folders."""
    for v in held_versions(root)[:-keep] if keep > 0 else held_versions(root):
        shutil.rmtree(root / str(v), ignore_errors=True)
    if root.exists():
        newest = max(held_versions(root), default=-1)
        for p in root.glob("*.partial"):
            stem = p.name.split(".")[0]
            if stem.isdigit() and int(stem) < newest:
                shutil.rmtree(p, ignore_errors=True)


def verify_manifest(data: bytes, run_id: str, version: int | None = None) -> Manifest:
    """The manifest in ``data`` if the run key signed it (and it is ``version``); raises Rejected otherwise."""
    signed = open_signed(data, Manifest)
    if signed.signer_id != run_id:
        raise Rejected("foreign_manifest", f"signed by {signed.signer_id}, not by the run key {run_id}")
    if signed.message.run_id != run_id:
        raise Rejected("wrong_run", f"manifest of run {signed.message.run_id}")
    if version is not None and signed.message.version != version:
        raise Rejected("wrong_version", f"asked for {version}, manifest says {signed.message.version}")
    if checkpoint_digest(signed.message.shards) != signed.message.checkpoint_sha256:
        raise Rejected("schema", "checkpoint_sha256 does not match the shard digests")
    return signed.message


def load_checkpoint(folder: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in manifest.shards:
        tensors.update(load_file(str(folder / shard.name)))
    return tensors


async def _download_shard(session: aiohttp.ClientSession, url: str, shard: ShardEntry, path: Path) -> None:
    h = hashlib.sha256()
    received = 0
    async with session.get(url) as resp:
        if resp.status != 200:
            raise Rejected("http_status", f"GET {url} answered {resp.status}")
        with open(path, "wb") as f:
            async for chunk in resp.content.iter_chunked(_CHUNK):
                received += len(chunk)
                if received > shard.size:
                    raise Rejected("bad_shard", f"{shard.name} is longer than the manifest's {shard.size} bytes")
                h.update(chunk)
                f.write(chunk)
    if received != shard.size or h.hexdigest() != shard.sha256:
        raise Rejected("bad_shard", f"{shard.name}: {received} bytes, sha256 {h.hexdigest()[:12]}… != manifest")


async def fetch_checkpoint(
    session: aiohttp.ClientSession, base_url: str, run_id: str, version: int, root: Path
) -> tuple[Manifest, Path]:
    """Download version ``version`` from ``base_url`` into ``root``; every byte verified before it is kept."""
    final = root / str(version)
    url = f"{base_url.rstrip('/')}/weights/{version}"
    async with session.get(f"{url}/{MANIFEST_NAME}") as resp:
        if resp.status != 200:
            raise Rejected("http_status", f"GET {url}/{MANIFEST_NAME} answered {resp.status}")
        data = await resp.content.read(Manifest.CHANNEL.value + 1)
    manifest = verify_manifest(data, run_id, version)
    if final.exists():
        held = verify_manifest((final / MANIFEST_NAME).read_bytes(), run_id, version)
        if held.checkpoint_sha256 == manifest.checkpoint_sha256:
            return manifest, final
        shutil.rmtree(final)  # the run restarted and republished this version number with other weights
    tmp = root / f"{version}.partial"
    tmp.mkdir(parents=True, exist_ok=True)
    for shard in manifest.shards:
        await _download_shard(session, f"{url}/{shard.name}", shard, tmp / shard.name)
    (tmp / MANIFEST_NAME).write_bytes(data)
    tmp.rename(final)
    return manifest, final
