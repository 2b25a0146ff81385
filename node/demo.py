"""``intellect-node demo``: a whole swarm on this machine, over loopback, and a summary of what it did.

Starts one trainer (``bootstrap``) and N inference nodes (``join``) as separate OS processes, exactly as
volunteers would run them, follows the trainer's steps, then prints steps trained, rollouts received and
accepted per node, mean reward per step, and the weight versions each inference node loaded.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from intellect_node.config import RunConfig
from intellect_node.launch import NodeExited, NodeProcess


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


def summarize(run: RunConfig, trainer: dict[str, Any], workers: list[dict[str, Any]], seconds: float) -> str:
    group = run.sampling.group_size
    lines = [
        "",
        f"intellect-node demo: {trainer['step']} training steps in {seconds:.0f}s "
        f"(run {trainer['run_id'][:12]}…, async_level {run.train.async_level})",
        "",
        f"{'node':<22}{'role':<11}{'batches sent':>13}{'received':>10}{'accepted':>10}{'rollouts ok':>12}"
        "  versions loaded",
    ]
    received = trainer.get("received_batches_by_node", {})
    accepted_groups = trainer.get("accepted_groups_by_node", {})
    for w in workers:
        nid = w["node_id"]
        versions = w["versions_loaded"]
        shown = (
            ",".join(map(str, versions)) if len(versions) <= 12 else f"{versions[0]}..{versions[-1]} ({len(versions)})"
        )
        lines.append(
            f"{nid[:20]:<22}{'inference':<11}{w['batches_sent']:>13}{received.get(nid, 0):>10}"
            f"{w['batches_accepted']:>10}{accepted_groups.get(nid, 0) * group:>12}  {shown}"
        )
    lines.append(f"{trainer['node_id'][:20]:<22}{'trainer':<11}{'':>13}{sum(received.values()):>10}")
    rejected = trainer.get("rejected_batches_by_reason", {})
    lines.append(f"rejected batches: {json.dumps(rejected) if rejected else 'none'}")
    failed = trainer.get("validation_failures_by_reason", {})
    lines.append(
        f"validation (TOPLOC proofs, seeded sampling, task, reward): {trainer.get('verdicts_ok', 0)} batches passed, "
        f"failed: {json.dumps(failed) if failed else 'none'}; banned nodes: {len(trainer.get('banned', {}))}"
    )
    lines += ["", "mean reward per training step, ten a row (the row's mean exact-answer accuracy in brackets):"]
    hist = trainer["history"]
    for start in range(0, len(hist), 10):
        row = hist[start : start + 10]
        rewards = " ".join(f"{h['reward_mean']:.2f}" for h in row)
        accuracy = sum(h["accuracy"] for h in row) / len(row)
        lines.append(f"  {row[0]['step']:>4}-{row[-1]['step']:<4} {rewards:<49} [{accuracy:.2f}]")
    if hist:
        k = max(1, len(hist) // 5)
        first = sum(h["reward_mean"] for h in hist[:k]) / k
        last = sum(h["reward_mean"] for h in hist[-k:]) / k
        lines += ["", f"mean reward, first {k} steps: {first:.3f}  last {k} steps: {last:.3f}"]
    return "\n".join(lines)


def run_demo(args: argparse.Namespace, run: RunConfig) -> int:
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix="intellect-demo-"))
    logs = workdir / "logs"
    config_args = (["--config", str(args.config)] if args.config else []) + [
        a for item in args.overrides for a in ("--set", item)
    ]
    started = time.monotonic()
    nodes: list[NodeProcess] = []

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds to the `finally` below, which stops every node

    signal.signal(signal.SIGTERM, _terminate)
    print(f"demo: starting a trainer and {args.inference_nodes} inference nodes; logs in {logs}", flush=True)
    try:
        trainer = NodeProcess(
            "trainer",
            [
                "bootstrap",
                "--data-dir",
                str(workdir / "trainer"),
                "--fresh",
                "--max-steps",
                str(args.steps),
                *config_args,
            ],
            logs,
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=180)
        print(f"demo: trainer up, run {ready['run_id']}\n  {ready['join']}", flush=True)
        for i in range(args.inference_nodes):
            nodes.append(
                NodeProcess(
                    f"inference-{i}",
                    [
                        "join", "--role", "inference", "--peers", ready["p2p_maddrs"][0],
                        "--run-id", ready["run_id"], "--data-dir", str(workdir / f"inference-{i}"),
                    ],
                    logs,
                )
            )  # fmt: skip
        workers = [n.wait_ready(timeout=180) for n in nodes[1:]]
        print(f"demo: {len(workers)} inference nodes joined; training {args.steps} steps", flush=True)
        deadline = started + args.timeout
        step = 0
        while step < args.steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {step} of {args.steps} steps within --timeout {args.timeout:.0f}s")
            line = trainer.wait_for_line("STEP ", timeout=max(1.0, deadline - time.monotonic()))
            step = int(line.split()[1])
            print(f"  step {step}/{args.steps} {line.split(maxsplit=2)[2]}", flush=True)
        trainer_status = _get_json(ready["status_url"] + "/status")
        worker_status = [_get_json(w["status_url"] + "/status") for w in workers]
        print(summarize(run, trainer_status, worker_status, time.monotonic() - started), flush=True)
        return 0
    except (NodeExited, TimeoutError) as e:
        print(f"demo failed: {e}", flush=True)
        return 1
    except KeyboardInterrupt:
        print("demo interrupted", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan the nodes
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for n in nodes:
            n.terminate()
        for n in reversed(nodes):
            n.stop()
