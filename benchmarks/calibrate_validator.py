"""Choose the validator's thresholds from measured honest and dishonest distributions.

    python benchmarks/calibrate_validator.py --model tiny                    # the built-in tiny model (fp32)
    python benchmarks/calibrate_validator.py --model smollm2 --compute bf16  # SmolLM2-135M-Instruct in bf16

Generates honest rollouts at generation batch sizes 1 to 64 (the numerics of a decode step depend on the batch,
on the KV cache and on the thread count; the validator's are one prefill), made on ``--producer-threads``
threads and judged on the others (a producer and its validator rarely share a machine), every other batch as
a newcomer's is judged (the first completion alone, then 16 to a prefill: another batch composition), and
dishonest ones: one decoder layer's weights with
relative noise, greedy decoding, and another sampling temperature. For the tiny model also the swarm's own
setting (``--versions``, ``--run-batches``): the run's task and sampling (node/configs/tiny.toml: one-digit
sums, 8 new tokens, so many completions of 2-3 tokens and one-step decode chunks), a whole batch in one
generation call, each batch judged as a newcomer's is (every completion; the first alone), on versions 0, 1, ...
of the weights, each trained from the last by a GRPO step of the run's settings on its own rollouts, as the
trainer does; and the perturbed layer on the last version. The validator measures every rollout with
no thresholds; then each threshold is set above the largest honest value by a margin (``--headroom`` times it,
plus a floor), and the table shows how many honest and dishonest rollouts the chosen thresholds reject.
The ``[verify]`` section printed (and written with ``--out``) is what every run of that model and compute dtype
takes when saved as node/configs/verify/<model>-<dtype>.toml (``tiny``/``smollm2``, ``float32``/``bfloat16``/
``float16``), or goes under a run config's ``[run.verify]``. Calibration
uses its own seeds: benchmarks/toploc_detect.py measures detection on rollouts never used here.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from intellect_kernels.grpo import group_advantages
from intellect_node.config import THRESHOLDS, RunConfig
from intellect_node.judging.validator import Finding, Validator
from intellect_node.policy.engine import Group, Packed, PolicyEngine, pack_sequences
from intellect_node.policy.model import load_weights
from intellect_node.roles.inference import generate_batch
from intellect_protocol.messages import RunSpec, VerifySpec

from harness.models import checkpoint_dtype, load, make_spec, perturb_layer

MEASURE = VerifySpec(
    max_exp_mismatches=10**9,
    max_mant_err_mean=math.inf,
    max_mant_err_median=math.inf,
    max_sampling_gap=math.inf,
    min_rederived=0.0,
    max_logprob_error=math.inf,
)
"""Thresholds that reject nothing: the validator only measures."""


def run_topk(model: str) -> int:
    """The ``verify.topk`` the model's runs use: the tiny run's (node/configs/tiny.toml), SmolLM2's configs' 128."""
    return RunConfig().verify.topk if model == "tiny" else 128


THREADS = {"producer": torch.get_num_threads(), "validator": torch.get_num_threads()}
"""Thread counts of generation and of validation (``--producer-threads``): reductions split differently."""


def rollouts(
    spec: RunSpec,
    producer: Any,
    tok: Any,
    validator: Validator,
    batches: int,
    max_rows: int | None,
    node: str,
    first_index: int = 0,
    version: int = 0,
    newcomer: bool | None = False,
    made: list[Any] | None = None,
    **sampling: Any,
) -> tuple[list[Finding], float, float]:
    """(findings, generation seconds, validation seconds) for ``batches`` batches. ``newcomer``: judged as a key
    on probation is (every completion, the first alone, then the rest 16 to a prefill), else exhaustively (16 to a
    prefill); None: every other batch each way. ``made`` collects the batches."""
    findings, gen_s, val_s = [], 0.0, 0.0
    for b in range(first_index, first_index + batches):
        torch.set_num_threads(THREADS["producer"])
        t = time.perf_counter()
        batch = generate_batch(spec, producer, tok, node, version, b, max_rows=max_rows, **sampling)
        gen_s += time.perf_counter() - t
        torch.set_num_threads(THREADS["validator"])
        t = time.perf_counter()
        as_newcomer = bool(b % 2) if newcomer is None else newcomer
        findings.append(validator.check(batch, full=True) if as_newcomer else validator.check(batch, exhaustive=True))
        val_s += time.perf_counter() - t
        if made is not None:
            made.append(batch)
    return findings, gen_s, val_s


def grpo_step(engine: PolicyEngine, batches: list[Any], pad: int) -> None:
    """One trainer step (the run's train settings) on the first ``train.batch_groups`` groups of ``batches`` (with
    ``train.online_filter``, of those whose rewards differ)."""
    t = engine.spec.train
    groups = [
        Group(b.node_id, b.version, g.prompt_ids, g.completions, g.logprobs, g.rewards)
        for b in batches
        for g in b.groups
        if len(set(g.rewards)) > 1 or not t.online_filter
    ][: t.batch_groups]
    if not groups:
        return
    ids, attn, mask, logp_old = pack_sequences(groups, pad)
    advantages = group_advantages(torch.tensor([g.rewards for g in groups])).flatten()
    engine.step(Packed(ids, attn, mask, logp_old, advantages), engine.spec.train.lr)


def swarm_setting(
    model: Any,
    tok: Any,
    verify: VerifySpec,
    versions: int,
    batches: int,
    dishonest_batches: int,
    noise: float,
    layer: int,
    node: str,
) -> list[tuple[str, dict[str, list[float]], float, float]]:
    """The tiny swarm's rollouts (see the module's docstring): table rows for versions 0..``versions``-1, honest,
    then the perturbed layer on the last version."""
    run = RunConfig()
    spec = RunSpec(
        run_id="c" * 32,
        created=0.0,
        seed=1_000_003,
        model=run.model,
        task=run.task,
        sampling=run.sampling,
        train=run.train,
        verify=verify,
    )
    engine = PolicyEngine(spec, copy.deepcopy(model).float())  # fp32 master weights, as the trainer's
    policy = copy.deepcopy(model)  # producer and validator: each version in turn
    validator = Validator(spec, tok, policy)
    rows = []
    made: list[Any] = []
    for version in range(versions):
        if version:
            grpo_step(engine, made, int(tok.pad_token_id))
        load_weights(policy, engine.export_state())
        made = []
        f, g, v = rollouts(spec, policy, tok, validator, batches, None, node, version=version, newcomer=True, made=made)
        rows.append((f"honest, run's setting, version {version}", stats(f), g, v))
    bad = perturb_layer(policy, noise, layer, weights=checkpoint_dtype("tiny"))
    f, g, v = rollouts(
        spec, bad, tok, validator, dishonest_batches, None, node, first_index=7000, version=versions - 1, newcomer=True
    )
    rows.append((f"layer {layer} x (1 + {noise:g} N(0,1)), run's v{versions - 1}", stats(f), g, v))
    return rows


def stats(findings: list[Finding]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"exp": [], "mean": [], "median": [], "rederived": [], "gap": [], "lp": []}
    for f in findings:
        out["exp"] += [float(x) for x in f.exp_mismatches]
        out["mean"] += f.mant_err_mean
        out["median"] += f.mant_err_median
        out["rederived"] += f.rederived
        out["gap"] += f.max_gap
        out["lp"] += f.logprob_err
    return out


def rejects(s: dict[str, list[float]], v: VerifySpec) -> int:
    n = 0
    rows = zip(s["exp"], s["mean"], s["median"], s["rederived"], s["gap"], s["lp"], strict=True)
    for e, mean, med, red, gap, lp in rows:
        toploc_bad = e > v.max_exp_mismatches or mean > v.max_mant_err_mean or med > v.max_mant_err_median
        sampling_bad = red < v.min_rederived or gap > v.max_sampling_gap
        n += toploc_bad or sampling_bad or lp > v.max_logprob_error
    return n


def choose(honest: dict[str, list[float]], headroom: float, topk: int) -> VerifySpec:
    """Each threshold above the largest honest value: ``headroom`` times it, and at least a floor."""
    return VerifySpec(
        topk=topk,
        max_exp_mismatches=int(math.ceil(max(max(honest["exp"]) * headroom, max(honest["exp"]) + 2))),
        max_mant_err_mean=round(max(max(honest["mean"]) * headroom, max(honest["mean"]) + 0.25), 3),
        max_mant_err_median=float(max(math.ceil(max(honest["median"]) * headroom), max(honest["median"]) + 1)),
        max_sampling_gap=round(max(max(honest["gap"]) * headroom, 0.05), 4),
        min_rederived=round(max(0.0, min(honest["rederived"]) - 0.1), 3),
        max_logprob_error=round(max(max(honest["lp"]) * headroom, 0.01), 4),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--batches", type=int, default=2, help="batches (4 tasks x 8 samples) per configuration")
    p.add_argument("--rel-noise", type=float, default=0.01, help="relative weight noise of the perturbed layer")
    p.add_argument("--layer", type=int, help="which decoder layer to perturb (default: the middle one)")
    p.add_argument(
        "--compute",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="compute in fp32 on the bf16 weights (default), in bf16, or in fp16",
    )
    p.add_argument("--headroom", type=float, default=1.5)
    p.add_argument("--topk", type=int, help="values per proof (default: the run's, tiny.toml's or SmolLM2's 128)")
    p.add_argument(
        "--versions",
        type=int,
        default=7,
        help="tiny: weight versions in the swarm's setting (0 and one GRPO step after another)",
    )
    p.add_argument("--run-batches", type=int, default=4, help="tiny: batches per version in the swarm's setting")
    p.add_argument("--out", type=Path, help="write the [verify] section here")
    p.add_argument(
        "--producer-threads",
        type=int,
        default=1,
        help="threads the producer generates on (the validator uses the rest of the machine's)",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    THREADS["producer"] = args.producer_threads
    model, tok = load(args.model, args.compute)
    if args.layer is None:
        args.layer = len(model.model.layers) // 2
    measure = MEASURE.model_copy(update={"topk": args.topk or run_topk(args.model)})
    spec = make_spec(args.model, measure, seed=1_000_003)
    validator = Validator(spec, tok, model)
    node = "d" * 32
    rows: list[tuple[str, dict[str, list[float]], float, float]] = []
    honest: dict[str, list[float]] = {}
    wide = make_spec(args.model, measure, seed=1_000_003, tasks_per_batch=8)  # 64 rows: one call of 64
    wide_validator = Validator(wide, tok, model)
    for max_rows in (1, 8, 32, 64):
        batches = max(1, args.batches // 2) if max_rows == 1 else args.batches
        s_, v_ = (wide, wide_validator) if max_rows == 64 else (spec, validator)
        first = 100 * max_rows
        findings, g, v = rollouts(s_, model, tok, v_, batches, max_rows, node, first_index=first, newcomer=None)
        s = stats(findings)
        rows.append((f"honest, batch size {max_rows}", s, g, v))
        for k, vals in s.items():
            honest.setdefault(k, []).extend(vals)
    dishonest = [
        (
            f"layer {args.layer} x (1 + {args.rel_noise:g} N(0,1))",
            perturb_layer(model, args.rel_noise, args.layer, weights=checkpoint_dtype(args.model)),
            {},
        ),
        ("greedy decoding", model, {"greedy": True}),
        ("temperature 0.7", model, {"draw_temperature": 0.7}),
    ]
    for name, producer, sampling in dishonest:
        findings, g, v = rollouts(spec, producer, tok, validator, args.batches, 32, node, first_index=7000, **sampling)
        rows.append((name, stats(findings), g, v))
    if args.model == "tiny" and args.versions > 0:
        for row in swarm_setting(
            model, tok, measure, args.versions, args.run_batches, args.batches, args.rel_noise, args.layer, node
        ):
            rows.append(row)
            if row[0].startswith("honest"):
                for k, vals in row[1].items():
                    honest.setdefault(k, []).extend(vals)
    chosen = choose(honest, args.headroom, measure.topk)
    print(
        f"calibration on {args.model} ({args.compute} compute, producer on {THREADS['producer']} thread(s), "
        f"validator on {THREADS['validator']}): {len(honest['exp'])} honest rollouts; "
        f"thresholds {chosen.model_dump()}"
    )
    print(
        f"{'rollouts':38} {'n':>4} {'exp max':>8} {'mean max':>9} {'med max':>8} {'rederived min':>14} "
        f"{'gap max':>8} {'logp err':>9} {'rejected':>9}  gen s  val s"
    )
    for name, s, g, v in rows:
        print(
            f"{name:38} {len(s['exp']):4d} {max(s['exp']):8.0f} {max(s['mean']):9.3f} {max(s['median']):8.1f} "
            f"{min(s['rederived']):14.3f} {max(s['gap']):8.3f} {max(s['lp']):9.4f} "
            f"{rejects(s, chosen):5d}/{len(s['exp']):<4d} {g:6.1f} {v:6.1f}"
        )
    section = "[verify]\n" + "".join(f"{k} = {v}\n" for k, v in chosen.model_dump().items() if k in THRESHOLDS)
    print(section, end="")
    if args.out:
        args.out.write_text(
            f"# from benchmarks/calibrate_validator.py --model {args.model} --compute {args.compute} "
            f"--batches {args.batches}: {len(honest['exp'])} honest rollouts at generation batch sizes 1 to 64\n"
            f"{section}"
        )
    honest_rejected = sum(rejects(s, chosen) for name, s, _, _ in rows if name.startswith("honest"))
    dishonest_n = sum(len(s["exp"]) for name, s, _, _ in rows if not name.startswith("honest"))
    caught = sum(rejects(s, chosen) for name, s, _, _ in rows if not name.startswith("honest"))
    print(
        f"calibrate model={args.model} honest_rejected={honest_rejected}/{len(honest['exp'])} "
        f"dishonest_rejected={caught}/{dishonest_n}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
