"""Where a netns broadcast's time went: reads the folder ``benchmarks/broadcast.py --keep`` leaves.

    sudo python benchmarks/broadcast.py --n 16 --skip-shardcast --keep --node-log-level DEBUG
    python benchmarks/harness/broadcast_logs.py /tmp/bcast-ours-16-auto-XXXXXXXX

The per-shard lines the fetcher logs (``shard=... source=... waited_and_received_s=...``) are DEBUG. For the
timed version (the last one published), in seconds from its publish: when the origin had it written; each node's
first request, first shard and last shard; per stripe, the node the origin sent it to (its root), when that root
had it and when the last node did; and per node and stripe, when it had the stripe and where its shards came from.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import re
import sys
from pathlib import Path

SHARD = re.compile(r"shard=shard-(\d+)\S* source=(\w+) bytes=(\d+) waited_and_received_s=([\d.]+)")


def _at(line: str) -> float | None:
    try:
        stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return None
    return stamp.replace(tzinfo=datetime.UTC).timestamp()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--stripes", type=int, default=4)
    a = p.parse_args()
    logs = a.folder / "logs"
    published = [x for x in (logs / "origin.out").read_text().splitlines() if x.startswith("PUBLISHED")]
    if not published:
        sys.exit(f"{logs / 'origin.out'}: no PUBLISHED line (the origin's output)")
    t0 = float(re.search(r" at=([\d.]+)", published[-1]).group(1))  # type: ignore[union-attr]
    written = float(re.search(r"written_at=([\d.]+)", published[-1]).group(1)) - t0  # type: ignore[union-attr]
    run = re.search(r'"run_id": "(\w+)"', (logs / "origin.out").read_text())
    origin = run.group(1)[:8] if run else "?"
    names = {origin: "origin"}
    shards: dict[str, list[tuple[int, str, float, float]]] = {}  # node -> (index, source, started, ended)
    for log in sorted(logs.glob("r*.log"), key=lambda f: int(f.stem[1:]) if f.stem[1:].isdigit() else 0):
        rows = []
        for line in log.read_text(errors="replace").splitlines():
            if log.stem not in names.values() and (m := re.search(r"node_id=(\w{8})", line)):
                names[m.group(1)] = log.stem
            m = SHARD.search(line)
            t = _at(line) if m else None
            if m is None or t is None or t < t0:
                continue
            ended = t - t0
            rows.append((int(m.group(1)), m.group(2), ended - float(m.group(4)), ended))
        shards[log.stem] = rows
    if not any(shards.values()):
        sys.exit("no per-shard lines after the last publish: run broadcast.py with --node-log-level DEBUG")
    k = a.stripes
    print(f"origin written at {written:.2f} s")
    print(f"{'node':<6}{'first request':>14}{'first shard':>12}{'done':>8}")
    for node, rows in sorted(shards.items(), key=lambda x: max((r[3] for r in x[1]), default=0.0)):
        if rows:
            print(
                f"{node:<6}{min(r[2] for r in rows):>14.2f}{min(r[3] for r in rows):>12.2f}"
                f"{max(r[3] for r in rows):>8.2f}"
            )
    print()
    for s in range(k):
        roots = [n for n, rows in shards.items() if any(r[1] == origin and r[0] % k == s for r in rows)]
        had = {n: max((r[3] for r in rows if r[0] % k == s), default=float("nan")) for n, rows in shards.items()}
        root_at = " ".join(f"{n} {had[n]:.2f} s" for n in roots)
        print(f"stripe {s}: from the origin to {root_at or 'nobody'}; last node {max(had.values()):.2f} s")
    print()
    for node, rows in sorted(shards.items()):
        cells = []
        for s in range(k):
            mine = [r for r in rows if r[0] % k == s]
            if not mine:
                continue
            count = collections.Counter(names.get(r[1], r[1]) for r in mine)
            cells.append(f"s{s} {max(r[3] for r in mine):.1f} ({', '.join(f'{n}:{c}' for n, c in count.items())})")
        print(f"{node:<6}" + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
