"""Per-token log-probabilities of given tokens under temperature-scaled logits.

Computed as ``logits[target] - logsumexp(logits)`` so the full log-softmax over the vocabulary is never kept.
"""

from __future__ import annotations

import torch

ENTROPY_CHUNK_ROWS = 256
"""Positions per piece when the entropy needs no gradient (256 x 49k vocabulary x 4 B = 50 MB per copy)."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``logits``: ``[..., vocab]``, ``targets``: ``[...]`` → log p(target) at ``temperature``, in fp32."""
    scaled = logits.float()
    if temperature != 1.0:  # x / 1.0 == x: no vocabulary-sized copy (autograd keeps it for logsumexp)
        scaled = scaled / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the temperature-scaled distribution at every position, in fp32: ``[..., vocab]`` → ``[...]``."""
    if logits.requires_grad and torch.is_grad_enabled():
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return -(logp.exp() * logp).sum(dim=-1)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    with torch.no_grad():  # a statistic only: a few rows at a time, never three vocabulary-sized copies of it all
        for start in range(0, flat.shape[0], ENTROPY_CHUNK_ROWS):
            logp = torch.log_softmax(flat[start : start + ENTROPY_CHUNK_ROWS].float() / temperature, dim=-1)
            out[start : start + ENTROPY_CHUNK_ROWS] = -(logp.exp() * logp).sum(dim=-1)
    return out.reshape(logits.shape[:-1])
