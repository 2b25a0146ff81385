"""Detection: honest rollouts all pass, every cheating rollout is caught (SmolLM2-135M-Instruct, bf16).

    python benchmarks/toploc_detect.py [--model smollm2|tiny] [--verify node/configs/verify-smollm2.toml]
    .venv-vllm/bin/python benchmarks/toploc_detect.py --backend vllm    # rollouts from vLLM, same validator

Every batch goes through what the trainer applies: the header gate (version window, duplicates, order) and the
validator (assignment, termination, reward, TOPLOC proofs against one prefill, seeded sampling re-derived).
``--backend vllm`` makes every rollout, honest or not, with the vLLM backend (node/policy/vllm_backend.py; the
perturbed weights loaded into the same engine in place, the other model in an engine of its own, the plain
sampler and greedy decoding as vLLM's own sampler) and judges it with the transformers validator, as a trainer
judges a vLLM volunteer.
Honest rollouts are generated at batch sizes 1, 8 and 32; the attacks, each on at least 50 rollouts:

- one decoder layer's weights perturbed by 1% relative noise;
- another model (a tiny Llama with SmolLM2's vocabulary and width, 2 layers) claiming to be the run's model;
- one token in the middle of each completion edited after generation;
- a plain sampler at temperature 0.7, and greedy decoding;
- the reported reward inflated;
- a weight version older than the run allows (async level 2);
- the same batch sent twice;
- a batch whose tasks were not assigned to the node that signs it.

Thresholds come from benchmarks/calibrate_validator.py (other seeds, other rollouts). A rollout counts as
detected when the batch carrying it is refused or the validator rejects that rollout.
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from intellect_node.config import RunConfig
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
    p.add_argument("--verify", type=Path, help="TOML with a [verify] section (node/configs/verify-<model>.toml)")
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
        "--compute",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="SmolLM2: compute in fp32 on the bf16 weights (default), or in bf16",
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
    args = p.parse_args()
    suffix = "" if args.compute == "fp32" else f"-{args.compute}"
    path = args.verify or ROOT / "node" / "configs" / f"verify-{args.model}{suffix}.toml"
    default = RunConfig().verify if args.model == "tiny" else VerifySpec(topk=128)  # tiny.toml's; SmolLM2's
    verify = VerifySpec(**tomllib.loads(path.read_text())["verify"]) if path.exists() else default
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
    rows: list[tuple[str, int, int, Counter[str], float]] = []
    proof_sizes: set[int] = set()

    def run(name: str, batches: list[RolloutBatch], started: float, honest: bool) -> None:
        reasons: Counter[str] = Counter()
        n = flagged = 0
        for b in batches:
            for g in b.groups:
                proof_sizes.update(len(x) for proofs in g.proofs for x in proofs)
            for r in judge(b):
                n += 1
                flagged += bool(r)
                reasons[r or "accepted"] += 1
        rows.append((name, n, flagged, reasons, time.perf_counter() - started))
        print(f"  {name}: {flagged}/{n} {'rejected' if honest else 'detected'} {dict(reasons)}", flush=True)

    index: Counter[str] = Counter()
    workers = iter(f"{i:032x}" for i in range(1, 1000))

    def batch(by: Any = None, max_rows: int | None = 32, who: str = node, **sampling: Any) -> RolloutBatch:
        index[who] += 1
        by = by or producer
        if sampling and by is not model:  # a dishonest draw from the vLLM engine: vLLM's own sampler
            by = Drawing(by, model, **sampling)
            sampling = {}
        return generate_batch(spec, by, tok, who, STEP, index[who] - 1, max_rows=max_rows, **sampling)

    for bs, count in zip((1, 8, 32), args.honest_batches, strict=True):
        t = time.perf_counter()
        run(f"honest, batch size {bs}", [batch(max_rows=bs) for _ in range(count)], t, True)
    k = args.attack_batches
    t = time.perf_counter()
    if args.layer is None:
        args.layer = len(model.model.layers) // 2
    perturbed = perturb_layer(model, 0.01, args.layer, weights=checkpoint_dtype(args.model))
    w = next(workers)
    name = f"layer {args.layer}'s weights x (1 + 0.01 N(0,1))"
    if args.backend == "vllm":  # the engine loads the tampered weights in place, then the run's again
        producer.load_weights(state_dict_for_export(perturbed))
        run(name, [batch(who=w) for _ in range(k)], t, False)
        producer.load_weights(state_dict_for_export(model))
    else:
        run(name, [batch(perturbed, who=w) for _ in range(k)], t, False)
    del perturbed
    t = time.perf_counter()
    w, small = next(workers), other_model(model)
    if args.backend == "vllm":
        small = VLLMBackend(small, dtype=str(model.dtype).removeprefix("torch."), threads=2)
    run("another model (2-layer Llama) claims the run's", [batch(small, who=w) for _ in range(k)], t, False)
    if args.backend == "vllm":
        small.close()
    t = time.perf_counter()
    w = next(workers)
    run("a middle token edited after generation", [edit_middle(batch(who=w), vocab) for _ in range(k)], t, False)
    t = time.perf_counter()
    w = next(workers)
    run("plain sampler at temperature 0.7", [batch(who=w, draw_temperature=0.7) for _ in range(k)], t, False)
    t = time.perf_counter()
    w = next(workers)
    run("greedy decoding", [batch(who=w, greedy=True) for _ in range(k)], t, False)
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
        f"(weights {checkpoint_dtype(args.model)}, compute {model.dtype}), "
        f"thresholds from {path.name if path.exists() else 'the run config'}: {verify.model_dump()}"
    )
    print(f"{'rollouts':52} {'n':>5} {'flagged':>8}  {'seconds':>8}  reasons")
    for name, n, flagged, reasons, secs in rows:
        print(f"{name:52} {n:5d} {flagged:8d}  {secs:8.1f}  {dict(reasons)}")
    h_n, h_bad = sum(r[1] for r in honest), sum(r[2] for r in honest)
    a_n, a_caught = sum(r[1] for r in attacks), sum(r[2] for r in attacks)
    size = max(proof_sizes) if proof_sizes else 0
    print(f"toploc honest_rejected={h_bad}/{h_n} attacks_detected={a_caught}/{a_n} proof_bytes_per_32_tokens={size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
