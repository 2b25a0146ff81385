"""Checkpoints as plain static files: writing one with its signed manifest, verifying and loading it.

Layout under a node's weight root, one folder per version::

    <version>/manifest.msgpack        the Manifest in a signed envelope (run key)
    <version>/shard-00000.safetensors  ... every shard the manifest names

A version folder appears only once complete (written as ``<version>.partial`` and renamed). A node acts on a
manifest only if the run key signed it, and on a shard only once its size and SHA-256 match the manifest
(``store.py`` keeps the folders, ``fetch.py`` receives them, ``relay.py`` serves them).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    """Make ``path``'s bytes durable (written data survives a power loss once this returns)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the names in directory ``path`` durable: a rename or a new file in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_digest(shards: list[ShardEntry]) -> str:
    return hashlib.sha256(b"".join(bytes.fromhex(s.sha256) for s in shards)).hexdigest()


MIN_SPLIT_BYTES = 64 * 1024
"""Shards are never cut smaller than this to reach the stripes (a shard is one request and one verification)."""


def shard_size(total: int, shard_bytes: int, stripes: int) -> int:
    """The shard size to cut a version of ``total`` bytes into: at most ``shard_bytes``, and small enough that every
    one of ``stripes`` stripes gets a shard (a shard goes to stripe ``index % stripes``). With one 21 MB shard of a
    small model and four stripes, the relays at home in three of the stripes had nothing to serve."""
    return max(1, min(shard_bytes, max(MIN_SPLIT_BYTES, -(-total // max(1, stripes)))))


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
    root: Path,
    identity: Identity,
    run_id: str,
    version: int,
    tensors: dict[str, torch.Tensor],
    shard_bytes: int,
    epoch: int = 0,
    stripes: int = 1,
    before_rename: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Write ``tensors`` as version ``version`` of run epoch ``epoch`` under ``root`` with a manifest signed by
    ``identity``, in shards of at most ``shard_bytes`` and at least one per stripe where the tensors allow it
    (``shard_size``). Every shard and the manifest are fsynced before the folder is renamed into place, and the
    rename is made durable: after a power loss a complete-looking version is a whole one. ``before_rename`` is
    called with the manifest once everything is durable but not yet visible (the trainer writes the version's
    ledger entry there, naming the weights' digest); if it raises, nothing is published."""
    final = root / str(version)
    tmp = root / f"{version}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries = []
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for i, part in enumerate(_split(tensors, shard_size(total, shard_bytes, stripes))):
        name = f"shard-{i:05d}.safetensors"
        save_file(part, str(tmp / name))
        fsync_file(tmp / name)
        entries.append(ShardEntry(name=name, size=(tmp / name).stat().st_size, sha256=sha256_file(tmp / name)))
    manifest = Manifest(
        run_id=run_id,
        version=version,
        epoch=epoch,
        created=time.time(),
        shards=entries,
        total_size=sum(e.size for e in entries),
        checkpoint_sha256=checkpoint_digest(entries),
    )
    (tmp / MANIFEST_NAME).write_bytes(seal(identity, manifest))
    fsync_file(tmp / MANIFEST_NAME)
    fsync_dir(tmp)
    if before_rename is not None:
        try:
            before_rename(manifest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(root)
    return manifest


def verify_manifest(data: bytes, run_id: str, version: int | None = None, epoch: int | None = None) -> Manifest:
    """The manifest in ``data`` if the run key signed it (and it is ``version`` of run epoch ``epoch``); raises
    Rejected otherwise."""
    signed = open_signed(data, Manifest)
    if signed.signer_id != run_id:
        raise Rejected("foreign_manifest", f"signed by {signed.signer_id}, not by the run key {run_id}")
    if signed.message.run_id != run_id:
        raise Rejected("wrong_run", f"manifest of run {signed.message.run_id}")
    if version is not None and signed.message.version != version:
        raise Rejected("wrong_version", f"asked for {version}, manifest says {signed.message.version}")
    if epoch is not None and signed.message.epoch != epoch:
        raise Rejected(
            "wrong_epoch",
            f"version {signed.message.version} of run epoch {signed.message.epoch}, not of the current epoch {epoch}",
        )
    if checkpoint_digest(signed.message.shards) != signed.message.checkpoint_sha256:
        raise Rejected("schema", "checkpoint_sha256 does not match the shard digests")
    return signed.message


def load_checkpoint(folder: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in manifest.shards:
        tensors.update(load_file(str(folder / shard.name)))
    return tensors
