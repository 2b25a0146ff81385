"""What fsync costs where the trainer promises durability, on this machine's disk.

    python benchmarks/durability.py [--dir PATH] [--batches 200]

- the spool: each accepted batch is appended and fsynced before the trainer answers ok (timed per batch, for a
  tiny-model batch of ~40 KB and a SmolLM2-sized one of ~1 MB), against the same appends only flushed;
- publishing a version: every shard and the manifest fsynced before the folder is renamed into place, and the
  directory after (the tiny model's 1.2 MB in one shard, and 64 MB in 4 shards), against the same without fsync.

Prints a table, then ``durability spool_fsync_ms_p50=... spool_fsync_ms_p99=... publish_fsync_overhead_ms=...``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from intellect_node.roles.trainer_checkpoint import CheckpointDir
from intellect_node.weights import files
from intellect_protocol.identity import Identity


def spool_ms(root: Path, size: int, n: int, fsync: bool) -> list[float]:
    ckpt = CheckpointDir(root)
    ckpt.start_spool(0)
    payload = b"\x85" + bytes(size - 1)
    out = []
    with mock.patch("os.fsync") if not fsync else mock.MagicMock():
        for _ in range(n):
            started = time.perf_counter()
            ckpt.append(payload)
            out.append((time.perf_counter() - started) * 1000)
    ckpt.close()
    return out


def publish_ms(root: Path, mb: float, shards: int, n: int, fsync: bool) -> list[float]:
    key = Identity.generate()
    tensors = {f"w{i}": torch.zeros(int(mb * 2**20 / 4 / shards)) for i in range(shards)}
    out = []
    patches = (mock.patch.object(files, "fsync_file"), mock.patch.object(files, "fsync_dir"))
    for v in range(n):
        if fsync:
            started = time.perf_counter()
            files.write_checkpoint(root, key, key.node_id, v, tensors, int(mb * 2**20 / shards) + 1024)
        else:
            with patches[0], patches[1]:
                started = time.perf_counter()
                files.write_checkpoint(root, key, key.node_id, v, tensors, int(mb * 2**20 / shards) + 1024)
        out.append((time.perf_counter() - started) * 1000)
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="a folder on the disk to measure (default: a temporary one)")
    p.add_argument("--batches", type=int, default=200)
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="intellect-durability-", dir=args.dir))
    rows = []
    for label, size in (("spool append, 40 KB batch", 40_000), ("spool append, 1 MB batch", 1_000_000)):
        synced = spool_ms(base / f"s{size}", size, args.batches, True)
        flushed = spool_ms(base / f"f{size}", size, args.batches, False)
        rows.append((label, statistics.median(flushed), statistics.median(synced), pct(synced, 0.99)))
    for label, mb, shards in (("publish 1.2 MB, 1 shard", 1.2, 1), ("publish 64 MB, 4 shards", 64, 4)):
        n = 10 if mb < 10 else 4
        synced = publish_ms(base / f"p{mb}", mb, shards, n, True)
        plain = publish_ms(base / f"q{mb}", mb, shards, n, False)
        rows.append((label, statistics.median(plain), statistics.median(synced), pct(synced, 0.99)))
    print("| operation | without fsync ms (p50) | with fsync ms (p50) | with fsync ms (p99) |\n|---|---:|---:|---:|")
    for label, plain_ms, synced_ms, p99 in rows:
        print(f"| {label} | {plain_ms:.2f} | {synced_ms:.2f} | {p99:.2f} |")
    spool = [r for r in rows if r[0].startswith("spool append, 40")][0]
    overhead = rows[-1][2] - rows[-1][1]
    print(
        f"durability spool_fsync_ms_p50={spool[2]:.2f} spool_fsync_ms_p99={spool[3]:.2f} "
        f"publish_fsync_overhead_ms={overhead:.1f}"
    )


if __name__ == "__main__":
    main()
