"""Gossip benchmark: rollouts announced, pushed, acknowledged, judged by validators and trained, over lossy links
and NAT.

Topology (Linux network namespaces, all made here and removed on exit, also on failure): one bridge; the trainer
and two validator hosts on it; ``--producers`` inference hosts, all but ``--natted`` of them on the bridge, the
others each behind its own home router (a gateway namespace with ``ip_forward`` and an iptables MASQUERADE rule,
no port forward: nothing on the bridge can dial them). Every producer's link has ``--loss`` % packet loss each way
(iptables ``statistic`` DROP rules on its veth, in and out) and ``--delay-ms`` of delay each way on each of its TCP
connections (benchmarks/harness/delay_proxy.py, a transparent proxy that iptables REDIRECT rules send its connections
through: this kernel has no netem qdisc). Every host uses the same fixed libp2p port,
and an iptables rule in each host counts the bytes it sends on libp2p connections (pushes, gossip, batch fetches,
the DHT): that is "bytes on the wire", set against the batches' own size (what a direct push alone would send).

The run: the default (tiny) run config, the trainer started with both validators trusted; after ``--minutes`` the
producers stop, the trainer finishes judging what it holds, and the figures are read from every node's /status
and the trainer's ledger (LEDGER lines: every acknowledged batch must end trained, refused for a reason, or still
held: the rest is lost).

Needs root, iproute2, tc and iptables (`apt-get install iptables`). Prints one table and one summary line:
    gossip producers=8 natted=2 acked=... lost_after_ack=0 p99_ms=... natted_accepted=... natted_parents=0

    python benchmarks/gossip.py [--producers 8] [--natted 2] [--minutes 4] [--loss 10] [--delay-ms 50]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from intellect_node.launch import NodeProcess, join_argv
from intellect_node.p2p.keys import load_or_create

from harness.netns import available, run

HERE = Path(__file__).resolve().parent

PREFIX = "igs"
P2P_PORT, HTTP_PORT, PROXY_PORT, MARK = 4001, 8001, 15001, 1
LEDGER = re.compile(r"LEDGER (\w+) (\d+) ([0-9a-f]{32}) (\d+) (\d+) (\d+) (\d+)")


class Net:
    """Hosts on one bridge (10.79.0.0/24), some behind their own NAT gateway (10.80.<k>.0/24 inside)."""

    def __init__(self, public: list[str], natted: list[str], lossy: set[str], loss: float) -> None:
        self.made: list[str] = []
        self.ip: dict[str, str] = {}
        self.ns: dict[str, str] = {}
        self.ext: dict[str, str] = {}
        """Each host's interface to the outside (its veth)."""
        try:
            br = self._add("br")
            run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", br, "link", "set", "br0", "up")
            n = 0
            for name in public:
                n += 1
                ns = self.ns[name] = self._add(name)
                inner, outer = self._link(ns, br, n, f"10.79.0.{n}/24")
                run("ip", "-n", br, "link", "set", outer, "master", "br0", "up")
                self.ip[name], self.ext[name] = f"10.79.0.{n}", inner
            for k, name in enumerate(natted):
                n += 1
                gw = self._add(f"gw{k}")
                inner, outer = self._link(gw, br, n, f"10.79.0.{100 + k}/24")  # the router's public side
                run("ip", "-n", br, "link", "set", outer, "master", "br0", "up")
                ns = self.ns[name] = self._add(name)
                host_if, gw_if = f"{PREFIX}n{k}", f"{PREFIX}g{k}"
                run("ip", "link", "add", host_if, "type", "veth", "peer", "name", gw_if)
                run("ip", "link", "set", host_if, "netns", ns)
                run("ip", "link", "set", gw_if, "netns", gw)
                run("ip", "-n", gw, "addr", "add", f"10.80.{k}.1/24", "dev", gw_if)
                run("ip", "-n", gw, "link", "set", gw_if, "up")
                run("ip", "-n", ns, "addr", "add", f"10.80.{k}.2/24", "dev", host_if)
                run("ip", "-n", ns, "link", "set", host_if, "up")
                run("ip", "-n", ns, "link", "set", "lo", "up")
                run("ip", "-n", ns, "route", "add", "default", "via", f"10.80.{k}.1")
                run("ip", "netns", "exec", gw, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
                run(
                    "ip",
                    "netns",
                    "exec",
                    gw,
                    "iptables",
                    "-t",
                    "nat",
                    "-A",
                    "POSTROUTING",
                    "-s",
                    f"10.80.{k}.0/24",
                    "-o",
                    inner,
                    "-j",
                    "MASQUERADE",
                )
                self.ip[name], self.ext[name] = f"10.80.{k}.2", host_if
            for name, ns in self.ns.items():
                ipt = ["ip", "netns", "exec", ns, "iptables"]
                ext = self.ext[name]
                for flag in ("--sport", "--dport"):  # count what each host sends on libp2p connections
                    run(*ipt, "-A", "OUTPUT", "-o", ext, "-p", "tcp", flag, str(P2P_PORT))
                if name in lossy:  # the kernel here has no netem: loss by iptables, delay by a proxy
                    for chain, side in (("INPUT", "-i"), ("OUTPUT", "-o")):
                        run(
                            *ipt,
                            "-A",
                            chain,
                            side,
                            ext,
                            "-m",
                            "statistic",
                            "--mode",
                            "random",
                            "--probability",
                            f"{loss / 100:g}",
                            "-j",
                            "DROP",
                        )
                    run(
                        *ipt,
                        "-t",
                        "nat",
                        "-A",
                        "OUTPUT",
                        "-o",
                        ext,
                        "-p",
                        "tcp",
                        "-m",
                        "mark",
                        "!",
                        "--mark",
                        str(MARK),
                        "-j",
                        "REDIRECT",
                        "--to-ports",
                        str(PROXY_PORT),
                    )
                    run(
                        *ipt,
                        "-t",
                        "nat",
                        "-A",
                        "PREROUTING",
                        "-i",
                        ext,
                        "-p",
                        "tcp",
                        "-j",
                        "REDIRECT",
                        "--to-ports",
                        str(PROXY_PORT),
                    )
        except BaseException:
            self.close()
            raise

    def _add(self, name: str) -> str:
        ns = f"{PREFIX}{name}"
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a leftover of a killed run
        run("ip", "netns", "add", ns)
        self.made.append(ns)
        return ns

    def _link(self, ns: str, br: str, n: int, cidr: str) -> tuple[str, str]:
        inner, outer = f"{PREFIX}v{n}", f"{PREFIX}b{n}"
        run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        run("ip", "link", "set", inner, "netns", ns)
        run("ip", "link", "set", outer, "netns", br)
        run("ip", "-n", ns, "addr", "add", cidr, "dev", inner)
        run("ip", "-n", ns, "link", "set", inner, "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        return inner, outer

    def p2p_bytes(self) -> dict[str, int]:
        """Bytes each host sent on libp2p connections so far."""
        sent = {}
        for name, ns in self.ns.items():
            out = subprocess.run(
                ["ip", "netns", "exec", ns, "iptables", "-L", "OUTPUT", "-v", "-x", "-n"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            sent[name] = sum(int(line.split()[1]) for line in out.splitlines() if f"pt:{P2P_PORT}" in line)
        return sent

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name]]

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


def status(net: Net, name: str, url: str) -> dict[str, Any]:
    code = (
        f"import sys,urllib.request;sys.stdout.write(urllib.request.urlopen('{url}/status',timeout=20).read().decode())"
    )
    out = subprocess.run([*net.prefix(name), sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"could not read {name}'s status: {out.stderr[-300:]}")
    return dict(json.loads(out.stdout))


def counters(net: Net, name: str, url: str) -> dict[str, float]:
    """A node's /metrics, each counter summed over its labels."""
    code = (
        "import sys,urllib.request;"
        f"sys.stdout.write(urllib.request.urlopen('{url}/metrics',timeout=20).read().decode())"
    )
    out = subprocess.run([*net.prefix(name), sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    sums: dict[str, float] = defaultdict(float)
    for line in out.stdout.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            sums[key.split("{", 1)[0]] += float(value)
    return sums


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--natted", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--loss", type=float, default=10.0)
    ap.add_argument("--delay-ms", type=float, default=50.0)
    ap.add_argument("--keep", type=Path, help="keep logs here")
    args = ap.parse_args()
    if not available() or shutil.which("iptables") is None:
        raise SystemExit("needs root, iproute2, tc and iptables (apt-get install iptables)")
    producers = [f"p{i}" for i in range(args.producers)]
    natted = producers[args.producers - args.natted :]
    work = args.keep or Path(tempfile.mkdtemp(prefix="gossip-bench-"))
    logs = work / "logs"
    nodes: dict[str, NodeProcess] = {}
    ready: dict[str, dict[str, Any]] = {}
    net = Net(["t", "v0", "v1", *producers[: len(producers) - len(natted)]], natted, set(producers), args.loss)
    try:
        for name in producers:  # every TCP connection of a producer, in and out, gains the delay each way
            nodes[f"proxy-{name}"] = proxy = NodeProcess(
                f"proxy-{name}",
                ["--port", str(PROXY_PORT), "--delay-ms", f"{args.delay_ms:g}", "--mark", str(MARK)],
                logs,
                command=[sys.executable, str(HERE / "harness" / "delay_proxy.py")],
                prefix=net.prefix(name),
            )
            proxy.wait_ready(timeout=60)
        ports = ["--p2p-port", str(P2P_PORT), "--http-port", str(HTTP_PORT)]
        vids = [load_or_create(work / v / "node.key").node_id for v in ("v0", "v1")]
        boot = [
            "bootstrap",
            "--host",
            net.ip["t"],
            *ports,
            "--data-dir",
            str(work / "t"),
            *[a for v in vids for a in ("--validator", v)],
        ]
        nodes["t"] = NodeProcess("trainer", boot, logs, prefix=net.prefix("t"), env={"INTELLECT_NODE_LEDGER_LOG": "1"})
        ready["t"] = t = nodes["t"].wait_ready(timeout=180)
        for name in ("v0", "v1", *producers):
            role = "validator" if name.startswith("v") else "inference"
            argv = join_argv(role, t, work / name, "--host", net.ip[name], *ports, "--join-timeout", "300")
            nodes[name] = NodeProcess(name, argv, logs, prefix=net.prefix(name))
        for name in ("v0", "v1", *producers):
            ready[name] = nodes[name].wait_ready(timeout=600)
        bytes0, t0 = net.p2p_bytes(), time.monotonic()
        time.sleep(args.minutes * 60)
        end = {name: status(net, name, ready[name]["status_url"]) for name in producers}
        count = {name: counters(net, name, ready[name]["status_url"]) for name in producers}
        for name in producers:  # settle: no new batches; the trainer judges what it holds
            nodes[name].terminate()
        for name in producers:
            nodes[name].proc.wait(timeout=60)
        bytes1, seconds = net.p2p_bytes(), time.monotonic() - t0
        by_host = {name: bytes1[name] - bytes0[name] for name in bytes1}
        wire = sum(by_host.values())
        deadline = time.monotonic() + 180
        while (st := status(net, "t", t["status_url"]))["judging"] and time.monotonic() < deadline:
            time.sleep(2)
        others = {name: status(net, name, ready[name]["status_url"]) for name in ("v0", "v1")}
        count.update({name: counters(net, name, ready[name]["status_url"]) for name in ("t", "v0", "v1")})
        total = {
            k: sum(c.get(k, 0.0) for c in count.values())
            for k in ("node_gossip_received_bytes_total", "node_batches_served_bytes_total", "node_dht_stores_total")
        }
        acked: dict[tuple[str, ...], int] = {}
        accounted: dict[tuple[str, ...], int] = defaultdict(int)
        trained: set[tuple[str, ...]] = set()
        for m in LEDGER.finditer(nodes["t"].log_path.read_text(errors="replace")):
            event, epoch, node, version, index, groups, _ = m.groups()
            key = (epoch, node, version, index)
            if event == "acked":
                acked[key] = int(groups)
            else:
                accounted[key] += int(groups)
                if event == "trained":
                    trained.add(key)
        lost = sum(max(0, n - accounted.get(k, 0)) for k, n in acked.items()) - int(st["outstanding_groups"])
        latencies = [ms for name in producers for ms in end[name]["delivery_ms"]]
        natted_ids = {ready[name]["node_id"] for name in natted}
        parents = [s["relay"]["parent"] for s in [*end.values(), *others.values()]]
        natted_parents = sum(1 for p in parents if p in natted_ids)
        made = sum(end[n]["batches_made"] for n in producers)
        batch_bytes = sum(end[n]["batch_bytes"] for n in producers) / max(1, made)
        dup = st["duplicates"]
        rows = [
            ("producers (behind NAT)", f"{len(producers)} ({len(natted)})"),
            ("links", f"{args.loss:g}% loss, {args.delay_ms:g} ms each way on every producer"),
            ("seconds measured", f"{seconds:.0f}"),
            ("batches produced", made),
            ("announcements (incl. repeats)", sum(end[n]["batches_announced"] for n in producers)),
            ("acknowledged (trainer ledger)", len(acked)),
            ("trained", len(trained)),
            ("trainer steps", st["step"]),
            ("delivery p50 / p99 ms (made -> acked)", f"{pct(latencies, 0.5):.0f} / {pct(latencies, 0.99):.0f}"),
            ("duplicates received (announcements, bodies)", f"{dup['announcement']}, {dup['body']}"),
            ("verdicts from validators / judged by trainer", f"{st['verdicts_remote']} / {st['verdicts_self']}"),
            ("p2p bytes on the wire per acked batch", f"{wire / max(1, len(acked)) / 1e3:.1f} kB"),
            ("batch size (a direct push's bytes)", f"{batch_bytes / 1e3:.1f} kB"),
            (
                "p2p MB sent: trainer / validators / producers",
                f"{by_host['t'] / 1e6:.1f} / "
                f"{(by_host['v0'] + by_host['v1']) / 1e6:.1f} / {sum(by_host[n] for n in producers) / 1e6:.1f}",
            ),
            ("gossip messages handled per node per second", f"{st['gossip_received'] / seconds:.1f} (trainer)"),
            (
                "per acked batch, app level: push / fetched by digest / gossip delivered",
                f"{batch_bytes / 1e3:.1f} / "
                f"{total['node_batches_served_bytes_total'] / max(1, len(acked)) / 1e3:.1f} / "
                f"{total['node_gossip_received_bytes_total'] / max(1, len(acked)) / 1e3:.1f} kB",
            ),
            ("DHT record stores by all nodes, whole run", int(total["node_dht_stores_total"])),
            ("acknowledged groups lost", lost),
            ("NATed producers' batches accepted", sum(end[n]["batches_accepted"] for n in natted)),
            (
                "NATed reachability (p2p, http)",
                [(end[n]["reachability"].get("p2p"), end[n]["reachability"].get("http")) for n in natted],
            ),
            ("nodes whose weight parent is NATed", natted_parents),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
        natted_accepted = sum(end[n]["batches_accepted"] for n in natted)
        print(
            f"gossip producers={len(producers)} natted={len(natted)} acked={len(acked)} lost_after_ack={lost} "
            f"p99_ms={pct(latencies, 0.99):.0f} natted_accepted={natted_accepted} natted_parents={natted_parents}"
        )
    finally:
        for node in reversed(list(nodes.values())):  # the proxies last: they carry the producers' connections
            node.terminate()
        for node in reversed(list(nodes.values())):
            node.stop()
        net.close()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
