"""One run's weight folder: complete versions, versions in progress, and only verified shards visible.

Layout (plain static files, servable by any HTTP server once complete)::

    <root>/<version>/manifest.msgpack          a complete, verified version
    <root>/<version>/shard-NNNNN.safetensors
    <root>/<version>.partial/manifest.msgpack  a version being received: manifest verified first,
    <root>/<version>.partial/<name>            then each shard, visible under its name once verified,
    <root>/<version>.partial/<name>.part       while its bytes arrive (resumed with HTTP Range)

Invariant: a file named as a shard is always one whose size and SHA-256 matched the signed manifest, so the
shard server may hand out any such file at once (pipelined relaying), and a restarted node keeps them.

A store holds one run epoch (``RunSpec.epoch``): only manifests of that epoch are accepted, and moving to a newer
epoch (the trainer started the run over) deletes every version of the old one, which would otherwise share
version numbers with different weights.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from intellect_node.aio import within
from intellect_node.weights.files import MANIFEST_NAME, fsync_dir, fsync_file, sha256_file, verify_manifest
from intellect_node.weights.stripes import stripe_of
from intellect_protocol.envelope import Rejected
from intellect_protocol.messages import Manifest, ShardEntry

logger = logging.getLogger(__name__)


@dataclass
class Growing:
    """A shard whose bytes are arriving right now (cut-through relaying reads them as they land).

    ``size`` bytes of the ``.part`` file are written and flushed; ``state`` is "open", then "done" (verified)
    or "failed" (the attempt ended without a verified shard: a reader must cut its response short).
    """

    path: Path
    size: int
    total: int
    state: str = "open"
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def pulse(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class WeightStore:
    def __init__(self, root: Path, run_id: str, epoch: int | None = None) -> None:
        self.root = root
        self.run_id = run_id
        self.epoch = epoch
        """The run epoch held (None: any, for tools that read a single folder)."""
        root.mkdir(parents=True, exist_ok=True)
        self._manifests: dict[int, Manifest] = {}
        self._names: dict[int, dict[str, int]] = {}
        """Per version: each shard's name and its place in the signed manifest."""
        self._verified: dict[int, set[str]] = {}
        self._arrived: dict[tuple[int, str], asyncio.Event] = {}
        self._growing: dict[tuple[int, str], Growing] = {}
        self._begun = asyncio.Event()
        """Pulsed (set, then replaced) whenever a version starts arriving."""
        if epoch is not None:
            self._drop_other_epochs()

    def set_epoch(self, epoch: int) -> None:
        """Hold run epoch ``epoch`` from now on: every version of another epoch is deleted (never served again)."""
        if epoch == self.epoch:
            return
        logger.info("run epoch %s -> %d: dropping the versions of the old epoch", self.epoch, epoch)
        self.epoch = epoch
        for version in [*self._verified, *{k[0] for k in self._growing}]:
            self.abandon(version)
        self._manifests.clear()
        self._names.clear()
        self._drop_other_epochs()
        self.added()

    def _drop_other_epochs(self) -> None:
        for folder in list(self.root.iterdir()):
            if not folder.name.split(".")[0].isdigit():
                continue
            try:
                data = (folder / MANIFEST_NAME).read_bytes()
                verify_manifest(data, self.run_id, int(folder.name.split(".")[0]), self.epoch)
            except (OSError, Rejected) as e:
                logger.info("removing %s: %s", folder.name, getattr(e, "detail", e))
                shutil.rmtree(folder, ignore_errors=True)

    # ---- reading (the shard server) -----------------------------------------------------------------

    def complete_versions(self) -> list[int]:
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and (p / MANIFEST_NAME).exists())

    def folder(self, version: int) -> Path:
        return self.root / str(version)

    def partial(self, version: int) -> Path:
        return self.root / f"{version}.partial"

    def manifest_bytes(self, version: int) -> bytes | None:
        for folder in (self.folder(version), self.partial(version)):
            path = folder / MANIFEST_NAME
            if path.exists():
                return path.read_bytes()
        return None

    def manifest(self, version: int) -> Manifest | None:
        if version not in self._manifests:
            data = self.manifest_bytes(version)
            if data is None:
                return None
            self._manifests[version] = verify_manifest(data, self.run_id, version, self.epoch)
        return self._manifests[version]

    def listed(self, version: int, name: str) -> bool:
        """Whether ``name`` is a shard of ``version`` by its signed manifest. Nothing else in a version folder is
        ever served: a file that got there by other means (a program run for a code reward copying the node key,
        say) is not a shard."""
        return self.index(version, name) is not None

    def index(self, version: int, name: str) -> int | None:
        """The place of shard ``name`` in the signed manifest of ``version`` (its stripe: stripes.stripe_of)."""
        names = self._names.get(version)
        if names is None:
            try:
                manifest = self.manifest(version)
            except Rejected:
                return None
            if manifest is None:
                return None
            names = self._names[version] = {s.name: i for i, s in enumerate(manifest.shards)}
        return names.get(name)

    def shard_file(self, version: int, name: str) -> Path | None:
        """The verified file for shard ``name`` of ``version``, if this node has it."""
        if not self.listed(version, name):
            return None
        done = self.folder(version) / name
        if done.is_file():
            return done
        if name in self._verified.get(version, ()):
            return self.partial(version) / name
        return None

    def newest(self) -> int:
        """The newest version held or arriving here (-1: none)."""
        return max([*self.complete_versions(), *self._verified], default=-1)

    def added(self) -> None:
        """A version began arriving, or was written into the store whole (the origin): wake those waiting."""
        self._begun.set()
        self._begun = asyncio.Event()

    async def wait_newer(self, after: int, timeout: float) -> int | None:
        """The newest version held or arriving here once it is newer than ``after``; None after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (newest := self.newest()) <= after:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await within(self._begun.wait(), remaining)
            except TimeoutError:
                return None
        return newest

    async def wait_begun(self, version: int, timeout: float) -> bool:
        """Wait until ``version`` (or a newer one) is held or arriving here; True if it is."""
        return await self.wait_newer(version - 1, timeout) is not None

    def growing(self, version: int, name: str) -> Growing | None:
        return self._growing.get((version, name))

    async def wait_shard(self, version: int, name: str, timeout: float) -> Path | Growing | None:
        """Wait until shard ``name`` of ``version`` is verified here, or its bytes start arriving; None if
        neither happens in time.

        Waits through a version that has not started arriving yet (a child may ask a moment before its parent
        has the manifest) and through a shard not yet requested from upstream.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if not await self.wait_begun(version, timeout):
            return None
        manifest = self._manifests.get(version)
        if version not in self._verified or manifest is None or all(s.name != name for s in manifest.shards):
            return self.shard_file(version, name)
        while (found := self.shard_file(version, name) or self.growing(version, name)) is None:
            event = self._arrived.setdefault((version, name), asyncio.Event())
            try:
                await within(event.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return None
            if version not in self._verified:  # abandoned or finished meanwhile
                return self.shard_file(version, name)
        return found

    # ---- writing (the fetcher) ----------------------------------------------------------------------

    def begin(self, version: int, manifest_data: bytes) -> tuple[Manifest, list[ShardEntry]]:
        """Start (or resume) receiving ``version``: returns its manifest and the shards still missing.

        Shards already on disk from an earlier run are re-hashed once and kept if they match.
        """
        manifest = verify_manifest(manifest_data, self.run_id, version, self.epoch)
        if (self.folder(version) / MANIFEST_NAME).exists():
            try:
                held: Manifest | None = verify_manifest(
                    (self.folder(version) / MANIFEST_NAME).read_bytes(), self.run_id, version, self.epoch
                )
            except Rejected:
                held = None
            if held is not None and held.checkpoint_sha256 == manifest.checkpoint_sha256:
                self._manifests[version] = held
                self._names.pop(version, None)
                return held, []
            shutil.rmtree(self.folder(version))  # the run restarted and reused this version number
        partial = self.partial(version)
        old = partial / MANIFEST_NAME
        if old.exists() and _held(old, self.run_id, version, self.epoch) != manifest:
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        (partial / MANIFEST_NAME).write_bytes(manifest_data)
        self._manifests[version] = manifest
        self._names.pop(version, None)
        verified: set[str] = set()
        for shard in manifest.shards:
            path = partial / shard.name
            if path.is_file():
                if path.stat().st_size == shard.size and sha256_file(path) == shard.sha256:
                    verified.add(shard.name)
                else:
                    path.unlink()
        self._verified[version] = verified
        self.added()
        if verified:
            logger.info("resuming version=%d verified_shards=%d of %d", version, len(verified), len(manifest.shards))
        return manifest, [s for s in manifest.shards if s.name not in verified]

    def part_path(self, version: int, name: str) -> Path:
        return self.partial(version) / f"{name}.part"

    def part_opened(self, version: int, name: str, have: int, total: int) -> Growing:
        """The fetcher starts (or resumes) writing this shard's ``.part`` file; readers may follow it."""
        old = self._growing.pop((version, name), None)
        if old is not None:
            old.state = "failed"
            old.pulse()
        growing = Growing(self.part_path(version, name), have, total)
        self._growing[(version, name)] = growing
        event = self._arrived.pop((version, name), None)
        if event is not None:
            event.set()
        return growing

    def part_grew(self, version: int, name: str, size: int) -> None:
        growing = self._growing.get((version, name))
        if growing is not None:
            growing.size = size
            growing.pulse()

    def part_closed(self, version: int, name: str, verified: bool) -> None:
        growing = self._growing.pop((version, name), None)
        if growing is not None:
            growing.state = "done" if verified else "failed"
            growing.pulse()

    async def mark_verified(self, version: int, name: str) -> None:
        # A name without .part is a promise that the bytes are whole: fsynced first, in a thread. In the event loop
        # an fsync would stop the node's uploads and cut-through with it for as long as the disk takes; with a
        # swarm's writes on one disk (every fsync on ext4 waits for a journal commit) every node would stall at once.
        await asyncio.to_thread(fsync_file, self.part_path(version, name))
        self.part_path(version, name).rename(self.partial(version) / name)
        self._verified.setdefault(version, set()).add(name)
        event = self._arrived.pop((version, name), None)
        if event is not None:
            event.set()

    def held(self, version: int, stripe: int, stripes: int) -> int:
        """Shards of ``stripe`` (of ``stripes``) of ``version`` held here verified: all of them once it is whole."""
        manifest = self.manifest(version)
        if manifest is None:
            return 0
        mine = [x.name for i, x in enumerate(manifest.shards) if stripe_of(i, stripes) == stripe]
        if (self.folder(version) / MANIFEST_NAME).exists():
            return len(mine)
        done = self._verified.get(version, set())
        return sum(name in done for name in mine)

    def verified_count(self, version: int) -> int:
        return len(self._verified.get(version, ()))

    async def finish(self, version: int) -> Path:
        """The version whole: its folder renamed into place, durably (the fsyncs in a thread, see mark_verified)."""
        partial = self.partial(version)
        for leftover in partial.glob("*.part"):
            leftover.unlink()
        await asyncio.to_thread(_fsync_folder, partial)
        partial.rename(self.folder(version))
        await asyncio.to_thread(fsync_dir, self.root)
        self._verified.pop(version, None)
        self.added()  # waiters re-check: a version they wait for may now be known to be skipped
        for key in [k for k in self._arrived if k[0] == version]:
            self._arrived.pop(key).set()
        return self.folder(version)

    def abandon(self, version: int) -> None:
        """Stop serving a version in progress (its verified shards stay on disk for a resume)."""
        self._verified.pop(version, None)
        for key in [k for k in self._growing if k[0] == version]:
            self.part_closed(*key, verified=False)
        for key in [k for k in self._arrived if k[0] == version]:
            self._arrived.pop(key).set()

    def prune(self, keep: int, max_bytes: int | None = None) -> None:
        """Keep the newest ``keep`` complete versions (fewer if they exceed ``max_bytes``, never fewer than one)."""
        versions = self.complete_versions()
        kept: list[int] = []
        total = 0
        for v in reversed(versions):
            size = sum(p.stat().st_size for p in self.folder(v).iterdir() if p.is_file())
            if kept and (len(kept) >= keep or (max_bytes is not None and total + size > max_bytes)):
                shutil.rmtree(self.folder(v), ignore_errors=True)
                self._manifests.pop(v, None)
                self._names.pop(v, None)
                continue
            kept.append(v)
            total += size
        newest = max(kept, default=-1)
        for p in self.root.glob("*.partial"):
            stem = p.name.split(".")[0]
            if stem.isdigit() and int(stem) < newest and int(stem) not in self._verified:
                shutil.rmtree(p, ignore_errors=True)


def _fsync_folder(folder: Path) -> None:
    fsync_file(folder / MANIFEST_NAME)
    fsync_dir(folder)


def _held(path: Path, run_id: str, version: int, epoch: int | None) -> Manifest | None:
    """The manifest of a version in progress kept on disk, if it is still one this store accepts."""
    try:
        return verify_manifest(path.read_bytes(), run_id, version, epoch)
    except (OSError, Rejected):
        return None
