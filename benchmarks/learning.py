"""Learning: SmolLM2-135M-Instruct on a task through the real swarm, on this CPU.

The task and settings come from a run config: ``--config node/configs/smollm2-addition.toml`` (the default:
two-digit addition), ``smollm2-sum3.toml`` (reasoning-gym's basic_arithmetic: sums of three numbers up to 10) or
``smollm2-chainsum.toml`` (reasoning-gym's chain_sum, three terms of + and -). All take 8 prompts x 8
samples per step, up to 24 new tokens, lr 1e-5 (sum3: 2e-5), fp32 master weights with bf16 autocast where bf16 is
native (fp32 elsewhere: policy.model.bf16_is_fast); addition samples at temperature 1.0, the others at 0.7. The
runs have the same task, settings and wall-clock budget:

- ``colocated``: the yardstick. One process generates, scores and updates in turn (both cores, no proofs, no
  validation, no networking; it samples from a bf16 copy of the weights where bf16 is native, else fp32).
- ``async2``: the swarm. A trainer (``bootstrap``) and an inference node (``join``), one torch thread each (3
  threads on 2 cores made each step 3x slower, measured), as processes on loopback: signed checkpoints through
  the relay, TOPLOC proofs and seeded sampling on every rollout (fp32 compute), every batch checked by the
  trainer before it trains (a quarter of each batch's completions against the model, all of them for task,
  reward and termination), async level 2.
- ``sync``: the same swarm with async level 0 (each step waits for rollouts of the newest version).
- ``validators``: ``async2`` with two validator processes (``join --role validator``, trusted with ``--validator``):
  the trainer names one of them to judge each batch it admits (two for a tenth of them), they judge in parallel
  off the trainer's path and gossip signed verdicts; the trainer judges a batch itself only when none came in
  time. On this 2-core machine the validators share the cores with the trainer and the inference node.
- ``vllm``: ``async2`` with its inference node on vLLM (``--set inference.backend=vllm``; run this script with the
  Python of an environment that has vLLM, see docs/inference.md), validated by the same
  transformers trainer.

The clock of a swarm run starts when its trainer process is launched (start-up included); the colocated run's
when its loop starts. Every ``--eval-every`` minutes the policy of that moment is kept (a hard link of the
newest published version; the colocated loop saves its weights) and, after all runs (so evaluation does not
compete with training), each is scored on the same 200 held-out problems (never assigned for training), greedy,
with the run's own answer extraction and reward (a problem counts when its reward is 1); with ``--eval-samples N``
the last policy of each run is also scored by N samples per problem at the run's temperature (the share that earns
reward 1: what GRPO raises, which the greedy score misses while the likeliest answer stays the same). The PNG plots
mean training reward and held-out accuracy against wall-clock minutes.

Each run is a child process of its own (memory is returned between runs) and leaves ``<out>/<run>/result.json``;
a later invocation with the same ``--out`` reuses finished runs (``--fresh`` redoes them) and evaluates all.

After the accuracy table, the colocated loop's time per step split into generating, scoring and training, and each
swarm trainer's into waiting for rollouts, judging batches itself, training and publishing, with its producer's
seconds per generated batch (means over the run's steps).

Usage: python benchmarks/learning.py [--config TOML] [--minutes 20] [--eval-every 5] [--eval-samples 4]
       [--runs colocated,async2,sync,validators,vllm] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from intellect_kernels.grpo import group_advantages
from intellect_node.config import load_run_config
from intellect_node.demo import Curve, plot
from intellect_node.judging.evaluate import accuracy, load_folder, newest_version
from intellect_node.judging.tasks import task_source
from intellect_node.judging.validator import task_reward
from intellect_node.launch import NodeProcess, join_argv
from intellect_node.p2p.keys import load_or_create
from intellect_node.policy.engine import Group, Packed, PolicyEngine, pack_sequences
from intellect_node.policy.generate import sample_groups
from intellect_node.policy.model import bf16_is_fast, build_model, build_tokenizer, encode_prompt, load_weights
from intellect_protocol.messages import RunSpec
from intellect_protocol.tasks import sampling_seed

CONFIG = Path(__file__).resolve().parent.parent / "node" / "configs" / "smollm2-addition.toml"
"""The default run config (two-digit addition)."""
SPLIT = {"waiting": "idle_s", "judging": "validate_s", "training": "seconds", "publishing": "publish_s"}
"""The trainer's time per step (history fields): waiting for rollouts, judging batches itself (on its own thread,
while it waits or trains), the step itself, and writing and announcing the previous version (also overlapped)."""
COLOCATED_SPLIT = ("generating", "scoring", "training")
"""The colocated loop's time per step (both cores): sampling the batch (the weights copied to the sampler
included), rewards, and the GRPO step (packing included)."""
COLOCATED_NODE = "0" * 32


def task_label(spec: RunSpec) -> str:
    """The task's name in the summary line: ``addition-2digit``, ``chain_sum`` (a reasoning-gym dataset), ..."""
    t = spec.task
    if t.family == "addition":
        return f"addition-{t.digits}digit"
    if t.family == "reasoning_gym":
        return t.source
    return t.family


def save_weights(engine: PolicyEngine, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(engine.export_state(), str(folder / "model.safetensors"))


def colocated(
    spec: RunSpec, seconds: float, every: float, out: Path, threads: int
) -> tuple[Curve, list[Any], dict[str, float]]:
    """generate -> score -> update in one process; snapshots of the weights at each ``every`` mark, and the
    seconds per step each part took (``COLOCATED_SPLIT``)."""
    torch.set_num_threads(threads)
    tok = build_tokenizer(spec.model)
    engine = PolicyEngine(spec, build_model(spec.model, tok, torch.float32))
    # a bf16 copy to sample from, where bf16 is native (elsewhere fp32: bf16 is a reference loop there)
    sampler = build_model(spec.model, tok, torch.bfloat16 if bf16_is_fast("cpu") else torch.float32)
    source = task_source(spec.task)
    eos, pad = int(tok.eos_token_id), int(tok.pad_token_id)
    s, t = spec.sampling, spec.train
    curve = Curve("colocated")
    snapshots: list[tuple[float, Path]] = []
    save_weights(engine, out / "colocated" / "t0000")
    snapshots.append((0.0, out / "colocated" / "t0000"))
    started = time.monotonic()
    next_mark, step, last_done = every, 0, 0.0
    spent = dict.fromkeys(COLOCATED_SPLIT, 0.0)
    while True:
        began = time.monotonic()
        load_weights(sampler, engine.export_state())
        tasks = [source.assigned(spec.seed, COLOCATED_NODE, step, 0, slot) for slot in range(t.batch_groups)]
        prompts = [encode_prompt(tok, task.prompt) for task in tasks]
        seeds = [
            sampling_seed(spec.seed, COLOCATED_NODE, step, 0, g, j)
            for g in range(len(tasks))
            for j in range(s.group_size)
        ]
        groups = sample_groups(sampler, prompts, s.group_size, s.max_new_tokens, s.temperature, eos, pad, seeds)
        generated = time.monotonic()
        batch = [
            Group(
                COLOCATED_NODE,
                step,
                p,
                [c.tokens for c in g],
                [c.logprobs for c in g],
                [task_reward(tok, task, c.tokens, c.terminated, spec.task) for c in g],
            )
            for p, g, task in zip(prompts, groups, tasks, strict=True)
        ]
        rewards = torch.tensor([g.rewards for g in batch])
        scored = time.monotonic()
        ids, attn, mask, logp_old = pack_sequences(batch, pad)
        engine.step(Packed(ids, attn, mask, logp_old, group_advantages(rewards).flatten()), t.lr)
        now = time.monotonic() - started
        if now > seconds:  # this step ended after the budget: the run's result is the step before it
            break
        took = (generated - began, scored - generated, now + started - scored)
        for part, seconds_spent in zip(COLOCATED_SPLIT, took, strict=True):
            spent[part] += seconds_spent
        step += 1
        last_done = now
        curve.rewards.append((now, float(rewards.mean())))
        print(f"  colocated step {step} t={now:.0f}s reward={float(rewards.mean()):.3f}", flush=True)
        if now >= next_mark:
            folder = out / "colocated" / f"t{int(next_mark):04d}"
            save_weights(engine, folder)
            snapshots.append((next_mark, folder))
            next_mark += every
    if not snapshots or snapshots[-1][0] < seconds:
        folder = out / "colocated" / "final"
        save_weights(engine, folder)  # the weights after the last step that ended within the budget
        snapshots.append((seconds, folder))
    print(f"  colocated: {step} steps, last at {last_done:.0f}s", flush=True)
    return curve, snapshots, {k: v / max(1, step) for k, v in spent.items()}


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/status", timeout=30) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


def _counters(url: str, name: str) -> dict[str, float]:
    """A labelled counter of a node, by label value, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    out: dict[str, float] = {}
    for line in lines:
        if line.startswith(name + "{"):
            label = line.split('"', 2)[1]
            out[label] = out.get(label, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _counter(url: str, name: str) -> float:
    """An unlabelled counter of a node, from its /metrics (0.0 where it is absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " ")), 0.0)


def _keep(weights_root: Path, dest: Path) -> Path | None:
    """Hard-link the newest published version (the trainer prunes old ones; the links survive)."""
    if not weights_root.exists():
        return None
    newest = newest_version(weights_root)
    if newest is None:
        return None
    try:
        shutil.copytree(newest, dest, copy_function=os.link)
    except (FileNotFoundError, shutil.Error):  # pruned while being linked: take the next one
        shutil.rmtree(dest, ignore_errors=True)
        return _keep(weights_root, dest)
    return dest


def swarm(
    config: Path,
    label: str,
    async_level: int,
    seconds: float,
    every: float,
    out: Path,
    node_args: tuple[str, ...] = (),
    validators: int = 0,
) -> tuple[Curve, list[Any], dict]:
    root = out / label
    logs = root / "logs"
    nodes: list[NodeProcess] = []
    launched_wall = time.time()
    started = time.monotonic()
    vids = [load_or_create(root / f"validator-{i}" / "node.key").node_id for i in range(validators)]
    try:
        trainer = NodeProcess(
            f"{label}-trainer",
            [
                "bootstrap",
                "--config",
                str(config),
                "--data-dir",
                str(root / "trainer"),
                "--fresh",
                "--threads",
                "1",
                "--checkpoint-every",
                "0",
                "--set",
                f"train.async_level={async_level}",
                *[a for v in vids for a in ("--validator", v)],
            ],
            logs,
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=600)
        for i in range(validators):
            nodes.append(
                NodeProcess(
                    f"{label}-validator-{i}",
                    join_argv("validator", ready, root / f"validator-{i}", "--threads", "1"),
                    logs,
                )
            )
        for node in nodes[1:]:
            node.wait_ready(timeout=600)
        worker = NodeProcess(
            f"{label}-inference",
            [
                "join",
                "--role",
                "inference",
                "--peers",
                ready["p2p_maddrs"][0],
                "--run-id",
                ready["run_id"],
                "--data-dir",
                str(root / "inference"),
                "--threads",
                "1",
                *node_args,
            ],
            logs,
        )
        nodes.append(worker)
        worker_ready = worker.wait_ready(timeout=600)
        weights_root = root / "trainer" / "weights" / ready["run_id"]
        snapshots: list[tuple[float, Path]] = []
        marks = [m * every for m in range(1, int(seconds // every) + 1)]
        if not marks or marks[-1] < seconds:
            marks.append(seconds)
        for mark in marks:
            time.sleep(max(0.0, mark - (time.monotonic() - started)))
            kept = _keep(weights_root, root / "snapshots" / f"t{int(mark):04d}")
            if kept is not None:
                snapshots.append((mark, kept))
            status = _status(ready["status_url"])
            print(f"  {label} t={mark:.0f}s step={status['step']}", flush=True)
        status = _status(ready["status_url"])
        worker_status = _status(worker_ready["status_url"])
        worker_status["deferred"] = _counters(worker_ready["status_url"], "node_inference_batches_deferred_total")
        generated = _counter(worker_ready["status_url"], "node_generation_batches_total")
        worker_status["generation_s"] = _counter(worker_ready["status_url"], "node_generation_seconds_total") / max(
            1.0, generated
        )
    finally:
        for node in reversed(nodes):
            node.stop()
    curve = Curve(label)
    for h in status["history"]:
        if h.get("time", 0) - launched_wall <= seconds:
            curve.rewards.append((h["time"] - launched_wall, h["reward_mean"]))
    info = {"steps": status["step"], "worker": worker_status, "trainer": status}
    return curve, snapshots, info


def run_one(config: Path, name: str, spec: RunSpec, seconds: float, every: float, out: Path, threads: int) -> None:
    """One run, in this (child) process; its curve and kept policies go to ``<out>/<name>/result.json``."""
    if name == "colocated":
        curve, kept, split = colocated(spec, seconds, every, out, threads)
        steps = len(curve.rewards)
        producer: dict[str, Any] = {}
    else:
        level = {"async2": 2, "sync": 0, "vllm": 2, "validators": 2}[name]
        extra = ("--set", "inference.backend=vllm") if name == "vllm" else ()
        curve, kept, info = swarm(config, name, level, seconds, every, out, extra, 2 if name == "validators" else 0)
        steps = info["steps"]
        history = info["trainer"]["history"]
        split = {k: sum(h.get(f, 0.0) for h in history) / max(1, len(history)) for k, f in SPLIT.items()}
        split["verdicts_remote"] = info["trainer"].get("verdicts_remote", 0)
        split["verdicts_self"] = info["trainer"].get("verdicts_self", 0)
        worker = info["worker"]
        producer = {
            "sent": worker.get("batches_sent", 0),
            "accepted": worker.get("batches_accepted", 0),
            "refused": worker.get("rejections", {}),
            "deferred": worker.get("deferred", {}),
            "generation_s": worker.get("generation_s", 0.0),
        }
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / "result.json").write_text(
        json.dumps(
            {
                "rewards": curve.rewards,
                "kept": [(m, str(p)) for m, p in kept],
                "steps": steps,
                "split": split,
                "producer": producer,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the run config (task and settings)")
    parser.add_argument("--fresh", action="store_true", help="redo runs that already have a result.json in --out")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--eval-every", type=float, default=5.0, help="minutes between kept policies")
    parser.add_argument(
        "--runs", default="colocated,async2,sync", help="any of colocated, async2, sync, validators, vllm"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the colocated loop and evaluation")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="also score each kept policy by N samples per held-out problem at the run's temperature (the same seeds "
        "for every policy): the share that earns reward 1, what GRPO raises even where the greedy answer stays",
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="intellect-learning-"))
    out.mkdir(parents=True, exist_ok=True)
    config = args.config.resolve()
    run = load_run_config(config)
    spec = run.spec("f" * 32)
    task = task_label(spec)
    seconds, every = args.minutes * 60, args.eval_every * 60
    if args.run_one:
        run_one(config, args.run_one, spec, seconds, every, out, args.threads)
        return
    runs = args.runs.split(",")
    print(f"learning: {task}, {runs}, {args.minutes:g} min each, results in {out}", flush=True)

    kept: dict[str, list[tuple[float, Path]]] = {}
    curves: dict[str, Curve] = {}
    infos: dict[str, dict[str, Any]] = {}
    for name in runs:
        result = out / name / "result.json"
        if result.exists() and not args.fresh:
            print(f"run {name}: reusing {result}", flush=True)
        else:
            print(f"run {name}", flush=True)
            argv = [
                sys.executable,
                __file__,
                "--run-one",
                name,
                "--config",
                str(config),
                "--out",
                str(out),
                "--minutes",
                str(args.minutes),
                "--eval-every",
                str(args.eval_every),
                "--threads",
                str(args.threads),
            ]
            subprocess.run(argv, check=True)
        data = json.loads(result.read_text())
        curves[name] = Curve(name, rewards=[tuple(r) for r in data["rewards"]])
        kept[name] = [(m, Path(p)) for m, p in data["kept"]]
        infos[name] = {"steps": data["steps"], "split": data.get("split", {}), "producer": data.get("producer", {})}

    # evaluation, after every run, on the same held-out problems
    torch.set_num_threads(args.threads)
    tok = build_tokenizer(spec.model)
    model = build_model(spec.model, tok)
    held_out = task_source(spec.task).held_out_tasks()[: args.eval_problems]
    started = time.monotonic()
    before = accuracy(spec, model, tok, held_out)
    k = args.eval_samples
    sampled_before = accuracy(spec, model, tok, held_out, samples=k) if k else float("nan")
    print(
        f"held-out accuracy before training: {before:.3f} ({len(held_out)} problems, "
        f"{time.monotonic() - started:.0f}s)" + (f"; sampled ({k} each) {sampled_before:.3f}" if k else ""),
        flush=True,
    )
    sampled: dict[str, float] = {}
    for name in runs:
        curves[name].accuracy.append((0.0, before))
        for mark, folder in kept[name]:
            if mark == 0.0:
                continue
            load_folder(model, folder)
            acc = accuracy(spec, model, tok, held_out)
            curves[name].accuracy.append((mark, acc))
            print(f"  {name} t={mark / 60:.1f}min accuracy={acc:.3f}", flush=True)
        if k and any(mark for mark, _ in kept[name]):  # the last kept policy, sampled
            sampled[name] = accuracy(spec, model, tok, held_out, samples=k)
            print(f"  {name} last policy, sampled ({k} each): {sampled[name]:.3f}", flush=True)
    png = plot(
        list(curves.values()),
        out / "learning.png",
        f"SmolLM2-135M-Instruct, {task}, {args.minutes:g} min per run (2-core CPU)",
    )
    (out / "learning.json").write_text(
        json.dumps(
            {n: {"rewards": c.rewards, "accuracy": c.accuracy, "steps": infos[n]["steps"]} for n, c in curves.items()}
        )
    )

    def final(name: str) -> float:
        return curves[name].accuracy[-1][1] if name in curves else float("nan")

    print()
    print(
        f"{'run':<11}{'steps':>7}{'reward first 5':>16}{'reward last 5':>15}{'acc before':>12}"
        + "".join(f"{f'@{m / 60:g}min':>9}" for m, _ in kept[runs[0]] if m)
        + f"{'gain':>8}"
    )
    for name in runs:
        c = curves[name]
        first = sum(r for _, r in c.rewards[:5]) / max(1, len(c.rewards[:5]))
        last = sum(r for _, r in c.rewards[-5:]) / max(1, len(c.rewards[-5:]))
        accs = "".join(f"{a:>9.3f}" for m, a in c.accuracy if m)
        print(
            f"{name:<11}{infos[name]['steps']:>7}{first:>16.3f}{last:>15.3f}{before:>12.3f}{accs}"
            f"{final(name) - before:>+8.3f}"
        )
    if "colocated" in runs and infos["colocated"].get("split"):
        sp = infos["colocated"]["split"]
        print()
        print("colocated, s/step (both cores): " + ", ".join(f"{k} {sp[k]:.2f}" for k in COLOCATED_SPLIT))
    swarms = [n for n in runs if n != "colocated" and infos[n].get("split")]
    if swarms:
        print()
        print(f"{'trainer, s/step':<16}" + "".join(f"{k:>10}" for k in SPLIT) + f"{'judged by validators / here':>30}")
        for name in swarms:
            sp = infos[name]["split"]
            print(
                f"{name:<16}"
                + "".join(f"{sp[k]:>10.2f}" for k in SPLIT)
                + f"{sp['verdicts_remote']:>22} / {sp['verdicts_self']}"
            )
    for name in swarms:
        pr = infos[name].get("producer") or {}
        if pr:
            refused = ", ".join(f"{k} {v}" for k, v in sorted(pr["refused"].items())) or "none"
            deferred = ", ".join(f"{k} {v:g}" for k, v in sorted(pr["deferred"].items())) or "none"
            print(
                f"{name} producer: {pr['accepted']} batches accepted of {pr['sent']} decided; refused: {refused}; "
                f"deferred (sent again later): {deferred}"
                + (f"; {pr['generation_s']:.2f} s generating a batch (one core)" if pr.get("generation_s") else "")
            )
    print(f"plot: {png}")
    print(
        f"learning model=smollm2-135m task={task} acc_before={before:.3f} acc_after={final('async2'):.3f} "
        f"colocated_acc_after={final('colocated'):.3f} async2_acc_after={final('async2'):.3f} "
        f"sync_acc_after={final('sync'):.3f} vllm_acc_after={final('vllm'):.3f} "
        f"validators_acc_after={final('validators'):.3f} minutes={args.minutes:g}"
        + (
            f" sampled_acc_before={sampled_before:.3f} colocated_sampled_acc_after="
            f"{sampled.get('colocated', float('nan')):.3f} async2_sampled_acc_after="
            f"{sampled.get('async2', float('nan')):.3f}"
            if k
            else ""
        )
    )


if __name__ == "__main__":
    main()
