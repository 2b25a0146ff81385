"""Sampling groups of completions with a KV cache: seeded tokens, sampling log-probs and TOPLOC proofs.

Prompts are left-padded into one batch. Row ``i`` draws every token by Gumbel-max with noise derived from
``row_seeds[i]`` and the token's position in the completion (kernels/sampling.py), so a validator holding the
same logits re-derives it. A completion ends with EOS (kept as its last token) or at ``max_new_tokens``.
Log-probs are those of the temperature-scaled distribution the token was drawn from, in fp32.

Proofs are built from this very generation, not a second pass: a forward hook on the model's final norm keeps
the last hidden state of the prefill (the prompt's positions) and of every decode step whose input was one of
the row's own tokens (the completion's tokens but its last, which is never fed back), as bf16; TOPLOC proofs
cover the prefill and then every ``decode_batch`` decode steps.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from intellect_kernels import toploc
from intellect_kernels.logprobs import token_logprobs
from intellect_kernels.sampling import position_keys, seeded_draw
from intellect_node.policy.model import cache_kwarg, cache_of


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    terminated: bool
    proofs: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class ProofSettings:
    topk: int = toploc.TOPK
    decode_batch: int = toploc.DECODE_BATCH


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the last hidden state (what the LM head reads)."""
    base = getattr(model, "base_model", model)
    for name in ("norm", "final_layernorm", "ln_f"):
        module = getattr(base, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ValueError(f"cannot find the final norm of {type(model).__name__} to take TOPLOC activations from")


def proof_dtype(compute: torch.dtype) -> torch.dtype:
    """What TOPLOC commits to: fp16 activations where the model computes in fp16, bf16 otherwise."""
    return torch.float16 if compute == torch.float16 else torch.bfloat16


class HiddenCapture:
    """Keeps the final norm's output of each forward while active (a context manager), in the proof dtype of the
    model's compute dtype (producer and validator both derive it from the run's ``model.compute_dtype``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.dtype = proof_dtype(next(model.parameters()).dtype)
        self.module = final_norm(model)
        self.outputs: list[torch.Tensor] = []
        self._handle: Any = None

    def _hook(self, _module: Any, _inputs: Any, output: Any) -> None:
        self.outputs.append((output[0] if isinstance(output, tuple) else output).detach().to(self.dtype))

    def __enter__(self) -> HiddenCapture:
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def take(self) -> torch.Tensor:
        out = self.outputs.pop()
        self.outputs.clear()
        return out


def truncate(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """``logits`` with every token outside the ``top_k`` likeliest, or outside the smallest set whose probability
    at ``temperature`` reaches ``top_p``, set to -inf (a truncating sampler's support)."""
    out = logits.float().clone()
    if top_k is not None:
        kth = out.topk(min(top_k, out.shape[-1]), dim=-1).values[:, -1:]
        out[out < kth] = -math.inf
    if top_p is not None:
        ordered, order = out.sort(dim=-1, descending=True)
        mass = torch.softmax(ordered / temperature, dim=-1).cumsum(dim=-1)
        outside = mass - torch.softmax(ordered / temperature, dim=-1) >= top_p  # the mass before it already reached p
        out.scatter_(-1, order, ordered.masked_fill(outside, -math.inf))
    return out


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    row_seeds: list[int],
    proofs: ProofSettings | None = None,
    draw_temperature: float | None = None,
    greedy: bool = False,
    draw_top_k: int | None = None,
    draw_top_p: float | None = None,
) -> list[list[Completion]]:
    """``row_seeds[g * group_size + j]`` seeds sample ``j`` of prompt ``g``.

    ``draw_temperature`` (a plain multinomial sampler at that temperature, not the seeded one), ``greedy``, and
    ``draw_top_k`` / ``draw_top_p`` (the seeded draw over the k likeliest tokens / the nucleus of mass p only: the
    same token as the honest draw wherever that one lies inside) change how tokens are drawn but not the reported
    log-probs, which stay those of the run's full distribution: they exist to play a dishonest worker in tests and
    benchmarks (a validator must catch them; the truncating ones change few rows, benchmarks/toploc_detect.py).
    """
    rng: torch.Generator | None = None
    device = next(model.parameters()).device
    rows = [p for p in prompts for _ in range(group_size)]
    if len(row_seeds) != len(rows):
        raise ValueError(f"{len(row_seeds)} seeds for {len(rows)} rows")
    width = max(len(p) for p in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    cache_arg = cache_kwarg(model)
    capture = HiddenCapture(model) if proofs is not None else None
    prefill_hidden: torch.Tensor | None = None
    decode_hidden: list[torch.Tensor] = []
    with capture or contextlib.nullcontext():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        if capture is not None:
            prefill_hidden = capture.take()
        cache = cache_of(out)
        logits = out.logits[:, -1, :]
        next_pos = positions[:, -1:] + 1
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        tokens: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        alive: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            logprob: torch.Tensor | None = None
            if greedy:
                token = logits.argmax(dim=-1)
            elif draw_temperature is not None:  # a plain sampler at another temperature, with its own randomness
                if rng is None:
                    rng = torch.Generator().manual_seed(row_seeds[0] % 2**63)
                probs = torch.softmax(logits.float().cpu() / draw_temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=rng).squeeze(-1).to(device)
            elif draw_top_k is not None or draw_top_p is not None:
                keys = position_keys(row_seeds, [step] * len(rows))
                token = seeded_draw(truncate(logits, temperature, draw_top_k, draw_top_p), temperature, keys)[0]
            else:
                keys = position_keys(row_seeds, [step] * len(rows))
                token, logprob = seeded_draw(logits, temperature, keys)
            tokens.append(token)
            lps.append(logprob if logprob is not None else token_logprobs(logits, token, temperature))
            alive.append(~done)
            done = done | (token == eos_id)
            if bool(done.all()) or step + 1 == max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long, device=device)], dim=1)
            out = model(
                input_ids=token.unsqueeze(-1),
                attention_mask=mask,
                position_ids=next_pos,
                use_cache=True,
                **{cache_arg: cache},
            )
            if capture is not None:
                decode_hidden.append(capture.take()[:, -1, :])
            cache = cache_of(out)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

    tok = torch.stack(tokens, dim=1).tolist()
    lp = torch.stack(lps, dim=1).tolist()
    live = torch.stack(alive, dim=1).tolist()
    lengths = [sum(row) for row in live]
    row_proofs = _proofs(rows, width, lengths, prefill_hidden, decode_hidden, proofs)
    groups: list[list[Completion]] = []
    for g in range(len(prompts)):
        group = []
        for i in range(g * group_size, (g + 1) * group_size):
            ids = tok[i][: lengths[i]]
            group.append(Completion(ids, lp[i][: lengths[i]], bool(ids) and ids[-1] == eos_id, row_proofs[i]))
        groups.append(group)
    return groups


def _proofs(
    rows: list[list[int]],
    width: int,
    lengths: list[int],
    prefill: torch.Tensor | None,
    decode: list[torch.Tensor],
    settings: ProofSettings | None,
) -> list[list[bytes]]:
    """Every row's chunks in one batched interpolation."""
    if settings is None or prefill is None:
        return [[] for _ in rows]
    prefill = prefill.cpu()  # proofs are built on the CPU, wherever the model ran
    steps = torch.stack(decode, dim=1).cpu() if decode else None  # (rows, steps, hidden)
    chunks: list[torch.Tensor] = []
    counts: list[int] = []
    for i, prompt in enumerate(rows):
        activations = [prefill[i, width - len(prompt) :]]
        if steps is not None:
            activations += list(steps[i, : lengths[i] - 1].unsqueeze(1))
        mine = toploc.chunk_activations(activations, settings.decode_batch)
        chunks += mine
        counts.append(len(mine))
    built = toploc.build_chunk_proofs(chunks, settings.topk)
    out, at = [], 0
    for n in counts:
        out.append(built[at : at + n])
        at += n
    return out
