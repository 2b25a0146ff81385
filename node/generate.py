"""Sampling groups of completions with a KV cache, keeping each token's sampling log-probability.

Prompts are left-padded into one batch, each repeated ``group_size`` times. A completion ends with EOS
(kept as its last token) or at ``max_new_tokens``. Log-probs are those of the temperature-scaled
distribution the token was drawn from, in fp32.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from intellect_kernels.logprobs import token_logprobs


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    terminated: bool


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache``; accept either."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator,
) -> list[list[Completion]]:
    rows = [p for p in prompts for _ in range(group_size)]
    width = max(len(p) for p in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    cache_arg = _cache_kwarg(model)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = _cache_of(out)
    logits = out.logits[:, -1, :]
    next_pos = positions[:, -1:] + 1
    done = torch.zeros(len(rows), dtype=torch.bool)
    tokens: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    alive: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens.append(token)
        lps.append(token_logprobs(logits, token, temperature))
        alive.append(~done)
        done = done | (token == eos_id)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        out = model(
            input_ids=token.unsqueeze(-1),
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_arg: cache},
        )
        cache = _cache_of(out)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1

    tok = torch.stack(tokens, dim=1).tolist()
    lp = torch.stack(lps, dim=1).tolist()
    live = torch.stack(alive, dim=1).tolist()
    groups: list[list[Completion]] = []
    for g in range(len(prompts)):
        group = []
        for i in range(g * group_size, (g + 1) * group_size):
            n = sum(live[i])
            ids = tok[i][:n]
            group.append(Completion(ids, lp[i][:n], terminated=bool(ids) and ids[-1] == eos_id))
        groups.append(group)
    return groups
