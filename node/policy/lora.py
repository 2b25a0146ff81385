"""Low-rank adapters (``train.lora_rank > 0``): the trainer learns ``W + (alpha / r) B A`` for every projection of
the transformer blocks, the weights ``W`` frozen, and publishes the merged weights, so producers and validators
run an ordinary model and nothing else in the swarm changes.

Why: a full fine-tune holds a gradient and two AdamW moments for every weight (8-12 bytes a parameter on top of
the weights); the adapters hold them for ~1% of the parameters. For RL this costs little learning: a policy
gradient step carries about one bit per episode, far below what even rank-1 adapters can absorb, and LoRA has
matched full fine-tuning on RL for reasoning at a ~10x higher learning rate ("LoRA Without Regret", Schulman and
Thinking Machines, 2025). The laptop demo (node/configs/smollm2-addition-lora.toml) uses them to fit in 4 GB.

The adapters sit on the existing ``nn.Linear`` modules (two extra parameters and a forward hook each), so every
weight keeps its name: checkpoints hold ``...q_proj.lora_a`` beside ``...q_proj.weight``; the export merges them.
``A`` starts random (seeded: every start of the run builds the same adapters) and ``B`` at zero, so version 0 is
the base model exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of a Llama-style block that get adapters (attention and MLP: all of them, as the paper
recommends; attention alone learned worse there)."""


def _adapted(model: torch.nn.Module) -> list[tuple[str, Any]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    ]


def add_adapters(model: torch.nn.Module, rank: int, alpha: float, seed: int) -> list[torch.nn.Parameter]:
    """Freeze ``model`` and give every targeted projection rank-``rank`` adapters; returns the new parameters
    (the only ones to train)."""
    targets = _adapted(model)
    if not targets:
        raise ValueError(
            f"train.lora_rank: the model has none of the projections adapters go on "
            f"({', '.join(TARGETS)}); set train.lora_rank = 0"
        )
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    params: list[torch.nn.Parameter] = []
    for _, linear in targets:  # Any: the adapters are attributes nn.Linear does not declare
        device = linear.weight.device
        bound = 1.0 / math.sqrt(linear.in_features)  # nn.Linear's own init scale (kaiming uniform, a = sqrt(5))
        a = (torch.rand(rank, linear.in_features, generator=generator) * 2 - 1) * bound
        linear.lora_a = torch.nn.Parameter(a.to(device))
        linear.lora_b = torch.nn.Parameter(torch.zeros(linear.out_features, rank, device=device))
        linear.lora_scale = alpha / rank
        linear.register_forward_hook(_add_low_rank)
        params += [linear.lora_a, linear.lora_b]
    return params


def _add_low_rank(module: Any, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    return output + torch.nn.functional.linear(torch.nn.functional.linear(x, module.lora_a), module.lora_b) * (
        module.lora_scale
    )


def merged_state(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights to publish: every adapted projection's ``W + scale * B A`` (in fp32, then cast to ``dtype``),
    the adapters themselves left out, tied weights once (as ``model.state_dict_for_export``). One weight at a time:
    no fp32 copy of the whole model."""
    adapted = {f"{name}.weight": m for name, m in _adapted(model)}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith((".lora_a", ".lora_b")) or tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            m = adapted.get(key)
            if m is not None:
                tensor = tensor.float() + (m.lora_b.float() @ m.lora_a.float()) * m.lora_scale
            out[key] = tensor.detach().to(device="cpu", dtype=dtype).contiguous().clone()
    return out
