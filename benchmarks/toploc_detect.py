"""Detection power, per compute dtype: which cheats the validator catches and which it cannot tell from rounding.

    python benchmarks/toploc_detect.py [--model smollm2|tiny] [--compute fp32|bf16|fp16]
    .venv-vllm/bin/python benchmarks/toploc_detect.py --backend vllm    # rollouts from vLLM, same validator

Every batch goes through what the trainer applies: the header gate (version window, duplicates, order) and the
validator (assignment, termination, reward, TOPLOC proofs against one prefill, seeded sampling re-derived).
``--backend vllm`` makes every rollout, honest or not, with the vLLM backend (node/policy/vllm_backend.py; the
perturbed weights loaded into the same engine in place, the other model in an engine of its own, the plain
sampler and greedy decoding as vLLM's own sampler) and judges it with the transformers validator, as a trainer
judges a vLLM volunteer.
Honest rollouts are generated at batch sizes 1, 8 and 32 (``--honest-batches``; the false-rejection rate with
its 95% upper bound when none is refused); the attacks, each on ``--attack-batches`` batches of 32 rollouts:

- one decoder layer's weights perturbed by 10%, 3% and 1% relative noise;
- another model of the same shape (the same architecture, other weights), and a smaller one (2 layers);
- the weights quantized: int8 per output channel, fp8 (e4m3, per tensor), 4-bit in groups of 32;
- a fine-tune of a few steps (three GRPO steps of the run's learning rate: a real other version);
- one token in the middle of each completion edited after generation;
- sampler cheats: a plain sampler at temperature 0.7, greedy decoding, and the run's seeded draw truncated to the
  top 50 tokens or the top-p 0.9 nucleus (the same token wherever the honest one lies inside);
- the reported reward inflated; a weight version older than the run allows (async level 2); the same batch sent
  twice; a batch whose tasks were not assigned to the node that signs it.

Thresholds are those a run of the model and dtype takes (node/configs/verify/, from
benchmarks/calibrate_validator.py: other seeds, other rollouts), or ``--verify``'s. A rollout counts as detected
when the batch carrying it is refused or the validator rejects that rollout. Spot checks (``verify.check_fraction``
< 1) judge only a keyed share of a batch's rows: for each attack the share of rows the validator rejects on their
own, the probability that a batch of 32 is caught at ``--check-fraction``, and the expected batches before a ban.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from intellect_node.config import RunConfig, calibrated_verify
from intellect_node.judging.validator import Gate, Validator
from intellect_node.policy.backend import GenerationBackend
from intellect_node.policy.model import state_dict_for_export
from intellect_node.roles.inference import generate_batch
from intellect_protocol.envelope import Rejected
from intellect_protocol.messages import RolloutBatch, VerifySpec

from harness.models import checkpoint_dtype, load, make_spec, perturb_layer

ROOT = Path(__file__).resolve().parent.parent
STEP = 3
"""The trainer's current step: versions 1..3 are fresh at async level 2."""


DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def same_shape(model: Any, seed: int = 5) -> Any:
    """The same architecture and size with other weights (freshly initialized): another model of the same shape."""
    other = type(model)(model.config)
    torch.manual_seed(seed)
    other.init_weights()
    return other.to(model.dtype).eval()


def quantized(model: Any, how: str) -> Any:
    """A copy whose decoder layers' matrices went through ``how`` and back (what a worker serving a quantized
    checkpoint computes with): ``int8`` per output channel, ``fp8`` e4m3 per tensor, ``int4`` in groups of 32."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for layer in other.model.layers:
            for w in layer.parameters():
                if w.dim() != 2:
                    continue
                x = w.float()
                if how == "int8":
                    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
                    x = (x / scale).round().clamp(-127, 127) * scale
                elif how == "fp8":
                    scale = x.abs().max().clamp(min=1e-12) / 448
                    x = (x / scale).to(torch.float8_e4m3fn).float() * scale
                else:
                    groups = x.reshape(-1, 32)
                    scale = groups.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 7
                    x = ((groups / scale).round().clamp(-8, 7) * scale).reshape(x.shape)
                w.copy_(x.to(w.dtype))
    return other


def fine_tuned(model: Any, spec: Any, batches: list[RolloutBatch], pad: int, lr: float, steps: int = 3) -> Any:
    """``model`` after ``steps`` GRPO steps at ``lr`` on ``batches``' groups (fp32 master weights, as the trainer):
    the next versions of the run, claimed as this one."""
    from intellect_kernels.grpo import group_advantages
    from intellect_node.policy.engine import Group, Packed, PolicyEngine, pack_sequences

    engine = PolicyEngine(spec, copy.deepcopy(model).float())
    groups = [
        Group(b.node_id, b.version, g.prompt_ids, g.completions, g.logprobs, g.rewards)
        for b in batches
        for g in b.groups
    ]
    for step in range(steps):
        part = groups[step::steps] or groups
        ids, attn, mask, logp_old = pack_sequences(part, pad)
        rewards = torch.tensor([g.rewards for g in part])
        rewards = rewards + 1e-3 * torch.arange(rewards.shape[1])  # a gradient even where a group's rewards tie
        engine.step(Packed(ids, attn, mask, logp_old, group_advantages(rewards).flatten()), lr)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for w, new in zip(other.parameters(), engine.model.parameters(), strict=True):
            w.copy_(new.to(w.dtype))
    engine.close()
    return other


def caught_probability(n: int, bad: int, fraction: float) -> float:
    """P(a keyed choice of ceil(fraction * n) of ``n`` rows includes one of the ``bad`` ones)."""
    k = n if fraction >= 1.0 else max(1, math.ceil(fraction * n))
    return 1.0 - math.comb(n - bad, k) / math.comb(n, k) if bad else 0.0


def other_model(model: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(5)
    return LlamaForCausalLM(config).to(model.dtype).eval()


class Judge:
    """The trainer's checks, in order, on one batch; returns per-rollout reasons ("" = accepted)."""

    def __init__(self, validator: Validator, async_level: int) -> None:
        self.validator = validator
        self.gate = Gate(async_level)

    def __call__(self, batch: RolloutBatch) -> list[str]:
        n = sum(len(g.completions) for g in batch.groups)
        try:
            self.gate.check(batch, STEP)
        except Rejected as e:
            return [e.reason] * n
        self.gate.admit(batch)  # as the trainer: a batch past the gate is recorded, then validated
        finding = self.validator.check(batch, exhaustive=True)
        # the trainer trains on none of a failed batch; per rollout, say which check caught it
        return [r or ("batch_refused" if not finding.ok else "") for r in finding.row_reasons]


class Drawing(GenerationBackend):
    """A vLLM backend drawing with vLLM's own sampler (``draw_temperature``) or greedily: a dishonest worker. It
    reports its tokens' true log-probs at the run's temperature (from ``model``, as a careful cheater would), so
    only the sampling check can tell."""

    name = "vllm-dishonest"

    def __init__(self, backend: Any, model: Any, **draw: Any) -> None:
        self.backend, self.model, self.draw = backend, model, draw

    def load_weights(self, tensors: Any) -> None:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], row_seeds: list[int], request: Any) -> list[Any]:
        from intellect_kernels.logprobs import token_logprobs

        done = self.backend.generate(prompts, row_seeds, request, **self.draw)
        for prompt, c in zip(prompts, done, strict=True):
            if not c.tokens:
                continue
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([prompt + c.tokens])).logits[0, len(prompt) - 1 : -1]
            c.logprobs = token_logprobs(logits, torch.tensor(c.tokens), request.temperature).tolist()
        return done


def edit_middle(batch: RolloutBatch, vocab: int) -> RolloutBatch:
    groups = []
    for g in batch.groups:
        completions = []
        for c in g.completions:
            c = list(c)
            c[len(c) // 2] = (c[len(c) // 2] + 1) % vocab
            completions.append(c)
        groups.append(g.model_copy(update={"completions": completions}))
    return batch.model_copy(update={"groups": groups})


def inflate(batch: RolloutBatch) -> RolloutBatch:
    return batch.model_copy(
        update={"groups": [g.model_copy(update={"rewards": [r + 1.0 for r in g.rewards]}) for g in batch.groups]}
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument(
        "--verify", type=Path, help="TOML with a [verify] section (default: the run's, node/configs/verify/)"
    )
    p.add_argument(
        "--honest-batches",
        type=int,
        nargs=3,
        default=[2, 4, 10],
        metavar=("BS1", "BS8", "BS32"),
        help="batches of 32 rollouts generated at batch size 1, 8 and 32",
    )
    p.add_argument("--attack-batches", type=int, default=2, help="batches of 32 rollouts per attack")
    p.add_argument(
        "--compute", choices=list(DTYPE_NAMES), default="fp32", help="what producer and validator compute in"
    )
    p.add_argument(
        "--backend",
        choices=["transformers", "vllm"],
        default="transformers",
        help="what generates every rollout (the validator is always transformers)",
    )
    p.add_argument(
        "--layer",
        type=int,
        default=None,
        help="the decoder layer the perturbation attack changes (default: the middle one)",
    )
    p.add_argument("--check-fraction", type=float, default=0.25, help="the spot-check share the power column assumes")
    args = p.parse_args()
    base = RunConfig().verify if args.model == "tiny" else VerifySpec(topk=128)
    if args.verify:
        source, given = args.verify.name, tomllib.loads(args.verify.read_text())["verify"]
    else:
        kind = "tiny-llama" if args.model == "tiny" else "hf"
        source = f"node/configs/verify/{args.model}-{DTYPE_NAMES[args.compute]}.toml"
        given = calibrated_verify(kind, args.model, DTYPE_NAMES[args.compute]) or {}
        if not given and args.compute != "fp32":
            raise SystemExit(f"no {source}: calibrate first (benchmarks/calibrate_validator.py)")
        source = source if given else "the built-in defaults"
    verify = VerifySpec(**{**base.model_dump(), **given})
    model, tok = load(args.model, args.compute)
    spec = make_spec(args.model, verify, seed=20_261_130)
    vocab = int(model.config.vocab_size)
    validator = Validator(spec, tok, model)
    producer: Any = model
    if args.backend == "vllm":
        from intellect_node.policy.vllm_backend import VLLMBackend

        producer = VLLMBackend(model, dtype=str(model.dtype).removeprefix("torch."), threads=2)
    node, other_node = "e" * 32, "f" * 32  # honest workers
    judge = Judge(validator, spec.train.async_level)
    rows: list[tuple[str, int, int, Counter[str], float, float, int]] = []
    proof_sizes: set[int] = set()

    def run(name: str, batches: list[RolloutBatch], started: float, honest: bool) -> None:
        reasons: Counter[str] = Counter()
        n = flagged = own_rows = 0
        power: list[float] = []
        for b in batches:
            for g in b.groups:
                proof_sizes.update(len(x) for proofs in g.proofs for x in proofs)
            started_judging = time.perf_counter()
            verdicts = judge(b)
            if honest:
                cost["validate_s"] += time.perf_counter() - started_judging
                cost["tokens"] += sum(len(c) for g in b.groups for c in g.completions)
            own = sum(1 for r in verdicts if r and r != "batch_refused")  # rejected on their own rows
            power.append(caught_probability(len(verdicts), own, args.check_fraction))
            own_rows += own
            for r in verdicts:
                n += 1
                flagged += bool(r)
                reasons[r or "accepted"] += 1
        caught = sum(power) / len(power) if power else 0.0
        rows.append((name, n, flagged, reasons, time.perf_counter() - started, caught, own_rows))
        print(f"  {name}: {flagged}/{n} {'rejected' if honest else 'detected'} {dict(reasons)}", flush=True)

    cost: dict[str, float] = dict.fromkeys(
        ("generate_s", "validate_s", "tokens", "generated"), 0.0
    )  # honest rollouts: generation and validation seconds and tokens
    index: Counter[str] = Counter()
    workers = iter(f"{i:032x}" for i in range(1, 1000))

    def batch(by: Any = None, max_rows: int | None = 32, who: str = node, **sampling: Any) -> RolloutBatch:
        index[who] += 1
        by = by or producer
        if sampling and by is not model:  # a dishonest draw from the vLLM engine: vLLM's own sampler
            by = Drawing(by, model, **sampling)
            sampling = {}
        started_generating = time.perf_counter()
        made = generate_batch(spec, by, tok, who, STEP, index[who] - 1, max_rows=max_rows, **sampling)
        if by is producer and not sampling and max_rows == 32:  # honest, at the batch size a volunteer runs
            cost["generate_s"] += time.perf_counter() - started_generating
            cost["generated"] += sum(len(c) for g in made.groups for c in g.completions)
        return made

    honest_batches: list[RolloutBatch] = []
    for bs, count in zip((1, 8, 32), args.honest_batches, strict=True):
        t = time.perf_counter()
        made = [batch(max_rows=bs) for _ in range(count)]
        honest_batches += made
        run(f"honest, batch size {bs}", made, t, True)
    k = args.attack_batches
    if args.layer is None:
        args.layer = len(model.model.layers) // 2

    def attack(name: str, cheat: Any, **sampling: Any) -> None:
        """``cheat``'s rollouts from a fresh worker (a model, or None for the honest one with ``sampling``)."""
        t, w = time.perf_counter(), next(workers)
        if args.backend == "vllm" and cheat is not None:  # the engine loads the tampered weights in place
            producer.load_weights(state_dict_for_export(cheat))
            run(name, [batch(who=w) for _ in range(k)], t, False)
            producer.load_weights(state_dict_for_export(model))
        else:
            run(name, [batch(cheat, who=w, **sampling) for _ in range(k)], t, False)

    for rel in (0.1, 0.03, 0.01):
        bad = perturb_layer(model, rel, args.layer, weights=checkpoint_dtype(args.model))
        attack(f"layer {args.layer}'s weights x (1 + {rel:g} N(0,1))", bad)
        del bad
    attack("another model of the same shape", same_shape(model))
    for how, what in (("int8", "int8 per channel"), ("fp8", "fp8 e4m3"), ("int4", "4-bit, groups of 32")):
        attack(f"weights quantized: {what}", quantized(model, how))
    lr = spec.train.lr if args.model == "tiny" else 1e-5  # node/configs/smollm2-addition.toml's
    tuned = fine_tuned(model, spec, honest_batches[:4], int(tok.pad_token_id), lr)
    attack(f"a fine-tune of 3 GRPO steps (lr {lr:g}): the next version", tuned)
    del tuned
    t = time.perf_counter()
    w, small = next(workers), other_model(model)
    if args.backend == "vllm":
        small = VLLMBackend(small, dtype=str(model.dtype).removeprefix("torch."), threads=2)
    run("a smaller model (2-layer Llama) claims the run's", [batch(small, who=w) for _ in range(k)], t, False)
    if args.backend == "vllm":
        small.close()
    t = time.perf_counter()
    w = next(workers)
    run("a middle token edited after generation", [edit_middle(batch(who=w), vocab) for _ in range(k)], t, False)
    attack("plain sampler at temperature 0.7", None, draw_temperature=0.7)
    attack("greedy decoding", None, greedy=True)
    if args.backend == "transformers":
        attack("seeded draw truncated to the top 50 tokens", None, draw_top_k=50)
        attack("seeded draw truncated to the top-p 0.9 nucleus", None, draw_top_p=0.9)
    t = time.perf_counter()
    w = next(workers)
    run("reported reward inflated", [inflate(batch(who=w)) for _ in range(k)], t, False)
    t = time.perf_counter()
    stale = STEP - spec.train.async_level - 1
    old = [generate_batch(spec, producer, tok, node, stale, i, max_rows=32) for i in range(k)]
    run(f"version {STEP - spec.train.async_level - 1} at step {STEP} (async level 2)", old, t, False)
    t = time.perf_counter()
    fresh = [batch(who=other_node) for _ in range(k)]
    for b in fresh:  # first delivery, accepted
        judge(b)
    run("the same batch sent twice", fresh, t, False)
    t = time.perf_counter()
    thief = next(workers)  # sends batches made for another node's assignment, under its own name
    stolen = [batch(who=node).model_copy(update={"node_id": thief, "batch_index": i}) for i in range(k)]
    run("tasks not assigned to the signing node", stolen, t, False)

    honest = [r for r in rows if r[0].startswith("honest")]
    attacks = [r for r in rows if not r[0].startswith("honest")]
    print(
        f"\nTOPLOC detection, {args.model}, rollouts from the {args.backend} backend "
        f"(weights {checkpoint_dtype(args.model)}, compute {model.dtype}), thresholds from {source}: "
        f"{verify.model_dump()}"
    )
    cf = args.check_fraction
    print(
        f"{'rollouts':52} {'n':>5} {'flagged':>8} {'rows':>6} {f'P@{cf:g}':>7} {'batches':>8}  {'seconds':>8}  reasons"
    )
    for name, n, flagged, reasons, secs, caught, own_rows in rows:
        share = own_rows / n if n else 0.0  # rejected on their own rows: what a spot check can find
        expected = f"{1 / caught:8.1f}" if caught > 0 else f"{'never':>8}"
        print(
            f"{name:52} {n:5d} {flagged:8d} {share:6.0%} {caught:7.2f} {expected}  {secs:8.1f}  {dict(reasons)}"
            if not name.startswith("honest")
            else f"{name:52} {n:5d} {flagged:8d} {share:6.0%} {'':>7} {'':>8}  {secs:8.1f}  {dict(reasons)}"
        )
    h_n, h_bad = sum(r[1] for r in honest), sum(r[2] for r in honest)
    a_n, a_caught = sum(r[1] for r in attacks), sum(r[2] for r in attacks)
    missed = [r[0] for r in attacks if r[2] < r[1] / 2]
    bound = 3.0 / h_n if h_n and not h_bad else h_bad / max(h_n, 1)  # rule of three: 95% upper bound at 0 seen
    size = max(proof_sizes) if proof_sizes else 0
    print(f"mostly undetected: {'; '.join(missed) or 'none'}")
    gen_ms = 1000 * cost["generate_s"] / max(cost["generated"] / 1000, 1e-9)
    val_ms = 1000 * cost["validate_s"] / max(cost["tokens"] / 1000, 1e-9)
    print(
        f"cost per 1k rollout tokens ({model.dtype}, {torch.get_num_threads()} threads): generating at batch 32 "
        f"{gen_ms:.0f} ms (with proofs), validating {val_ms:.0f} ms (prefill, proofs, re-derived sampling): "
        f"{val_ms / max(gen_ms, 1e-9):.2f} of generating"
    )
    print(
        f"toploc model={args.model} compute={args.compute} honest_rejected={h_bad}/{h_n} "
        f"(<= {bound:.2%} at 95%) attacks_detected={a_caught}/{a_n} undetected_attacks={len(missed)} "
        f"validate_vs_generate={val_ms / max(gen_ms, 1e-9):.2f} "
        f"proof_bytes_per_32_tokens={size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
