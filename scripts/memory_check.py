"""The default demo inside a memory cgroup: does it complete, and learn, on a machine with 4 GB? (run by hand, as
root; not part of CI).

Makes a memory cgroup limited to ``--limit-gb`` (cgroup v1: ``memory.limit_in_bytes``, swap off for it; v2:
``memory.max`` and ``memory.swap.max = 0``), starts ``intellect-node demo`` inside it, so the demo, its trainer,
inference node, DHT processes and go-libp2p daemons all count against the one limit, and samples every process
in it once a second (PSS: shared pages split between the processes that map them, so the figures add up).
Prints the demo's own output, then the peak memory per kind of process, the
cgroup's peak (which also counts page cache the kernel can reclaim), OOM kills, and one summary line:
    memory_check limit_mb=4096 exit=0 oom_kills=0 cgroup_peak_mb=... pss_sum_peak_mb=... gain_points=...

    python scripts/memory_check.py [--limit-gb 4] [-- demo arguments, e.g. --minutes 7]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil

MB = 2**20
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class Cgroup:
    """A fresh memory cgroup (v1 or v2) limited to ``limit`` bytes, without swap."""

    def __init__(self, limit: int) -> None:
        name = f"intellect-memory-check-{os.getpid()}"
        self.v2 = (V2 / "cgroup.controllers").exists()
        self.path = (V2 if self.v2 else V1) / name
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            (self.path / "memory.swappiness").write_text("0")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def usage(self) -> int:
        return int((self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")).read_text())

    def peak(self) -> int | None:
        f = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        f = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        m = re.search(r"oom_kill (\d+)", f.read_text())
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def kind(p: psutil.Process) -> str:
    """What a process in the demo is: the demo itself, a node by role, a node's DHT process (forked from it: the
    same command line as its parent), p2pd, another."""
    try:
        cmd = p.cmdline()
        name = p.name()
        parent = p.parent()
        if parent is not None and parent.cmdline() == cmd and "intellect_node.cli" in " ".join(cmd):
            return f"{kind(parent)}'s DHT process"
    except psutil.Error:
        return "gone"
    text = " ".join(cmd)
    if "p2pd" in name or (cmd and cmd[0].endswith("p2pd")):
        return "p2pd"
    if " demo" in text:
        return "demo"
    if "bootstrap" in text:
        return "trainer"
    if "--role" in cmd:
        return cmd[cmd.index("--role") + 1]
    if "multiprocessing" in text or "spawn_main" in text or "forkserver" in text:
        return "child (DHT, jail)"
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit-gb", type=float, default=4.0)
    ap.add_argument("--trace", type=Path, help="write every sample (seconds, kind, PSS MB) to this CSV file")
    ap.add_argument("demo_args", nargs="*", help="after --: arguments for intellect-node demo")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("memory_check: making a cgroup needs root (sudo python scripts/memory_check.py)")
    exe = shutil.which("intellect-node")
    demo = [exe, "demo"] if exe else [sys.executable, "-m", "intellect_node.cli", "demo"]
    limit = int(args.limit_gb * 2**30)
    group = Cgroup(limit)
    peaks: dict[str, int] = defaultdict(int)  # per kind: the highest sum of PSS at one sample
    top = {"sum": 0, "usage": 0}
    stop = threading.Event()
    trace: list[tuple[float, str, float]] = []
    began = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            now: dict[str, int] = defaultdict(int)
            for pid in group.pids():
                try:
                    p = psutil.Process(pid)
                    now[kind(p)] += p.memory_full_info().pss  # shared pages split between their users
                except psutil.Error:
                    continue
            for k, v in now.items():
                peaks[k] = max(peaks[k], v)
                trace.append((time.monotonic() - began, k, v / MB))
            top["sum"] = max(top["sum"], sum(now.values()))
            try:
                top["usage"] = max(top["usage"], group.usage())
            except OSError:
                pass
            stop.wait(1.0)

    watcher = threading.Thread(target=sample, daemon=True)
    output: list[str] = []
    code = -1
    try:
        cmd = ["sh", "-c", f'echo $$ > {group.path / "cgroup.procs"} && exec "$@"', "sh", *demo, *args.demo_args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watcher.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            output.append(line)
        code = proc.wait()
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        oom = group.oom_kills()
        peak = group.peak() or top["usage"]
        group.remove()
    if args.trace:
        args.trace.write_text("seconds,kind,pss_mb\n" + "".join(f"{t:.1f},{k},{v:.0f}\n" for t, k, v in trace))
    text = "".join(output)
    m = re.search(r"held-out accuracy \(greedy.*?\): ([\d.]+)% before, ([\d.]+)% after", text)
    before, after = (float(m.group(1)) / 100, float(m.group(2)) / 100) if m else (float("nan"), float("nan"))
    print(f"\npeak proportional set size (PSS) by kind of process, sampled every second; limit {limit // MB} MB:")
    print("| process | peak PSS MB |\n|---|---|")
    for k, v in sorted(peaks.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v / MB:.0f} |")
    print(f"| all together (highest sum at one sample) | {top['sum'] / MB:.0f} |")
    print(f"| the cgroup's peak (with page cache) | {peak / MB:.0f} |")
    print(
        f"memory_check limit_mb={limit // MB} exit={code} oom_kills={oom} cgroup_peak_mb={peak / MB:.0f} "
        f"pss_sum_peak_mb={top['sum'] / MB:.0f} before={before:.3f} after={after:.3f} "
        f"gain_points={(after - before) * 100:.1f}"
    )
    return 0 if code == 0 and oom == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
