"""Where a producer's batch goes: the learning run's batch (8 prompts x 8 samples, up to 24 new tokens), generated
three ways, on one torch thread and on two, so that the swarm's generation seconds per batch (benchmarks/learning.py,
``generation_s``) can be split into what the colocated loop pays too and what the producer adds.

    python benchmarks/producer.py [--config node/configs/smollm2-addition.toml] [--threads 1 2] [--repeats 2]

- ``loop``: the colocated loop's call (benchmarks/learning.py): ``sample_groups`` over the 8 prompts with a group
  size of 8, no proofs.
- ``rows``: the producer's call (``generate_batch`` through the transformers backend, as an inference node runs it:
  64 rows of one prompt each, every row with its own seed) with the proofs turned off.
- ``proofs``: the same with TOPLOC proofs, as the node sends it.

Every mode samples the same rows from the same seeds (node, version and batch index fixed), so their tokens are the
same and only the work differs; the table says the tokens, so that is checked. SmolLM2-135M-Instruct in fp32 (the
run's compute dtype), version 0's weights. Each figure is the best of ``--repeats`` timed batches after a warm-up
batch; the modes take turns in each round. Not in it: what the node does beside generating (receiving and hashing
every version in the background, gossip, its HTTP server), which the learning run's ``generation_s`` includes.

Summary line: the seconds per batch of each mode on one thread, and ``proof_pct`` (proofs over rows) and
``rows_pct`` (rows over loop), the producer's two additions.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from intellect_node.config import load_run_config
from intellect_node.judging.tasks import task_source
from intellect_node.policy.backend import GenerationBackend, SamplingRequest, TransformersBackend
from intellect_node.policy.generate import Completion, sample_groups
from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt
from intellect_node.roles.inference import generate_batch
from intellect_protocol.messages import RunSpec
from intellect_protocol.tasks import sampling_seed

CONFIG = Path(__file__).resolve().parent.parent / "node" / "configs" / "smollm2-addition.toml"
NODE = "b" * 32
MODES = ("loop", "rows", "proofs")


class NoProofs(GenerationBackend):
    """The node's backend with the run's proof settings dropped from every call."""

    name = "transformers"

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner = inner

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.inner.load_weights(tensors)

    def generate(self, prompts: list[list[int]], row_seeds: list[int], request: SamplingRequest) -> list[Completion]:
        return self.inner.generate(prompts, row_seeds, dataclasses.replace(request, proofs=None))


def one_batch(mode: str, spec: RunSpec, model: torch.nn.Module, tok: Any) -> int:
    """Generate the batch in ``mode``; returns its new tokens."""
    if mode == "loop":
        s, source = spec.sampling, task_source(spec.task)
        tasks = [source.assigned(spec.seed, NODE, 0, 0, slot) for slot in range(spec.task.tasks_per_batch)]
        prompts = [encode_prompt(tok, task.prompt) for task in tasks]
        seeds = [sampling_seed(spec.seed, NODE, 0, 0, g, j) for g in range(len(tasks)) for j in range(s.group_size)]
        eos, pad = int(tok.eos_token_id), int(tok.pad_token_id)
        groups = sample_groups(model, prompts, s.group_size, s.max_new_tokens, s.temperature, eos, pad, seeds)
        return sum(len(c.tokens) for g in groups for c in g)
    backend = TransformersBackend(model)
    batch = generate_batch(spec, backend if mode == "proofs" else NoProofs(backend), tok, NODE, 0, 0)
    return sum(len(c) for g in batch.groups for c in g.completions)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2, help="timed batches per figure after the warm-up (default 2)")
    args = p.parse_args()
    spec = load_run_config(args.config).spec("f" * 32)
    tok = build_tokenizer(spec.model)
    model = build_model(spec.model, tok)  # as make_backend builds it: the run's compute dtype
    best: dict[tuple[int, str], float] = {}
    tokens: dict[str, int] = {}
    print(f"{'threads':>7} {'mode':>7} {'tokens':>6} {'s/batch':>8} {'tok/s':>7}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for round_ in range(args.repeats + 1):
            for mode in MODES:
                began = time.perf_counter()
                tokens[mode] = one_batch(mode, spec, model, tok)
                took = time.perf_counter() - began
                if round_ > 0:  # round 0 warms up
                    best[threads, mode] = min(best.get((threads, mode), took), took)
        for mode in MODES:
            s = best[threads, mode]
            print(f"{threads:>7} {mode:>7} {tokens[mode]:>6} {s:>8.2f} {tokens[mode] / s:>7.0f}", flush=True)
    one = min(args.threads)
    loop, rows, proofs = (best[one, m] for m in MODES)
    print(
        f"producer model=smollm2 task={spec.task.family} threads={one} loop_s={loop:.2f} rows_s={rows:.2f} "
        f"proofs_s={proofs:.2f} rows_pct={(rows / loop - 1) * 100:.1f} proof_pct={(proofs / rows - 1) * 100:.1f} "
        f"same_tokens={len(set(tokens.values())) == 1}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
