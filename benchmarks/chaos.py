"""Faults on a real swarm: churn, a trainer killed again and again, a relay killed mid-transfer, a partition, full
disks and a clock 60 s off; each against a fault-free control run of the same length and shape.

    python benchmarks/chaos.py [--window 150] [--churn-minutes 10] [--scenarios a,b,c,d,e,f] [--write-doc PATH]

Every node is a separate `intellect-node` process (tiny model, loopback or network namespaces this script makes
and removes). Scenarios, as issue 13 asks:

- (a) churn: every minute, half of 4 inference nodes are killed with SIGKILL and started again (same data dir);
- (b) the trainer killed with SIGKILL at 5 random moments (mid-step, mid-publish, mid-reply: wherever it is) and
  restarted with the same command;
- (c) a relay killed mid-transfer (its upload shaped to 8 Mbit/s, so a version takes a while) while 8 nodes
  fetch through it, and started again 10 s later;
- (d) a partition: the host holding a relay and two inference nodes is cut off from the trainer's host (its
  link down, in network namespaces) for 60 s, then heals;
- (e) the trainer's and a relay's disks (small tmpfs mounts) filled to the last byte for 60 s, then freed;
- (f) an inference node and a relay whose clocks are 60 s ahead (libfaketime) try to join: hivemind's DHT refuses
  peers more than 3 s off, so they must refuse to start with advice, and the swarm must not notice.

Measured for each: training steps in the window as a share of the control's, the longest time without a step,
accepted rollouts lost (a batch the trainer acknowledged whose groups were neither trained nor reported stale,
filtered, invalid or banned: from the trainer's ``LEDGER`` log lines across its lives, less what it still holds at
the end), versions reused (one version number of one epoch seen with two digests, at the trainer or at any node),
processes that exited without being killed, and the growth of the trainer's memory. A table, then one line:

    chaos scenarios=6 steps_ratio_min=0.xx max_stall_s=... lost_accepted=0 versions_reused=0 crashes=0

The controls: (a) and (c)/(d) each have their own; (b), (e) and (f) share one run of the same shape and length
(the loopback swarm of (a), without faults, for one window).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from intellect_node.launch import NodeProcess
from intellect_node.weights.files import MANIFEST_NAME, verify_manifest

from harness import netns
from harness.docs import write_doc

SETTINGS = ["--set", "train.online_filter=false", "--set", "train.async_level=4"]
"""No online filter: the tiny run's rate stays stationary (see benchmarks/adversary.py); async level 4: a
restarted node's batches are still fresh when they arrive."""
WARMUP_STEPS = 3


def fault_start(window: float) -> float:
    """When (d) and (e) begin their fault: 30 s into the window (sooner in a short one)."""
    return min(30.0, 0.2 * window)


def fault_end(window: float) -> float:
    """When they end it: 60 s later (sooner in a short window)."""
    return fault_start(window) + min(60.0, 0.6 * window)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Result:
    scenario: str
    steps: int = 0
    control_steps: int = 0
    max_stall_s: float = 0.0
    control_stall_s: float = 0.0
    """The control's longest time without a step: what one step can take in this swarm's shape, faults aside."""
    lost: int = 0
    reused: int = 0
    crashes: list[str] = field(default_factory=list)
    memory_growth_mb: float = 0.0
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.steps / max(self.control_steps, 1)


class Swarm:
    """The processes of one run, with what was done to them (so an exit we did not cause counts as a crash)."""

    def __init__(self, root: Path, host: str = "127.0.0.1", ns_of: dict[str, list[str]] | None = None) -> None:
        self.root = root
        self.logs = root / "logs"
        self.host = host
        self.procs: dict[str, NodeProcess] = {}
        self.argv: dict[str, list[str]] = {}
        self.prefix: dict[str, list[str]] = {}
        self.lives: dict[str, list[NodeProcess]] = defaultdict(list)
        self.killed: set[int] = set()
        self.trainer_ready: dict[str, Any] = {}
        self.ns_of = ns_of or {}
        self.digests: dict[tuple[int, int], str] = {}
        self.reused: set[tuple[int, int]] = set()
        self.trainer_dir = root / "trainer"
        self.http_port = _free_port()

    def start(self, name: str, argv: list[str], prefix: list[str] | None = None, wait: bool = True) -> dict[str, Any]:
        self.argv[name], self.prefix[name] = argv, prefix or []
        node = NodeProcess(f"{name}-{len(self.lives[name])}", argv, self.logs, prefix=prefix, env=LEDGER_ON)
        self.procs[name] = node
        self.lives[name].append(node)
        return node.wait_ready(timeout=180) if wait else {}

    def start_trainer(
        self, data_dir: Path | None = None, prefix: list[str] | None = None, extra: list[str] | None = None
    ) -> dict[str, Any]:
        self.trainer_dir = data_dir or self.trainer_dir
        argv = [
            "bootstrap",
            "--data-dir",
            str(self.trainer_dir),
            "--host",
            self.host,
            "--http-port",
            str(self.http_port),
            *SETTINGS,
            *(extra or []),
        ]
        self.trainer_ready = self.start("trainer", argv, prefix)
        return self.trainer_ready

    def join(
        self,
        name: str,
        role: str,
        host: str | None = None,
        prefix: list[str] | None = None,
        extra: list[str] | None = None,
        data_dir: Path | None = None,
    ) -> dict[str, Any]:
        t = self.trainer_ready
        argv = [
            "join",
            "--role",
            role,
            "--peers",
            t["p2p_maddrs"][0],
            "--run-id",
            t["run_id"],
            "--host",
            host or self.host,
            "--data-dir",
            str(data_dir or self.root / name),
            *(extra or []),
        ]
        return self.start(name, argv, prefix)

    def kill(self, name: str) -> None:
        """SIGKILL to the node's process alone (what the OOM killer or a power cut does to one process)."""
        proc = self.procs[name].proc
        self.killed.add(proc.pid)
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def restart(self, name: str, wait: bool = True) -> dict[str, Any]:
        ready = self.start(name, self.argv[name], self.prefix[name], wait=wait)
        if name == "trainer" and ready:
            self.trainer_ready = ready
        return ready

    def status(self, name: str = "trainer") -> dict[str, Any] | None:
        node = self.procs[name]
        url = (node.ready or {}).get("status_url") or self.trainer_ready.get("status_url")
        if url is None or node.proc.poll() is not None:
            return None
        ns = self.ns_of.get(name)
        try:
            if ns:
                out = subprocess.run(
                    [
                        *ns,
                        sys.executable,
                        "-c",
                        "import sys,urllib.request;"
                        f"sys.stdout.write(urllib.request.urlopen('{url}/status',timeout=10).read().decode())",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                return dict(json.loads(out.stdout)) if out.returncode == 0 else None
            with urllib.request.urlopen(url + "/status", timeout=10) as resp:
                return dict(json.load(resp))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def step(self) -> int:
        s = self.status()
        return int(s["step"]) if s else -1

    def wait_steps(self, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the swarm did not reach step {n} in {timeout:.0f}s; logs: {self.logs}")
            time.sleep(1)

    def check_versions(self, roots: list[Path] | None = None) -> None:
        """Record every (epoch, version) -> digest seen in the trainer's and the nodes' weight folders."""
        run_id = self.trainer_ready["run_id"]
        folders = [self.trainer_dir / "weights" / run_id, *(roots or [])]
        for root in folders:
            if not root.exists():
                continue
            for manifest_path in root.glob(f"*/{MANIFEST_NAME}"):
                try:
                    m = verify_manifest(manifest_path.read_bytes(), run_id)
                except Exception:  # a folder being renamed or pruned right now: next time
                    continue
                key = (m.epoch, m.version)
                known = self.digests.setdefault(key, m.checkpoint_sha256)
                if known != m.checkpoint_sha256:
                    self.reused.add(key)

    def node_roots(self) -> list[Path]:
        run_id = self.trainer_ready["run_id"]
        return [p for p in self.root.glob(f"*/weights/{run_id}") if not str(p).startswith(str(self.trainer_dir))]

    def rss_mb(self, name: str = "trainer") -> float:
        try:
            proc = psutil.Process(self.procs[name].proc.pid)
            return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20
        except psutil.Error:
            return 0.0

    def crashed(self) -> list[str]:
        return [
            n.name
            for lives in self.lives.values()
            for n in lives
            if n.proc.poll() is not None and n.proc.pid not in self.killed
        ]

    def close(self) -> None:
        for lives in self.lives.values():
            for node in lives:
                node.stop(timeout=15)


# ---- measuring -----------------------------------------------------------------------------------------


def steps_in(history: list[dict[str, Any]], t0: float, t1: float) -> tuple[int, float]:
    """Steps trained in [t0, t1] (wall clock) and the longest time in it without one."""
    times = sorted(h["time"] for h in history if t0 <= h["time"] <= t1)
    edges = [t0, *times, t1]
    return len(times), max(b - a for a, b in zip(edges, edges[1:], strict=False))


LEDGER_ON = {"INTELLECT_NODE_LEDGER_LOG": "1"}
"""The trainer's LEDGER lines are what the accounting adds up (off by default: node/cli.py LEDGER_LOG_ENV)."""
_LEDGER = re.compile(r"LEDGER (\w+) (\d+) ([0-9a-f]{32}) (\d+) (\d+) (\d+) (\d+)")
_RESUMED = re.compile(r"resuming run [0-9a-f]+ from its checkpoint at step (\d+)")


def lost_accepted(trainer_logs: list[Path], outstanding: int) -> tuple[int, str]:
    """Groups the trainer acknowledged that no life of it trained (in a step that survived) or reported
    otherwise, less those it still holds at the end."""
    acked: dict[tuple[str, ...], int] = {}
    accounted: dict[tuple[str, ...], int] = defaultdict(int)
    lives = []
    for path in trainer_logs:
        text = path.read_text(errors="replace")
        resumed = _RESUMED.search(text)
        lives.append((text, int(resumed.group(1)) if resumed else 0))
    for i, (text, _) in enumerate(lives):
        kept_below = lives[i + 1][1] if i + 1 < len(lives) else None  # the next life redoes steps from there
        for m in _LEDGER.finditer(text):
            event, epoch, node, version, index, groups, step = m.groups()
            key = (epoch, node, version, index)
            if event == "acked":
                acked[key] = max(acked.get(key, 0), int(groups))
            elif event == "trained" and kept_below is not None and int(step) >= kept_below:
                continue  # trained in a step the crash lost; the next life trains it again (or reports it)
            else:
                accounted[key] += int(groups)
    unaccounted = sum(max(0, n - accounted.get(k, 0)) for k, n in acked.items())
    detail = f"acked {sum(acked.values())} groups, {unaccounted} unaccounted, {outstanding} still held"
    return max(0, unaccounted - outstanding), detail


def settle(swarm: Swarm, producers: list[str]) -> int:
    """Stop the producers, let the trainer judge what it holds; returns the groups it still holds."""
    for name in producers:
        if swarm.procs[name].proc.poll() is None:
            swarm.procs[name].terminate()
    for name in producers:
        try:
            swarm.procs[name].proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 60
    status = swarm.status()
    while status is not None and status.get("pending_validation", 0) > 0 and time.monotonic() < deadline:
        time.sleep(1)
        status = swarm.status()
    time.sleep(1)
    for _ in range(5):  # a status read through `ip netns exec` can fail on a busy machine: ask again
        status = swarm.status()
        if status is not None:
            return int(status.get("outstanding_groups", 0))
        time.sleep(2)
    raise RuntimeError("could not read the trainer's status at the end: what it still holds is unknown")


def observe(swarm: Swarm, seconds: float, tick: float = 1.0, each: Any = None) -> None:
    """Let the swarm run ``seconds``, checking versions (and calling ``each(elapsed)``) every ``tick``."""
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        if each is not None:
            each(elapsed)
        swarm.check_versions(swarm.node_roots())
        time.sleep(tick)


def finish(swarm: Swarm, name: str, t0: float, t1: float, rss0: float, producers: list[str], note: str = "") -> Result:
    rss1 = swarm.rss_mb()
    history = (swarm.status() or {}).get("history", [])
    steps, stall = steps_in(history, t0, t1)
    crashes = swarm.crashed()  # before the producers are stopped on purpose
    outstanding = settle(swarm, producers)
    swarm.check_versions(swarm.node_roots())
    lost, detail = lost_accepted([n.log_path for n in swarm.lives["trainer"]], outstanding)
    return Result(
        name,
        steps=steps,
        max_stall_s=stall,
        lost=lost,
        reused=len(swarm.reused),
        crashes=crashes,
        memory_growth_mb=rss1 - rss0,
        note=f"{note}; {detail}".strip("; "),
    )


# ---- the scenarios ------------------------------------------------------------------------------------


def loopback_swarm(root: Path, inference: int = 4) -> Swarm:
    swarm = Swarm(root)
    swarm.start_trainer()
    swarm.join("relay", "relay")
    for i in range(inference):
        swarm.join(f"inf{i}", "inference")
    swarm.wait_steps(WARMUP_STEPS)
    return swarm


def run_plain(root: Path, seconds: float, name: str, faketime: list[str] | None = None) -> Result:
    swarm = loopback_swarm(root)
    try:
        t0, rss0 = time.time(), swarm.rss_mb()
        told = ""
        if faketime:  # a fifth inference node and a second relay join with clocks 60 s ahead
            for extra, role in (("skewed-inf", "inference"), ("skewed-relay", "relay")):
                try:
                    swarm.join(extra, role, prefix=faketime)
                    told += f"{extra} joined; "
                except Exception:
                    node = swarm.procs[extra]
                    swarm.killed.add(node.proc.pid)  # it refused to start, with advice: not a crash
                    said = [ln for ln in node.tail(5).splitlines() if "clock" in ln]
                    told += f"{extra} refused: {said[-1][:90] if said else node.tail(1)[:90]!r}; "
        observe(swarm, seconds - (time.time() - t0))
        t1 = time.time()
        result = finish(swarm, name, t0, t1, rss0, [f"inf{i}" for i in range(4)])
        result.note = f"{told}{result.note}"
        return result
    finally:
        swarm.close()


def churn(root: Path, seconds: float) -> Result:
    swarm = loopback_swarm(root)
    names = [f"inf{i}" for i in range(4)]
    rng = random.Random(13)
    kills = 0

    def each(elapsed: float) -> None:  # a round at +30 s, +90 s, ... while the window lasts
        nonlocal kills
        if elapsed >= 30 + 60 * (kills // 2) and 30 + 60 * (kills // 2) < seconds - 10:
            for name in rng.sample(names, 2):
                swarm.kill(name)
                swarm.restart(name, wait=False)
                kills += 1

    try:
        t0, rss0 = time.time(), swarm.rss_mb()
        observe(swarm, seconds, each=each)
        t1 = time.time()
        return finish(
            swarm,
            "(a) churn: half of 4 inference nodes SIGKILLed every minute",
            t0,
            t1,
            rss0,
            names,
            note=f"{kills} kills and restarts",
        )
    finally:
        swarm.close()


def trainer_kills(root: Path, seconds: float, kills: int = 5) -> Result:
    swarm = loopback_swarm(root)
    rng = random.Random(7)
    moments = sorted(rng.uniform(5, seconds - 15) for _ in range(kills))
    restarts: list[float] = []
    done = 0

    def each(elapsed: float) -> None:
        nonlocal done
        if done < len(moments) and elapsed >= moments[done]:
            swarm.kill("trainer")
            started = time.monotonic()
            swarm.restart("trainer")
            restarts.append(time.monotonic() - started)
            done += 1

    try:
        t0, rss0 = time.time(), swarm.rss_mb()
        observe(swarm, seconds, tick=0.25, each=each)
        t1 = time.time()
        return finish(
            swarm,
            f"(b) trainer SIGKILLed {kills}x at random moments",
            t0,
            t1,
            rss0,
            [f"inf{i}" for i in range(4)],
            note=f"restart to READY {max(restarts, default=0):.1f}s at most",
        )
    finally:
        swarm.close()


def relay_kill(root: Path, seconds: float, control: bool = False) -> Result:
    swarm = Swarm(root)
    swarm.start_trainer(extra=["--relay-slots", "1"])
    # the relay under test: the origin's only child (its one slot), its upload shaped
    swarm.join("relay", "relay", extra=["--upload-limit-mbps", "8", "--relay-slots", "8"])
    followers = [f"follower{i}" for i in range(8)]
    for name in followers:
        swarm.join(name, "relay", extra=["--relay-slots", "2"])
    for i in range(2):
        swarm.join(f"inf{i}", "inference")
    swarm.wait_steps(WARMUP_STEPS)
    killed_at: list[float] = []

    def each(elapsed: float) -> None:
        if control or killed_at or elapsed < seconds / 3:
            return
        s = swarm.status("relay")
        if s is not None and s["relay"]["fetching"] >= 0 or elapsed > seconds / 2:
            swarm.kill("relay")
            killed_at.append(elapsed)
            time.sleep(10)
            swarm.restart("relay")

    try:
        t0, rss0 = time.time(), swarm.rss_mb()
        observe(swarm, seconds, each=each)
        t1 = time.time()
        newest = swarm.step()
        behind = [n for n in followers if ((swarm.status(n) or {}).get("weight_version", -1)) < newest - 8]
        name = "(c) control" if control else "(c) relay SIGKILLed mid-transfer, 8 nodes fetching through it"
        note = f"{len(behind)} followers > 8 versions behind at the end"
        if killed_at:
            note = f"killed at +{killed_at[0]:.0f}s, restarted 10 s later; {note}"
        return finish(swarm, name, t0, t1, rss0, ["inf0", "inf1"], note=note)
    finally:
        swarm.close()


def partition(root: Path, seconds: float, control: bool = False) -> Result:
    prefix = f"ch{os.getpid() % 10000}"
    with netns.Topology(prefix, hosts=3, mbit=1000, net=78) as topo:
        h0, h1, h2 = topo.hosts
        swarm = Swarm(root, host=h0.ip)
        swarm.ns_of = {
            "trainer": h0.prefix,
            "relay": h1.prefix,
            "inf0": h1.prefix,
            "inf1": h1.prefix,
            "inf2": h2.prefix,
        }
        try:
            swarm.start_trainer(prefix=h0.prefix)
            swarm.join("relay", "relay", host=h1.ip, prefix=h1.prefix)
            swarm.join("inf0", "inference", host=h1.ip, prefix=h1.prefix)
            swarm.join("inf1", "inference", host=h1.ip, prefix=h1.prefix)
            swarm.join("inf2", "inference", host=h2.ip, prefix=h2.prefix)
            swarm.wait_steps(WARMUP_STEPS)
            cut: list[float] = []

            def each(elapsed: float) -> None:
                if control:
                    return
                if not cut and elapsed >= fault_start(seconds):
                    netns.run("ip", "-n", topo.bridge_ns, "link", "set", f"{prefix}b1", "down")
                    cut.append(elapsed)
                elif len(cut) == 1 and elapsed >= fault_end(seconds):
                    netns.run("ip", "-n", topo.bridge_ns, "link", "set", f"{prefix}b1", "up")
                    cut.append(elapsed)

            t0, rss0 = time.time(), swarm.rss_mb()
            observe(swarm, seconds, each=each)
            t1 = time.time()
            after = (swarm.status() or {}).get("accepted_groups_by_node", {})
            cut_off = [(swarm.procs[n].ready or {}).get("node_id", "") for n in ("inf0", "inf1")]
            name = "(d) control (netns)" if control else "(d) partition: a subtree cut off 60 s, then healed"
            note = "" if control else f"cut-off nodes' accepted groups at the end: {[after.get(n, 0) for n in cut_off]}"
            return finish(swarm, name, t0, t1, rss0, ["inf0", "inf1", "inf2"], note=note)
        finally:
            swarm.close()


def full_disks(root: Path, seconds: float, size_mb: int = 96) -> Result:
    mounts = [root / "trainer-disk", root / "relay-disk"]
    for m in mounts:
        m.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(m)], check=True)
    try:
        swarm = Swarm(root)
        try:
            swarm.start_trainer(data_dir=mounts[0] / "trainer")
            swarm.join("relay", "relay", data_dir=mounts[1] / "relay")
            for i in range(4):
                swarm.join(f"inf{i}", "inference")
            swarm.wait_steps(WARMUP_STEPS)
            fillers = [m / "filler" for m in mounts]
            filled: list[float] = []

            def fill(path: Path) -> None:
                used = subprocess.run(["du", "-sh", str(path.parent)], capture_output=True, text=True).stdout
                print(f"    filling {path.parent} (in use: {used.split()[0] if used else '?'})", file=sys.stderr)
                try:
                    f = open(path, "wb", buffering=0)  # unbuffered: nothing left to flush at close
                except OSError:
                    return  # full already
                with f:
                    try:
                        while True:
                            f.write(b"\0" * (1 << 20))
                    except OSError:
                        pass
                    try:  # the last bytes too
                        while True:
                            f.write(b"\0" * 4096)
                    except OSError:
                        pass

            def each(elapsed: float) -> None:
                if not filled and elapsed >= fault_start(seconds):
                    for f in fillers:
                        fill(f)
                    filled.append(elapsed)
                elif len(filled) == 1 and elapsed >= fault_end(seconds):
                    for f in fillers:
                        f.unlink(missing_ok=True)
                    filled.append(elapsed)

            t0, rss0 = time.time(), swarm.rss_mb()
            observe(swarm, seconds, each=each)
            t1 = time.time()
            return finish(
                swarm,
                "(e) the trainer's and a relay's disks full for 60 s",
                t0,
                t1,
                rss0,
                [f"inf{i}" for i in range(4)],
                note=f"tmpfs {size_mb} MB each",
            )
        finally:
            swarm.close()
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)


# ---- the report ---------------------------------------------------------------------------------------


def table(results: list[Result]) -> str:
    lines = [
        "| scenario | steps (control) | steps ratio | longest stall s (control) | lost accepted | "
        "versions reused | crashes | trainer memory growth MB | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        stall = f"{r.max_stall_s:.1f} ({r.control_stall_s:.1f})"
        lines.append(
            f"| {r.scenario} | {r.steps} ({r.control_steps}) | {r.ratio:.2f} | {stall} | "
            f"{r.lost} | {r.reused} | {len(r.crashes)}{' ' + ','.join(r.crashes) if r.crashes else ''} | "
            f"{r.memory_growth_mb:+.0f} | {r.note} |"
        )
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    return (
        f"chaos scenarios={len(results)} steps_ratio_min={min(r.ratio for r in results):.2f} "
        f"max_stall_s={max(r.max_stall_s for r in results):.1f} lost_accepted={sum(r.lost for r in results)} "
        f"versions_reused={sum(r.reused for r in results)} "
        f"crashes={sum(len(r.crashes) for r in results)}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=float, default=150.0, help="seconds of scenarios (b)-(f) and their controls")
    p.add_argument("--churn-minutes", type=float, default=10.0, help="length of scenario (a) and its control")
    p.add_argument("--scenarios", default="a,b,c,d,e,f")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--write-doc", type=Path, help="replace the chaos block of this file (docs/RELIABILITY.md)")
    args = p.parse_args()
    if os.geteuid() != 0 or not netns.available():
        raise SystemExit("chaos.py needs root (network namespaces for the partition, tmpfs mounts for full disks)")
    if shutil.which("faketime") is None:
        raise SystemExit("chaos.py needs libfaketime for the clock scenario: apt-get install faketime")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="intellect-chaos-"))
    chosen = set(args.scenarios.split(","))
    w, churn_s = args.window, args.churn_minutes * 60
    results: list[Result] = []

    def run(label: str, fn: Any, *a: Any) -> Result:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            r: Result = fn(root / label.replace(" ", "-"), *a)
        except Exception as e:  # the harness failed (a node never got ready, say): reported, the rest goes on
            import traceback

            traceback.print_exc()
            r = Result(label, crashes=[f"harness: {type(e).__name__}"], note=str(e).splitlines()[0][:200])
        print(
            f"  {label}: steps={r.steps} stall={r.max_stall_s:.1f}s lost={r.lost} reused={r.reused} "
            f"crashes={r.crashes} ({time.monotonic() - started:.0f}s) {r.note}",
            file=sys.stderr,
            flush=True,
        )
        return r

    if "a" in chosen:
        control = run("control-a", run_plain, churn_s, "control (a)")
        r = run("a", churn, churn_s)
        r.control_steps, r.control_stall_s = control.steps, control.max_stall_s
        results.append(r)
    if chosen & {"b", "e", "f"}:
        control = run("control-bef", run_plain, w, "control (b, e, f)")
        if "b" in chosen:
            r = run("b", trainer_kills, w)
            r.control_steps, r.control_stall_s = control.steps, control.max_stall_s
            results.append(r)
        if "e" in chosen:
            r = run("e", full_disks, w)
            r.control_steps, r.control_stall_s = control.steps, control.max_stall_s
            results.append(r)
        if "f" in chosen:
            r = run("f", run_plain, w, "(f) nodes with clocks 60 s ahead try to join", ["faketime", "-m", "-f", "+60s"])
            r.control_steps, r.control_stall_s = control.steps, control.max_stall_s
            results.append(r)
    if "c" in chosen:
        control = run("control-c", relay_kill, w, True)
        r = run("c", relay_kill, w)
        r.control_steps, r.control_stall_s = control.steps, control.max_stall_s
        results.append(r)
    if "d" in chosen:
        control = run("control-d", partition, w, True)
        r = run("d", partition, w)
        r.control_steps, r.control_stall_s = control.steps, control.max_stall_s
        results.append(r)
    results.sort(key=lambda r: r.scenario)
    text = table(results) + "\n\n" + summary(results)
    print(text)
    print(f"logs: {root}", file=sys.stderr)
    if args.write_doc:
        write_doc(args.write_doc, text, "chaos")
    ok = all(r.lost == 0 and r.reused == 0 and not r.crashes for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
