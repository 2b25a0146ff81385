"""Run specs and training batches on the tiny model (the default ``RunConfig``: a two-layer Llama and a character
tokenizer, fast enough for unit tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from intellect_kernels.grpo import group_advantages
from intellect_kernels.logprobs import token_logprobs
from intellect_node.config import RunConfig
from intellect_node.policy.engine import Group, Packed, pack_sequences
from intellect_node.policy.model import build_tokenizer, encode_prompt
from intellect_protocol.messages import RunSpec

RUN = RunConfig()
TOK = build_tokenizer(RUN.model)


def run_spec(run: RunConfig, seed: int, run_id: str = "a" * 32, **parts: Any) -> RunSpec:
    """``run``'s model, task, sampling, train and verify as a RunSpec created at time 0, with no name or admission
    of its own. A part given as a dict updates ``run``'s (``train={"lr": 1e-2}``); given as a spec it replaces it."""
    fields: dict[str, Any] = {}
    for part in ("model", "task", "sampling", "train", "verify"):
        mine = getattr(run, part)
        given = parts.pop(part, None)
        fields[part] = mine.model_copy(update=given) if isinstance(given, dict) else given or mine
    if parts:
        raise TypeError(f"not a part of a run: {sorted(parts)}")
    return RunSpec(run_id=run_id, created=0.0, seed=seed, **fields)


def packed_batch(
    model: torch.nn.Module,
    lengths: Sequence[int],
    logp_old: Literal["kernel", "log_softmax"] = "kernel",
    sampler_noise: float = 0.0,
) -> Packed:
    """Two groups ("3+4=", "12+9=", left-padded to one length), each with one completion of every length in
    ``lengths`` (random tokens, seed 0) rewarded 1 0 0 1. ``logp_old`` is ``model``'s own, from the project's kernel
    (``token_logprobs``) or from ``log_softmax`` (they differ in the last bit), plus ``sampler_noise`` a token."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for prompt in ("3+4=", "12+9="):
        ids = encode_prompt(TOK, prompt)
        completions = [torch.randint(3, len(RUN.model.vocab), (n,), generator=gen).tolist() for n in lengths]
        groups.append(Group("b" * 32, 0, ids, completions, [[0.0] * len(c) for c in completions], [1.0, 0, 0, 1.0]))
    ids, attn, mask, _ = pack_sequences(groups, int(TOK.pad_token_id))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        if logp_old == "kernel":
            logp = token_logprobs(logits, ids[:, 1:], 1.0)
        else:
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logp = logp * mask + sampler_noise * mask
    return Packed(ids, attn, mask, logp, group_advantages(torch.tensor([g.rewards for g in groups])).flatten())
