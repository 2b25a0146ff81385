"""Where the trainer's memory goes: resident memory after each part is built, and the peak of a training step.

Builds, in one process and in the order the trainer does, the parts of a trainer for a run config (default the
demo's SmolLM2 run, node/configs/smollm2-addition.toml): the libraries, the tokenizer, the policy engine (fp32
master weights, plus the frozen reference model when ``train.kl_coef > 0``), the validator's second model, then
one training step on a batch shaped like the run's (``task.tasks_per_batch x sampling.group_size`` rows of
prompt plus ``sampling.max_new_tokens`` tokens), which allocates the optimizer's state. RSS is sampled every 5 ms
in a thread; the step's figure is its peak above the memory before it. Prints a table, and per parameter and per
rollout token figures, then one summary line:
    memory model=... params_m=... trainer_rss_mb=... step_peak_mb=... bytes_per_param=... step_bytes_per_token=...
        step_s=...

    python benchmarks/memory.py [--config node/configs/smollm2-addition.toml] [--set train.micro_rows=8]
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent

MB = 2**20


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


def peak_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the highest RSS seen while it ran."""
    top = rss()
    done = threading.Event()

    def watch() -> None:
        nonlocal top
        while not done.is_set():
            top = max(top, rss())
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        out = fn()
    finally:
        done.set()
        thread.join()
    return out, max(top, rss())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "node" / "configs" / "smollm2-addition.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    from intellect_node.runtime import return_freed_memory

    return_freed_memory()  # as every node process does first (node/cli.py)
    rows: list[tuple[str, float]] = []
    start = rss()

    import torch

    from intellect_node.config import load_run_config
    from intellect_node.policy.engine import Group, Packed, local_engine, pack_sequences
    from intellect_node.policy.model import DTYPES, build_model, build_tokenizer, stored_in

    torch.set_num_threads(2)
    run = load_run_config(args.config, args.overrides)
    spec = run.spec("0" * 32)
    last = rss()
    rows.append(("python, torch, transformers", (last - start) / MB))

    def part(name: str, fn: Callable[[], Any]) -> Any:
        nonlocal last
        out = fn()
        gc.collect()
        now = rss()
        rows.append((name, (now - last) / MB))
        last = now
        return out

    tokenizer = part("tokenizer", lambda: build_tokenizer(spec.model))
    engine = part(
        "policy engine (fp32 weights" + (", reference model)" if spec.train.kl_coef > 0 else ")"),
        lambda: local_engine(spec, tokenizer, device="cpu"),
    )
    params = sum(p.numel() for p in engine.model.parameters())
    stored = DTYPES[spec.model.dtype]
    part(
        f"validator's model (kept in {spec.model.dtype}, computing in fp32)",
        lambda: stored_in(build_model(spec.model, tokenizer, torch.float32), stored),
    )

    n_rows = spec.task.tasks_per_batch * spec.sampling.group_size
    prompt, new = 40, spec.sampling.max_new_tokens
    gen = torch.Generator().manual_seed(0)
    vocab = int(engine.model.config.vocab_size)
    groups = [
        Group(
            "n",
            0,
            torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
            [torch.randint(0, vocab, (new,), generator=gen).tolist() for _ in range(spec.sampling.group_size)],
            [[-1.0] * new for _ in range(spec.sampling.group_size)],
            [float(j % 2) for j in range(spec.sampling.group_size)],
        )
        for _ in range(spec.task.tasks_per_batch)
    ]
    ids, attn, mask, logp_old = pack_sequences(groups, int(tokenizer.pad_token_id))
    advantages = torch.tensor([g.rewards for g in groups]).flatten() - 0.5
    packed = Packed(ids, attn, mask, logp_old, advantages)
    from intellect_node.runtime import trim_freed

    before = rss()
    _, first_peak = peak_during(lambda: engine.step(packed, 1e-6))
    gc.collect()
    trim_freed()  # as the trainer does after each step: what the step freed is not held for the next
    rows.append(
        (f"optimizer state, {spec.train.optimizer_state_dtype} moments (after the first step)", (rss() - before) / MB)
    )
    last = rss()
    began = time.perf_counter()
    _, peak = peak_during(lambda: engine.step(packed, 1e-6))
    step_s = time.perf_counter() - began
    step_peak = peak - last
    tokens = int(mask.sum())
    total = last / MB
    width = max(len(k) for k, _ in rows)
    print(f"{'part':<{width}}  {'MB':>8}")
    for k, v in rows:
        print(f"{k:<{width}}  {v:>8.0f}")
    print(f"{'resident after setup':<{width}}  {total:>8.0f}")
    print(
        f"{'a training step, peak above that':<{width}}  {step_peak / MB:>8.0f}   ({n_rows} rows x "
        f"{ids.shape[1]} positions, {tokens} completion tokens, micro_rows={spec.train.micro_rows or n_rows})"
    )
    print(f"{'first step, peak (optimizer state allocated)':<{width}}  {(first_peak - before) / MB:>8.0f}")
    print(f"{'a training step, seconds (2 threads)':<{width}}  {step_s:>8.1f}")
    print(
        f"parameters: {params / 1e6:.1f} M; resident after setup per parameter: {last / params:.1f} bytes; "
        f"step peak per completion token: {step_peak / tokens / 1e3:.0f} kB"
    )
    print(
        f"memory model={spec.model.name or spec.model.kind} params_m={params / 1e6:.1f} trainer_rss_mb={total:.0f} "
        f"step_peak_mb={step_peak / MB:.0f} bytes_per_param={last / params:.1f} "
        f"step_bytes_per_token={step_peak / tokens:.0f} step_s={step_s:.1f}"
    )


if __name__ == "__main__":
    main()
