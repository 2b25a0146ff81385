"""GRPO advantages and the INTELLECT-2 two-sided clipped policy loss.

Per token: ``r = exp(logp - logp_old)``, ``c1 = clamp(r, 0, delta)``, ``c2 = clamp(c1, 1 - eps_low,
1 + eps_high)``, ``loss = -min(c1 * A, c2 * A) - entropy_coef * H + kl_coef * k3``, averaged over every
completion token of the batch (token-level normalization). The extra ``delta`` bound caps the ratio for
negative advantages, where PPO's one-sided clip leaves it unbounded. ``H`` is the entropy of the policy's
token distribution; ``k3 = exp(ref - logp) - (ref - logp) - 1`` estimates KL(policy || reference) without bias
and is never negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ADV_EPS = 1e-6


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``(r - mean) / (std + 1e-6)`` within each group; ``rewards`` is ``[groups, group_size]``.

    The standard deviation is the population one (``unbiased=False``): a group of identical rewards gets zero.
    Computed in float64: in float32 the rounding error of the mean (~1e-8) divided by ``1e-6`` would give a
    group of identical rewards spurious advantages of about 1%.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    r = rewards.double()
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + ADV_EPS)).to(rewards.dtype)


@dataclass
class LossStats:
    loss: float
    clipped_fraction: float
    mean_ratio: float
    tokens: int
    entropy: float = 0.0
    kl: float = 0.0


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float = 4.0,
    eps: float = 0.2,
    eps_high: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Token-averaged clipped loss.

    ``logp``, ``logp_old``, ``mask`` (and ``entropy``, ``logp_ref`` when given): ``[sequences, tokens]``;
    ``advantages``: ``[sequences]`` (broadcast over tokens). ``eps`` is the lower clip (``eps_high`` the upper,
    ``eps`` when not given). Padding has ``mask == 0`` and contributes nothing.
    """
    mask = mask.to(logp.dtype)
    # exp of the log-ratio capped at log(delta): a ratio above delta has zero gradient either way, and an
    # uncapped exp(100) would overflow to inf and turn the whole gradient into NaN.
    ratio = torch.exp(torch.clamp(logp - logp_old, max=math.log(delta)))
    c1 = torch.clamp(ratio, 0.0, delta)
    c2 = torch.clamp(c1, 1.0 - eps, 1.0 + (eps if eps_high is None else eps_high))
    adv = advantages.unsqueeze(-1).to(logp.dtype)
    per_token = -torch.minimum(c1 * adv, c2 * adv)
    tokens = mask.sum().clamp(min=1.0)
    mean_entropy = mean_kl = torch.zeros(())
    if entropy is not None:
        mean_entropy = (entropy * mask).sum() / tokens
        if entropy_coef:
            per_token = per_token - entropy_coef * entropy
    if logp_ref is not None:
        log_r = torch.clamp(logp_ref - logp, max=20.0)  # exp(20) is finite; the gradient there is huge anyway
        k3 = torch.exp(log_r) - log_r - 1.0
        mean_kl = (k3 * mask).sum() / tokens
        if kl_coef:
            per_token = per_token + kl_coef * k3
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        clipped = ((c2 != torch.exp(logp - logp_old)) & (mask > 0)).to(logp.dtype).sum() / tokens
        mean_ratio = (ratio * mask).sum() / tokens
    return loss, LossStats(
        float(loss.detach()),
        float(clipped),
        float(mean_ratio),
        int(mask.sum().item()),
        float(mean_entropy.detach()),
        float(mean_kl.detach()),
    )


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from 1 down to ``min_ratio`` at ``decay_steps`` (0: no
    decay), flat after. ``step`` counts from 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if not decay_steps:
        return 1.0
    t = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))
