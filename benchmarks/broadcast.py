"""Broadcast benchmark: time until every receiver holds a verified new checkpoint, ours against shardcast 0.3.2.

Topology: an origin and N receiver hosts, each in its own Linux network namespace on one bridge, each host's
upload shaped by tc (tbf) to ``--mbit``. Ours: the origin is benchmarks/harness/broadcast_origin.py (the trainer's
publishing path), every receiver an `intellect-node join --role relay` process; the relay tree forms on a tiny
version 0, then ``--warmup`` full-size versions (``--size-mb``) go out (default one: a run's volunteers get a
version every step, and the first after a mass join is the stampede of N joins, with no node's upload measured
yet; it is in the table as "first version s"), then the next one is timed from just before it is written until
the last receiver has verified every shard. Baseline: shardcast's origin, M middle nodes (extra hosts, shaped
alike) and N clients, published at the middle nodes' average poll phase (15 s into their stock 30 s interval),
timed from just before it shards and hashes until the last client has its blake3-verified file. Bound: S / B.

Needs root (namespaces, tc), and for the baseline `pip install shardcast==0.3.2` and `wget`. Every namespace it
makes is removed on exit, also on failure. Prints one table and, for each N, a summary line (N=16 last):
    broadcast N=16 size_mb=64 ours_s=... shardcast_s=... bound_s=... ours_over_bound=... speedup_vs_shardcast=...

    python benchmarks/broadcast.py [--n 4 8 16] [--size-mb 64] [--mbit 25] [--slots 1 2] [--middles 1 2]

The default upload rate is 25 Mbit/s, lowered from 100: on a 2-core machine 17 node processes (each with a
hivemind DHT peer and a p2p daemon) relaying 16 x 100 Mbit/s are CPU-bound, and the time then measures the CPU,
not the protocol (measured: N=16 at 100 Mbit/s 19.5 s against a 5.4 s bound before cut-through relaying).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from intellect_node.launch import NodeProcess
from intellect_node.weights.files import MANIFEST_NAME, verify_manifest

from harness.netns import Topology, available

HERE = Path(__file__).resolve().parent


def _stamp(line: str, key: str = "at") -> float:
    return float(next(tok.split("=", 1)[1] for tok in line.split() if tok.startswith(f"{key}=")))


def _verify(folder: Path, manifest_data: bytes, run_id: str, version: int) -> bool:
    manifest = verify_manifest(manifest_data, run_id, version)
    return all(hashlib.sha256((folder / s.name).read_bytes()).hexdigest() == s.sha256 for s in manifest.shards)


def _last_reparent(log: Path) -> float:
    """Unix time of the node's last parent or home stripe change, from its log (0 if none)."""
    last = 0.0
    for line in log.read_text(errors="replace").splitlines():
        if (" parent=" in line or "home stripe" in line) and "intellect_node.weights.follower" in line:
            last = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
    return last


def _wait_settled(logs: list[Path], quiet_s: float, timeout: float) -> float:
    """Wait until no receiver has changed parent for ``quiet_s``: the broadcast of a run's later versions goes
    through a tree that formed once; this measures that steady state, not the stampede of 16 joins."""
    started = time.time()
    while time.time() - started < timeout:
        if time.time() - max(_last_reparent(log) for log in logs) >= quiet_s:
            break
        time.sleep(1.0)
    return time.time() - started


def run_ours(
    n: int,
    size_mb: int,
    mbit: float,
    slots: int | None,
    shard_mb: int,
    work: Path,
    log_level: str = "INFO",
    stripes: int = 4,
    warmup: int = 1,
) -> dict[str, object]:
    fanout = ["--slots", str(slots)] if slots else []
    nodes: list[NodeProcess] = []
    with Topology("ibo", n + 1, mbit) as topo:
        try:
            origin_host, hosts = topo.hosts[0], topo.hosts[1:]
            origin = NodeProcess(
                "origin",
                [
                    "--host",
                    origin_host.ip,
                    "--data-dir",
                    str(work / "origin"),
                    *fanout,
                    "--stripes",
                    str(stripes),
                    "--size-mb",
                    str(size_mb),
                    "--shard-mb",
                    str(shard_mb),
                ],
                work / "logs",
                command=[sys.executable, str(HERE / "harness" / "broadcast_origin.py")],
                prefix=origin_host.prefix,
                stdin=subprocess.PIPE,
            )
            nodes.append(origin)
            ready = origin.wait_ready(timeout=120)
            for i, h in enumerate(hosts):
                argv = [
                    "join",
                    "--role",
                    "relay",
                    "--host",
                    h.ip,
                    "--peers",
                    ready["p2p_maddrs"][0],
                    "--run-id",
                    ready["run_id"],
                    "--data-dir",
                    str(work / f"r{i}"),
                    *(["--relay-slots", str(slots)] if slots else []),
                    "--join-timeout",
                    "300",
                    "--log-level",
                    log_level,
                ]
                nodes.append(NodeProcess(f"r{i}", argv, work / "logs", prefix=h.prefix))
            for node in nodes[1:]:
                node.wait_ready(timeout=600)
            for node in nodes[1:]:  # the tree forms on the tiny version 0
                node.wait_for_line("HOLDING 0 ", timeout=300)
            logs = [work / "logs" / f"r{i}.log" for i in range(n)]
            settle_s = _wait_settled(logs, quiet_s=10.0, timeout=180.0)
            run_id = ready["run_id"]
            times: list[float] = []
            for version in range(1, warmup + 2):
                if version > 1:  # homes move between versions; then every node has measured its upload
                    settle_s += _wait_settled(logs, quiet_s=10.0, timeout=180.0)
                assert origin.proc.stdin is not None
                origin.proc.stdin.write(b"PUBLISH\n")
                origin.proc.stdin.flush()
                published = origin.wait_for_line("PUBLISHED", timeout=300)
                t0 = _stamp(published)
                write_s = _stamp(published, "written_at") - t0
                done = [_stamp(node.wait_for_line(f"HOLDING {version} ", timeout=600)) for node in nodes[1:]]
                times.append(max(done) - t0)
            manifest = (work / "origin" / run_id / str(version) / MANIFEST_NAME).read_bytes()
            verified = all(
                _verify(work / f"r{i}" / "weights" / run_id / str(version), manifest, run_id, version) for i in range(n)
            )
            depths = []
            for i in range(n):
                lines = [x for x in logs[i].read_text().splitlines() if f"holding version={version}" in x]
                depths += [int(tok.split("=")[1]) for tok in lines[-1].split() if tok.startswith("depth=")]
            return {
                "seconds": times[-1],
                "first_s": round(times[0], 2),
                "write_s": round(write_s, 2),
                "verified": verified,
                "max_depth": max(depths, default=-1),
                "settle_s": round(settle_s, 1),
            }
        finally:
            for node in nodes:
                node.terminate()
            for node in nodes:
                node.stop()


def run_shardcast(n: int, m: int, size_mb: int, mbit: float, work: Path, delay: float) -> dict[str, object]:
    with Topology("isc", 1 + m + n, mbit, net=78) as topo:
        hosts = topo.hosts
        topology = {
            "origin": {"ip": hosts[0].ip, "port": 8100, "prefix": hosts[0].prefix},
            "middles": [
                {"ip": h.ip, "port": 8100, "prefix": h.prefix, "upstream": ["origin"]} for h in hosts[1 : 1 + m]
            ],
            "clients": [{"prefix": h.prefix, "servers": [f"m{i % m}"]} for i, h in enumerate(hosts[1 + m :])],
        }
        (work / "topology.json").write_text(json.dumps(topology))
        cmd = [
            sys.executable,
            str(HERE / "shardcast_baseline.py"),
            "--topology",
            str(work / "topology.json"),
            "--size-mb",
            str(size_mb),
            "--publish-delay",
            str(delay),
            "--timeout",
            "900",
            "--workdir",
            str(work / "run"),
            "--log-level",
            "WARNING",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        if not lines:
            raise RuntimeError(f"shardcast baseline printed no result: {out.stderr[-2000:]}")
        res = json.loads(lines[-1])
        if not res.get("ok"):
            raise RuntimeError(f"shardcast baseline failed: {res.get('error')}")
        return {"seconds": float(res["total_s"]), "verified": bool(res.get("verified"))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--mbit", type=float, default=25.0, help="each host's upload (tc tbf); see above for why 25")
    p.add_argument(
        "--slots",
        nargs="+",
        default=["auto"],
        help="our relay fan-out settings to measure: auto (the default, from measured upload) or N",
    )
    p.add_argument("--stripes", type=int, default=4, help="stripes per version (1: a single tree)")
    p.add_argument("--shard-mb", type=int, default=1)
    p.add_argument("--middles", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--shardcast-phase-s",
        type=float,
        default=15.0,
        help="publish this long after the middles' first poll (stock interval 30 s: average phase)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="full-size versions published (and waited for) before the timed one; 0: time the first",
    )
    p.add_argument("--skip-shardcast", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep each run's folder (logs) under /tmp")
    p.add_argument("--node-log-level", default="INFO")
    args = p.parse_args()
    if not available():
        print("broadcast: needs root and `ip netns` (network namespaces and tc shaping); not available here")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through every `finally`: namespaces go
    rows: list[dict[str, object]] = []
    summaries: list[str] = []
    for n in args.n:
        bound = args.size_mb * 2**20 * 8 / (args.mbit * 1e6)
        ours: dict[str, float] = {}
        for slots in args.slots:
            work = Path(tempfile.mkdtemp(prefix=f"bcast-ours-{n}-{slots}-"))
            try:
                fixed = None if slots == "auto" else int(slots)
                r = run_ours(
                    n,
                    args.size_mb,
                    args.mbit,
                    fixed,
                    args.shard_mb,
                    work,
                    args.node_log_level,
                    args.stripes,
                    args.warmup,
                )
            finally:
                if not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
            ours[slots] = float(r["seconds"])  # type: ignore[arg-type]
            rows.append({"system": f"intellect-node slots={slots} stripes={args.stripes}", "N": n, **r})
            print(f"  ours N={n} slots={slots}: {r}", flush=True)
        sc: dict[int, float] = {}
        if not args.skip_shardcast:
            for m in args.middles:
                work = Path(tempfile.mkdtemp(prefix=f"bcast-sc-{n}-{m}-"))
                try:
                    r = run_shardcast(n, m, args.size_mb, args.mbit, work, args.shardcast_phase_s)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                sc[m] = float(r["seconds"])  # type: ignore[arg-type]
                rows.append({"system": f"shardcast 0.3.2 middles={m}", "N": n, **r})
                print(f"  shardcast N={n} middles={m}: {r}", flush=True)
        best_ours = min(ours.values())
        best_sc = min(sc.values()) if sc else float("nan")
        rows.append({"system": "bound S/B", "N": n, "seconds": bound, "verified": "-"})
        summaries.append(
            f"broadcast N={n} size_mb={args.size_mb} ours_s={best_ours:.2f} shardcast_s={best_sc:.2f} "
            f"bound_s={bound:.2f} ours_over_bound={best_ours / bound:.2f} "
            f"speedup_vs_shardcast={best_sc / best_ours:.2f}"
        )
    print()
    print(
        f"checkpoint {args.size_mb} MiB; every host's upload shaped to {args.mbit:g} Mbit/s with tc in network "
        f"namespaces; ours: {args.shard_mb} MiB shards"
    )
    print(f"{'system':<32}{'N':>4}{'seconds':>10}{'vs bound':>10}  verified  depth  first version s  origin write s")
    for r in rows:
        bound = args.size_mb * 2**20 * 8 / (args.mbit * 1e6)
        secs = float(r["seconds"])  # type: ignore[arg-type]
        print(
            f"{r['system']:<32}{r['N']:>4}{secs:>10.2f}{secs / bound:>10.2f}  {r['verified']!s:<8}  "
            f"{r.get('max_depth', '')!s:<5}  {r.get('first_s', '')!s:<15}  {r.get('write_s', '')}"
        )
    print()
    for line in summaries:
        print(line)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    sys.exit(main())
