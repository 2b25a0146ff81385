"""Held-out accuracy: greedy answers to the run's held-out tasks, scored by the run's own reward; and the sampled
accuracy beside it (the share of samples at the run's temperature that earn reward 1: what GRPO raises, which a
greedy score can miss while the policy's likeliest answer stays the same).

The same extraction and scoring (``intellect_node.judging.tasks.reward``) serve before and after training, for every
run compared. Used by ``intellect-node demo`` and benchmarks/learning.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from intellect_node.judging.tasks import Task, reward
from intellect_node.policy.generate import sample_groups
from intellect_node.policy.model import encode_prompt, load_weights
from intellect_protocol.messages import RunSpec


@torch.no_grad()
def accuracy(
    spec: RunSpec, model: Any, tokenizer: Any, tasks: list[Task], rows: int = 50, samples: int = 0, seed: int = 0
) -> float:
    """Fraction of ``tasks`` whose greedy completion (at most the run's max_new_tokens) earns reward 1; with
    ``samples`` > 0, the fraction of ``samples`` completions per task, drawn at the run's temperature with seeds
    from ``seed`` (the same draws for every policy scored), that earn reward 1."""
    eos, pad = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
    per_task = max(1, samples)
    per_pass = max(1, rows // per_task)
    base = seed * len(tasks) * per_task  # another seed, other draws: no row seed shared with a nearby seed
    correct = 0
    for start in range(0, len(tasks), per_pass):
        part = tasks[start : start + per_pass]
        groups = sample_groups(
            model,
            [encode_prompt(tokenizer, t.prompt) for t in part],
            group_size=per_task,
            max_new_tokens=spec.sampling.max_new_tokens,
            temperature=spec.sampling.temperature if samples else 1.0,
            eos_id=eos,
            pad_id=pad,
            row_seeds=[base + (start + i) * per_task + j for i in range(len(part)) for j in range(per_task)],
            greedy=not samples,
        )
        for task, group in zip(part, groups, strict=True):
            for c in group:
                text = tokenizer.decode(c.tokens[:-1] if c.terminated else c.tokens, skip_special_tokens=False)
                correct += reward(task, text, c.terminated, len(c.tokens), spec.task) == 1.0
    return correct / max(1, len(tasks) * per_task)


def load_folder(model: Any, folder: Path) -> None:
    """Load a published version's shards (or any folder of safetensors files) into ``model``."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    if not tensors:
        raise FileNotFoundError(f"no safetensors files in {folder}")
    load_weights(model, tensors)


def newest_version(weights_root: Path) -> Path | None:
    """The newest complete version folder a trainer has published under ``weights_root``."""
    versions = [p for p in weights_root.iterdir() if p.name.isdigit() and (p / "manifest.msgpack").exists()]
    return max(versions, key=lambda p: int(p.name), default=None)
