"""The models the validator benchmarks measure (calibrate_validator.py, toploc_detect.py, toploc_speed.py): the
tiny built-in model or SmolLM2-135M-Instruct, a run spec for either, and a copy with one layer perturbed (the
dishonest producer's model)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from intellect_node.config import RunConfig
from intellect_node.policy.model import build_model, build_tokenizer
from intellect_protocol.messages import RunSpec, SamplingSpec, TaskSpec, VerifySpec


def load(model: str, compute: str = "fp32") -> tuple[Any, Any]:
    """The model and tokenizer. SmolLM2's weights are the bf16 checkpoint; ``compute`` fp32 upcasts them
    (exactly) so producer and validator compute in fp32, bf16 computes in bf16, fp16 in fp16 (GPUs without bf16;
    proofs are then over fp16 activations). The tiny model's fp32 weights are converted to ``compute``'s dtype."""
    if model == "tiny":
        run = RunConfig()
        tok = build_tokenizer(run.model)
        tiny = build_model(run.model, tok)
        return tiny.to(COMPUTE[compute]), tok
    from intellect_node.policy.hf import load_causal_lm

    m, tok = load_causal_lm("smollm2")  # the bf16 checkpoint
    return m.to(COMPUTE[compute]), tok  # one conversion: ``.float()`` and ``.half()`` convert the module in place


COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_spec(model: str, verify: VerifySpec, seed: int, tasks_per_batch: int = 4) -> RunSpec:
    run = RunConfig()
    if model == "tiny":
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=12, group_size=8)
    else:
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=64, group_size=8)
    return RunSpec(
        run_id="c" * 32,
        created=0.0,
        seed=seed,
        model=run.model,
        task=TaskSpec(tasks_per_batch=tasks_per_batch, max_operand=99),
        sampling=sampling,
        train=run.train,
        verify=verify,
    )


def perturb_layer(model: Any, rel: float, layer: int = -1, seed: int = 0, weights: torch.dtype | None = None) -> Any:
    """A copy with every weight matrix of one decoder layer (default: the last) multiplied elementwise by
    (1 + rel * N(0, 1)), computed in fp32 and rounded once to the checkpoint's dtype ``weights`` (a perturbed
    checkpoint is still a checkpoint of that dtype)."""
    other = copy.deepcopy(model)
    chosen = other.model.layers[layer]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in chosen.parameters():
            if p.dim() == 2:
                new = p.float() * (1 + rel * torch.randn(p.shape, generator=g))
                p.copy_(new.to(weights or p.dtype).to(p.dtype))
    return other


def checkpoint_dtype(model: str) -> torch.dtype:
    return torch.float32 if model == "tiny" else torch.bfloat16
