"""A real Prometheus server scrapes a running swarm (run by hand; not part of CI).

Starts a trainer and an inference node on loopback (the tiny run), and Debian's Prometheus with a scrape config
naming both nodes' /metrics (every 2 s). Then it asks Prometheus, over its HTTP API, for every target's health,
the trainer's steps (``node_trainer_steps_total``), the median step time from the step-time histogram, and the
inference node's generation rate. Prints what it got and one summary line:
    prometheus targets_up=2/2 trainer_steps=... step_seconds_p50=... tokens_per_s_p50=...

Needs ``apt-get install prometheus``.

    python scripts/prometheus_check.py [--seconds 40]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from intellect_node.launch import NodeProcess, join_argv  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(base: str, promql: str) -> list[dict]:  # type: ignore[type-arg]
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as resp:
        data = json.load(resp)
    assert data["status"] == "success", data
    return list(data["data"]["result"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0, help="how long Prometheus scrapes before the queries")
    args = ap.parse_args()
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("needs Prometheus: apt-get install prometheus")
    work = Path(tempfile.mkdtemp(prefix="prometheus-check-"))
    nodes: list[NodeProcess] = []
    prom = None
    try:
        trainer = NodeProcess(
            "trainer", ["bootstrap", "--data-dir", str(work / "t"), "--max-steps", "1000"], work / "logs"
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        worker = NodeProcess("inference", join_argv("inference", ready, work / "i"), work / "logs")
        nodes.append(worker)
        worker_ready = worker.wait_ready(timeout=120)
        targets = {
            name: r["status_url"].removeprefix("http://")
            for name, r in (("trainer", ready), ("inference", worker_ready))
        }
        config = work / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 2s\nscrape_configs:\n"
            + "".join(
                f"  - job_name: {name}\n    static_configs:\n      - targets: ['{target}']\n"
                for name, target in targets.items()
            )
        )
        port = free_port()
        prom = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={work / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=open(work / "prometheus.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        time.sleep(args.seconds)
        with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=10) as resp:
            active = json.load(resp)["data"]["activeTargets"]
        up = sum(1 for t in active if t["health"] == "up")
        for t in active:
            print(f"target {t['labels']['job']:<10} {t['scrapeUrl']:<40} {t['health']} {t.get('lastError', '')}")
        steps = query(base, 'node_trainer_steps_total{job="trainer"}')
        p50 = query(base, "histogram_quantile(0.5, sum by (le) (rate(node_trainer_step_seconds_bucket[1m])))")
        tps = query(base, "histogram_quantile(0.5, sum by (le) (rate(node_generation_tokens_per_second_bucket[1m])))")
        value = lambda r: float(r[0]["value"][1]) if r else float("nan")  # noqa: E731
        print(f"node_trainer_steps_total = {value(steps):g}")
        print(f"median step time (histogram) = {value(p50):.3f} s; median generation rate = {value(tps):.0f} tokens/s")
        print(
            f"prometheus targets_up={up}/{len(active)} trainer_steps={value(steps):g} "
            f"step_seconds_p50={value(p50):.3f} tokens_per_s_p50={value(tps):.0f}"
        )
        if up != len(active) or not value(steps) > 0:
            raise SystemExit(1)
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
