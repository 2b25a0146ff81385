"""Where a trainer step's time goes: one GRPO step of a run config's model on a batch shaped like the run's, on
this CPU, the way the trainer computes it now and the ways it did before.

The batch: ``task.tasks_per_batch`` prompts from the run's own task source (chat template included), each with
``sampling.group_size`` completions of ``sampling.max_new_tokens`` random tokens (the longest a rollout can be:
an upper bound on a real step). Variants, each timed on a fresh engine after one warm-up step (which allocates
the optimizer state):

- ``whole rows + logp_old pass``: every row run whole (prompt and completion, right-padded), and with
  ``train.recompute_logp_old`` a no-grad pass for the trainer's own logp_old before the step (the trainer until
  this benchmark was written).
- ``whole rows``: the loss's forward gives logp_old (one optimizer step a batch: the weights it sees are those
  before the update).
- ``shared prompts``: each prompt run once, its completions on its keys and values (node/policy/engine.py:
  ``shared_prompts``); what the trainer runs now.

Each at 1 torch thread (the swarm trainer's, beside an inference node on a 2-core machine) and 2 (the colocated
loop's training part in benchmarks/learning.py). Prints a table, then one summary line:
    train_step model=... rows=... whole_pass_1t_s=... shared_1t_s=... shared_2t_s=... speedup_1t=...

    python benchmarks/train_step.py [--config node/configs/smollm2-chainsum.toml] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import intellect_node.policy.engine as engine_module
from intellect_kernels.grpo import group_advantages
from intellect_node.config import load_run_config
from intellect_node.judging.tasks import task_source
from intellect_node.policy.engine import Group, Packed, PolicyEngine, pack_sequences
from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt
from intellect_protocol.messages import RunSpec

ROOT = Path(__file__).resolve().parent.parent
NODE = "0" * 32


def batch_of(spec: RunSpec, tokenizer: Any) -> Packed:
    """The run's prompts (its task source's first assignment), completions of random tokens at full length."""
    source = task_source(spec.task)
    s = spec.sampling
    gen = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    groups = []
    for slot in range(spec.task.tasks_per_batch):
        prompt = encode_prompt(tokenizer, source.assigned(spec.seed, NODE, 0, 0, slot).prompt)
        n = s.max_new_tokens
        completions = [torch.randint(0, vocab, (n,), generator=gen).tolist() for _ in range(s.group_size)]
        logprobs = [[-1.0] * s.max_new_tokens for _ in range(s.group_size)]
        groups.append(Group(NODE, 0, prompt, completions, logprobs, [float(j % 2) for j in range(s.group_size)]))
    ids, attn, mask, logp_old = pack_sequences(groups, int(tokenizer.pad_token_id))
    rewards = torch.tensor([g.rewards for g in groups])
    return Packed(ids, attn, mask, logp_old, group_advantages(rewards).flatten())


@contextmanager
def whole_rows(on: bool) -> Any:
    """Rows run whole: the engine's prompt sharing turned off for the block."""
    kept = engine_module.shared_prompts
    if on:
        engine_module.shared_prompts = lambda b: None
    try:
        yield
    finally:
        engine_module.shared_prompts = kept


def logp_old_pass(engine: PolicyEngine, batch: Packed) -> Packed:
    """The no-grad pass the trainer ran before the step for its own logp_old, in micro-batches."""
    micro = engine.spec.train.micro_rows or batch.ids.shape[0]
    with torch.no_grad():
        mine = torch.cat(
            [
                engine._logp(engine.model, batch.rows(slice(i, i + micro)), entropy=False)[0]
                for i in range(0, batch.ids.shape[0], micro)
            ]
        )
    return Packed(batch.ids, batch.attention, batch.mask, mine * batch.mask, batch.advantages)


def timed(make: Callable[[], PolicyEngine], run: Callable[[PolicyEngine], None], repeats: int) -> float:
    """The median seconds of ``run`` on a fresh engine, after one warm-up step."""
    engine = make()
    run(engine)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run(engine)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "node" / "configs" / "smollm2-chainsum.toml")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per variant (the median is shown)")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to time")
    args = parser.parse_args()
    spec = load_run_config(args.config).spec(NODE)
    tokenizer = build_tokenizer(spec.model)
    batch = batch_of(spec, tokenizer)
    recompute = spec.train.recompute_logp_old
    own = spec.model_copy(update={"train": spec.train.model_copy(update={"recompute_logp_old": False})})

    def make(which: RunSpec) -> Callable[[], PolicyEngine]:
        return lambda: PolicyEngine(which, build_model(which.model, tokenizer, torch.float32))

    variants: dict[str, tuple[bool, Callable[[], PolicyEngine], Callable[[PolicyEngine], None]]] = {
        "whole rows + logp_old pass": (
            True,
            make(own),
            lambda e: e.step(logp_old_pass(e, batch) if recompute else batch, spec.train.lr),
        ),
        "whole rows": (True, make(spec), lambda e: e.step(batch, spec.train.lr)),
        "shared prompts": (False, make(spec), lambda e: e.step(batch, spec.train.lr)),
    }
    threads = [int(n) for n in args.threads.split(",")]
    results: dict[tuple[str, int], float] = {}
    for n in threads:
        torch.set_num_threads(n)
        for name, (whole, factory, run) in variants.items():
            with whole_rows(whole):
                results[name, n] = timed(factory, run, args.repeats)
            print(f"  {name}, {n} thread(s): {results[name, n]:.2f} s", flush=True)
    rows, width = batch.ids.shape
    tokens = int(batch.mask.sum())
    print(
        f"\n{spec.model.name or spec.model.kind}, {rows} rows x {width} positions ({tokens} completion tokens), "
        f"micro_rows={spec.train.micro_rows or rows}, recompute_logp_old={recompute}, "
        f"compute {spec.train.compute_dtype} (fp32 where bf16 is not native)"
    )
    label = max(len(k) for k in variants)
    print(f"{'variant':<{label}}  " + "  ".join(f"{f'{n} thread(s) s':>14}" for n in threads))
    for name in variants:
        print(f"{name:<{label}}  " + "  ".join(f"{results[name, n]:>14.2f}" for n in threads))
    one, two = threads[0], threads[-1]
    print(
        f"train_step model={spec.model.name or spec.model.kind} rows={rows} "
        f"whole_pass_{one}t_s={results['whole rows + logp_old pass', one]:.1f} "
        f"shared_{one}t_s={results['shared prompts', one]:.1f} shared_{two}t_s={results['shared prompts', two]:.1f} "
        f"speedup_{one}t={results['whole rows + logp_old pass', one] / results['shared prompts', one]:.2f}"
    )


if __name__ == "__main__":
    main()
