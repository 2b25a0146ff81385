"""Per-token log-probabilities of given tokens under temperature-scaled logits.

Computed as ``logits[target] - logsumexp(logits)`` so the full log-softmax over the vocabulary is never kept.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``logits``: ``[..., vocab]``, ``targets``: ``[...]`` → log p(target) at ``temperature``, in fp32."""
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the temperature-scaled distribution at every position, in fp32: ``[..., vocab]`` → ``[...]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
