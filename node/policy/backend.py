"""The generation backend interface: what the inference role needs of an engine that samples rollouts.

A backend holds one policy's weights and samples completions, one row per (prompt, seed), with the run's seeded
sampling (kernels/sampling.py: a validator holding the logits re-derives every token) and TOPLOC proofs taken from
the very forward passes that produced the tokens. ``TransformersBackend`` is the reference (node/policy/generate.py,
a KV-cache loop over a transformers model, CPU); another engine (vLLM) is a second implementation of the same two
methods, so the inference role does not change with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from intellect_node.policy.generate import Completion, ProofSettings, sample_groups
from intellect_node.policy.model import build_model, load_weights, resolve_device
from intellect_protocol.messages import RunSpec


@dataclass(frozen=True)
class SamplingRequest:
    """How to sample every row of one call (the run spec's sampling and proof settings)."""

    max_new_tokens: int
    temperature: float
    eos_id: int
    """Ends a row; negative: none does (benchmarks/inference.py: every row max_new_tokens long)."""
    pad_id: int
    proofs: ProofSettings | None

    @classmethod
    def of(cls, spec: RunSpec, tokenizer: Any) -> SamplingRequest:
        return cls(
            max_new_tokens=spec.sampling.max_new_tokens,
            temperature=spec.sampling.temperature,
            eos_id=int(tokenizer.eos_token_id),
            pad_id=int(tokenizer.pad_token_id),
            proofs=ProofSettings(spec.verify.topk, spec.verify.decode_batch),
        )


class GenerationBackend(ABC):
    name: str

    @abstractmethod
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace the policy's weights with a verified version's tensors (names as the trainer publishes them)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], row_seeds: list[int], request: SamplingRequest) -> list[Completion]:
        """Row ``i`` completes ``prompts[i]`` with tokens drawn from ``row_seeds[i]``; one Completion per row, in
        order, each with its sampling log-probs and (when ``request.proofs``) its TOPLOC proofs."""


class TransformersBackend(GenerationBackend):
    """The reference backend: a transformers model in this process.

    ``draw`` reaches sample_groups (``draw_temperature``, ``greedy``): tests and benchmarks use it to play a
    dishonest worker whose tokens a validator must refuse."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module, **draw: Any) -> None:
        self.model = model
        self.draw = draw

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        load_weights(self.model, dict(tensors))

    def generate(self, prompts: list[list[int]], row_seeds: list[int], request: SamplingRequest) -> list[Completion]:
        groups = sample_groups(
            self.model,
            prompts,
            group_size=1,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            eos_id=request.eos_id,
            pad_id=request.pad_id,
            row_seeds=row_seeds,
            proofs=request.proofs,
            **self.draw,
        )
        return [group[0] for group in groups]


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(
    spec: RunSpec, tokenizer: Any, backend: str = "transformers", threads: int = 1, device: str = "auto"
) -> GenerationBackend:
    """The backend an inference node runs, built for the run's model (version 0's shape, weights loaded later).
    ``backend``: ``transformers``, ``vllm``, or ``auto`` (vLLM where it is installed and CUDA is present).
    ``device`` (the transformers backend; vLLM takes its platform's): ``auto``, ``cpu``, ``cuda[:N]``."""
    if backend == "auto":
        backend = "vllm" if torch.cuda.is_available() and vllm_available() else "transformers"
    model = build_model(spec.model, tokenizer)
    if backend == "vllm":
        if not vllm_available():
            raise SystemExit(
                "--backend vllm: vLLM is not installed in this environment; see docs/inference.md "
                "for the install command (or use --backend transformers)"
            )
        from intellect_node.policy.vllm_backend import VLLMBackend

        return VLLMBackend(model, dtype=spec.model.compute_dtype, threads=threads)
    return TransformersBackend(model.to(resolve_device(device)))
