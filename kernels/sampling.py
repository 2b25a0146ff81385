"""Seeded sampling a validator can re-derive: Gumbel-max with noise from a counter-based hash.

The token at a position is ``argmax(logits / T + g)``, where ``g[v] = -log(-log(u[v]))`` and ``u`` comes from
hashing (row seed, position, vocabulary index) with integer arithmetic only, so the same noise comes out on any
device and in any batch. Gumbel-max draws exactly from softmax(logits / T). A validator holding (nearly) the same
logits re-derives the token; where it does not, the gap between its best score and the claimed token's score
says by how much: numerical noise gives gaps near zero, another sampler gives gaps of order one.

Every noise value is below ``G_MAX`` (the largest value the hash can give).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _mix64(z: int) -> int:
    """splitmix64 finalizer on Python ints."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def position_keys(row_seeds: list[int], positions: list[int]) -> torch.Tensor:
    """A 32-bit key per (row seed, position)."""
    return torch.tensor([_mix64(_mix64(s & _M64) ^ p) & _M32 for s, p in zip(row_seeds, positions, strict=True)])


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, in 16-bit halves so no int64 product overflows (exact everywhere)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float64 Gumbel noise of (key, token) pairs (broadcast); int64 arithmetic on values below 2^50: exact on
    every backend."""
    k = keys.to(torch.int64)
    x = (k + tokens.to(torch.int64) * 0x9E3779B9) & _M32
    x = _fmix32(_fmix32(x) ^ k)
    u = (x.double() + 0.5) / 2.0**32
    return -torch.log(-torch.log(u))


G_MAX = -math.log(-math.log((2.0**32 - 0.5) / 2.0**32)) + 1e-9
"""An upper bound of every value ``gumbel`` returns (its largest u), with a margin for rounding."""


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(len(keys), vocab) float64 Gumbel noise."""
    return gumbel(keys.unsqueeze(1), torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0))


def scores(logits: torch.Tensor, temperature: float, keys: torch.Tensor) -> torch.Tensor:
    """The perturbed scores whose argmax is the sampled token: logits / T + Gumbel noise, in float64."""
    return logits.double() / temperature + gumbel_noise(keys.to(logits.device), logits.shape[-1])


def seeded_sample_full(logits: torch.Tensor, temperature: float, keys: torch.Tensor) -> torch.Tensor:
    """The definition: argmax over the whole vocabulary (rows x vocab)."""
    return scores(logits, temperature, keys).argmax(dim=-1)


def _best(logits: torch.Tensor, temperature: float, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    value, index = scores(logits, temperature, keys).max(dim=-1)
    return index, value


def _draw(logits: torch.Tensor, temperature: float, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    index = _best(logits, temperature, keys)[0]
    scaled = logits.float() / temperature  # as kernels/logprobs.py's token_logprobs
    return index, scaled.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


COMPILE_MIN_VALUES = 1 << 16
"""Rows x vocabulary at which a CPU pass runs compiled (one fused loop instead of ~50 passes over a float64 and
int64 tensor: 147 ms -> 12 ms for 64 rows of SmolLM2's 49,152 tokens on 2 cores, the same values; from 2 rows of
it on, the eager passes cost more than the compiled call). Below it (the tiny model's 20-token vocabulary), or
with ``INTELLECT_NODE_COMPILE=0``, or where compiling fails (no C++ compiler), the eager code runs."""
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
_compile_failed = os.environ.get("INTELLECT_NODE_COMPILE", "1") == "0"


def _pass(fn: Callable[..., Any], logits: torch.Tensor, temperature: float, keys: torch.Tensor) -> Any:
    """``fn(logits, temperature, keys)``, compiled where that pays and works."""
    global _compile_failed
    if _compile_failed or logits.device.type != "cpu" or logits.numel() < COMPILE_MIN_VALUES:
        return fn(logits, temperature, keys)
    try:
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=True)
        return _compiled[fn](logits, temperature, keys)
    except Exception as e:  # noqa: BLE001 - any compiler failure: the eager code computes the same values
        _compile_failed = True
        logger.warning("seeded sampling runs uncompiled (about 10x slower on large vocabularies): %s", e)
        return fn(logits, temperature, keys)


def _by_rows(
    fn: Callable[..., Any], logits: torch.Tensor, temperature: float, keys: torch.Tensor, rows_per_pass: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn``'s two per-row results over ``logits``, ``rows_per_pass`` rows at a time (the noise is rows x
    vocabulary float64 where it runs eagerly)."""
    keys = keys.to(logits.device)
    first, second = [], []
    for i in range(0, logits.shape[0], rows_per_pass):
        a, b = _pass(fn, logits[i : i + rows_per_pass], temperature, keys[i : i + rows_per_pass])
        first.append(a)
        second.append(b)
    return torch.cat(first), torch.cat(second)


def seeded_draw(
    logits: torch.Tensor, temperature: float, keys: torch.Tensor, rows_per_pass: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its fp32 log-prob at ``temperature``) per row: ``seeded_sample`` and ``token_logprobs`` of the drawn
    token in one pass over the logits (what a producer needs at every decode step)."""
    return _by_rows(_draw, logits, temperature, keys, rows_per_pass)


def best_scores(
    logits: torch.Tensor, temperature: float, keys: torch.Tensor, rows_per_pass: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its score) per row: the argmax of logits / T + noise over the whole vocabulary. Pruning to the
    tokens that could win does not pay: the noise can reach ``G_MAX`` (~22.9), and a language model's logits
    mostly lie within that of the top."""
    return _by_rows(_best, logits, temperature, keys, rows_per_pass)


def seeded_sample(logits: torch.Tensor, temperature: float, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (rows x vocab)."""
    return best_scores(logits, temperature, keys)[0]


SCORE_ULPS = 64
"""Two evaluations of the same float64 score (the compiled pass's fused loop and the eager gather) may differ in
their last bits (3.6e-15 seen on scores near 20); gaps within this many of the score's ULPs are rounding, not a
choice between tokens. Logit differences between the producer's and the validator's forward passes are larger
by ten orders of magnitude and are judged by ``verify.max_sampling_gap``."""


def sampling_gaps(logits: torch.Tensor, temperature: float, keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """best score - claimed token's score per row: exactly 0 where the claimed token is the one re-derived (or
    scores within float64 rounding of the best), > 0 where the validator's own draw is another token."""
    keys, tokens = keys.to(logits.device), tokens.to(logits.device)
    index, best = best_scores(logits, temperature, keys)
    claimed = logits.double().gather(1, tokens.view(-1, 1)).squeeze(1) / temperature + gumbel(keys, tokens)
    gap = best - claimed
    rounding = SCORE_ULPS * torch.finfo(torch.float64).eps * best.abs().clamp(min=1.0)
    tie = (index == tokens) | (torch.isfinite(claimed) & (gap.abs() <= rounding))  # a -inf logit is never a tie
    return torch.where(tie, torch.zeros_like(gap), gap).float()
