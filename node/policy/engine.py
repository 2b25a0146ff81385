"""The trainable policy: fp32 master weights, the optimizer, the reference model, and one GRPO step.

The trainer (node/roles/trainer.py) owns the network, the queue and validation; this owns the numbers. A rollout step
takes a packed batch (rows of ``prompt + completion``, the completion mask, the sampler's log-probs and the
group advantages) and runs ``train.optimizer_steps`` optimizer steps on consecutive minibatches of it. With
``train.recompute_logp_old`` the trainer's own log-probs, taken before the first update, replace the sampler's
as logp_old (with one optimizer step a batch they are the loss's own forward, detached: no second pass). A
non-finite gradient skips that optimizer step: weights that turned into NaN are never published.

The rows of a group share their prompt. The forward runs each shared prompt once and its completions on top of
the prompt's keys and values (``shared_prompts``): with SmolLM2's chat template the prompt is two thirds of a
row, and a group of 8 costs about a third of 8 full rows, backward included. Values equal the padded full
forward's up to float rounding (tests/policy/test_engine.py).

``PolicyEngine`` runs in one process. node/policy/fsdp.py shards it over several (torchrun, FSDP2) behind the same
methods, so the trainer does not know which one it drives.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from intellect_kernels.grpo import LossStats, grpo_loss
from intellect_kernels.logprobs import token_entropy, token_logprobs
from intellect_node.policy.lora import add_adapters, merged_state
from intellect_node.policy.model import (
    DTYPES,
    bf16_is_fast,
    build_model,
    cache_kwarg,
    cache_of,
    recomputes_activations,
    resolve_device,
    state_dict_for_export,
)
from intellect_node.policy.optim import AdamWBf16State
from intellect_protocol.messages import RunSpec

logger = logging.getLogger(__name__)


@dataclass
class Packed:
    """Right-padded rows; position ``t`` of ``mask``/``logp_old`` scores token ``t + 1`` of ``ids``."""

    ids: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor
    logp_old: torch.Tensor
    advantages: torch.Tensor

    def to(self, device: torch.device) -> Packed:
        return Packed(*(t.to(device) for t in (self.ids, self.attention, self.mask, self.logp_old, self.advantages)))

    def rows(self, part: slice) -> Packed:
        return Packed(self.ids[part], self.attention[part], self.mask[part], self.logp_old[part], self.advantages[part])


@dataclass
class Group:
    node_id: str
    version: int
    prompt_ids: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    batch_index: int = -1
    slot: int = -1
    digest: str = ""
    """SHA-256 (hex) of the producer's sealed batch this group came from: what the contribution ledger credits."""

    @property
    def key(self) -> BatchKey:
        return (self.node_id, self.version, self.batch_index)


BatchKey = tuple[str, int, int]


def pack_sequences(groups: list[Group], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + completion`` rows, in group order.

    Returns ``ids``, ``attention`` (``[rows, width]``), and ``mask``, ``logp_old`` (``[rows, width - 1]``), where
    position ``t`` scores token ``t + 1``: the mask covers exactly the completion tokens.
    """
    rows = [(g.prompt_ids, c, lp) for g in groups for c, lp in zip(g.completions, g.logprobs, strict=True)]
    width = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(rows), width - 1))
    logp_old = torch.zeros((len(rows), width - 1))
    for i, (prompt, completion, lp) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        attn[i, :n] = 1
        mask[i, len(prompt) - 1 : n - 1] = 1
        logp_old[i, len(prompt) - 1 : n - 1] = torch.tensor(lp)
    return ids, attn, mask, logp_old


@dataclass
class SharedPrompts:
    """How the rows of a packed batch share prompts: row ``r`` continues prompt ``prompt_of[r]``, whose first
    ``prefix[p]`` tokens (the prompt less its last token) run once; the rest of row ``r`` (the prompt's last token,
    then the completion: ``ids[r, prefix : length]``) runs on top of that prompt's keys and values."""

    first_row: list[int]
    """A row holding each prompt."""
    prefix: torch.Tensor
    """Tokens per prompt that run once, ``[prompts]``."""
    prompt_of: torch.Tensor
    """The prompt of each row, ``[rows]``."""
    length: torch.Tensor
    """Real tokens per row, ``[rows]``."""


def shared_prompts(b: Packed) -> SharedPrompts | None:
    """Consecutive rows with the same prompt (a group's completions), read off the packed layout: a row's prompt
    ends where its completion mask starts. None where sharing saves nothing: a row that scores no token, a prompt of
    one token, or no prompt held by two rows."""
    scored = b.mask > 0
    if b.ids.shape[0] == 0 or not bool(scored.any(dim=1).all()):
        return None
    prompt_len = scored.int().argmax(dim=1) + 1  # mask[r, P - 1] is the first scored position: prompts are P long
    first_row: list[int] = []
    prompt_of: list[int] = []
    for r in range(b.ids.shape[0]):
        p = int(prompt_len[r])
        if p < 2:
            return None
        f = first_row[-1] if first_row else -1
        if f < 0 or int(prompt_len[f]) != p or not torch.equal(b.ids[f, :p], b.ids[r, :p]):
            first_row.append(r)
        prompt_of.append(len(first_row) - 1)
    if len(first_row) == b.ids.shape[0]:
        return None
    prefix = prompt_len[first_row] - 1
    return SharedPrompts(first_row, prefix, torch.tensor(prompt_of), b.attention.sum(dim=1))


class PolicyEngine:
    share_prompts = True
    """Run each shared prompt once (``shared_prompts``). The sharded engine does not: its ranks hold different rows,
    and each rank must run the same forwards, in the same order, for FSDP's collectives to match."""

    def __init__(self, spec: RunSpec, model: torch.nn.Module, reference: torch.nn.Module | None = None) -> None:
        self.spec = spec
        self.model = model.float()  # master weights stay fp32 whatever is published or computed in
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        t = spec.train
        if t.gradient_checkpointing:
            enable = getattr(self.model, "gradient_checkpointing_enable", None)
            if enable is None:
                raise ValueError("train.gradient_checkpointing: this model cannot recompute its blocks; set it false")
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trained = (
            add_adapters(self.model, t.lora_rank, t.lora_alpha, spec.seed)
            if t.lora_rank
            else list(self.model.parameters())
        )
        self.optimizer: torch.optim.Optimizer
        if t.optimizer_state_dtype == "bfloat16":
            self.optimizer = AdamWBf16State(trained, lr=t.lr, weight_decay=t.weight_decay, seed=spec.seed)
        else:
            self.optimizer = torch.optim.AdamW(trained, lr=t.lr, weight_decay=t.weight_decay)
        self.skipped = 0
        self._said_fp32 = False

    def _autocast(self) -> Any:
        if self.spec.train.compute_dtype == "bfloat16":
            device = next(self.model.parameters()).device.type
            if bf16_is_fast(device):
                return torch.autocast(device, dtype=torch.bfloat16)
            if not self._said_fp32:
                self._said_fp32 = True
                logger.info(
                    "train.compute_dtype is bfloat16, but this %s has no native bf16 matrix multiply (a CPU without "
                    "AVX-512 or AMX): training computes in fp32 instead, several times faster here and at least as "
                    "precise",
                    device.upper(),
                )
        return contextlib.nullcontext()

    def _logp(
        self, model: torch.nn.Module, b: Packed, entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs and (with ``entropy``) entropies ``[rows, width - 1]`` where the mask scores, zero at least
        where it does not. The entropy carries a gradient only when the loss uses it (``train.entropy_coef``); as a
        statistic it is computed without one, a piece at a time (its softmaxes held for backward would be three more
        copies of the logits). Shared prompts run once (``shared_prompts``) where the model can continue from its
        own cache (not under gradient checkpointing, which turns the cache off)."""
        shared = shared_prompts(b) if self.share_prompts and not recomputes_activations(model) else None
        if shared is not None:
            return self._logp_shared(model, b, shared, entropy)
        # the columns from the first one any completion scores on (the LM head and the softmaxes over a 49k
        # vocabulary at prompt positions would be half the step); columns before it are zero
        scored = b.mask.any(dim=0).nonzero()
        first = int(scored[0]) if len(scored) else b.mask.shape[1] - 1
        keep = b.ids.shape[1] - first
        with self._autocast():
            logits = model(input_ids=b.ids, attention_mask=b.attention, logits_to_keep=keep).logits[:, :-1].float()
        pad = (first, 0)
        logp = torch.nn.functional.pad(token_logprobs(logits, b.ids[:, first + 1 :], self._temperature), pad)
        if not entropy:
            return logp, None
        return logp, torch.nn.functional.pad(token_entropy(self._entropy_source(logits), self._temperature), pad)

    @property
    def _temperature(self) -> float:
        return self.spec.sampling.temperature

    def _entropy_source(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.spec.train.entropy_coef else logits.detach()

    def _logp_shared(
        self, model: torch.nn.Module, b: Packed, shared: SharedPrompts, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_logp`` with each prompt run once: the prompts (less their last token, right-padded) in one forward
        that keeps its keys and values, those copied to the prompt's rows, then every row's rest (the prompt's last
        token and the completion, at their own positions) in one forward on top. Gradients flow through the copies
        into the prompt's forward, as through the full rows."""
        rows, width = b.ids.shape
        device = b.ids.device
        prompt_of = shared.prompt_of.to(device)
        prefix = shared.prefix.to(device)
        start = prefix[prompt_of]  # where each row's rest begins
        rest = shared.length.to(device) - start
        widest_prefix, widest_rest = int(prefix.max()), int(rest.max())
        columns = torch.arange(widest_prefix, device=device)
        prefix_attn = (columns < prefix.unsqueeze(1)).long()
        prefix_ids = b.ids[shared.first_row, :widest_prefix] * prefix_attn  # pads as token 0, masked out
        at = torch.arange(widest_rest, device=device)
        rest_attn = (at < rest.unsqueeze(1)).long()
        gather = (start.unsqueeze(1) + at).clamp(max=width - 1)
        rest_ids = b.ids.gather(1, gather) * rest_attn
        with self._autocast():
            past = cache_of(model(input_ids=prefix_ids, attention_mask=prefix_attn, use_cache=True, logits_to_keep=1))
            past.reorder_cache(prompt_of)
            logits = model(
                input_ids=rest_ids,
                attention_mask=torch.cat([prefix_attn[prompt_of], rest_attn], dim=1),
                position_ids=start.unsqueeze(1) + at,
                use_cache=True,
                **{cache_kwarg(model): past},
            ).logits[:, :-1]
        logits = logits.float()
        # position j of a row's rest scores its token j + 1: the packed layout's column start + j
        valid = (at[:-1] < (rest - 1).unsqueeze(1)).nonzero(as_tuple=True)
        where = (valid[0], start[valid[0]] + valid[1])
        logp_rest = token_logprobs(logits, rest_ids[:, 1:], self._temperature)
        logp = logp_rest.new_zeros(rows, width - 1).index_put(where, logp_rest[valid])
        if not entropy:
            return logp, None
        ent = token_entropy(self._entropy_source(logits), self._temperature)
        return logp, ent.new_zeros(rows, width - 1).index_put(where, ent[valid])

    def step(self, batch: Packed, lr: float) -> dict[str, float]:
        t = self.spec.train
        batch = batch.to(next(self.model.parameters()).device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        rows = batch.ids.shape[0]
        parts = min(t.optimizer_steps, rows)
        # One optimizer step: the weights the loss's forward sees are those before the update, so its log-probs,
        # detached, are the trainer's own logp_old (``own_old``). Several: they are taken first, in micro-batches
        # too (the whole batch's logits at once are ~0.5 GB per copy).
        own_old = t.recompute_logp_old and parts == 1
        gap = 0.0
        if t.recompute_logp_old and not own_old:
            with torch.no_grad():
                micro = t.micro_rows or rows
                mine = torch.cat(
                    [
                        self._logp(self.model, batch.rows(slice(i, i + micro)), entropy=False)[0]
                        for i in range(0, rows, micro)
                    ]
                )
            gap = float(((mine - batch.logp_old).abs() * batch.mask).sum())
            batch = Packed(batch.ids, batch.attention, batch.mask, mine * batch.mask, batch.advantages)
        bounds = [rows * i // parts for i in range(parts + 1)]
        self.model.train()
        totals: dict[str, float] = {}
        try:
            for i in range(parts):
                part = self._minibatch(batch.rows(slice(bounds[i], bounds[i + 1])), own_old)
                for key, value in part.items():
                    totals[key] = totals.get(key, 0.0) + value
        finally:
            self.model.eval()
        gap += totals.pop("logp_old_gap_sum", 0.0)
        stats = {k: v / parts for k, v in totals.items()}
        stats["tokens"] = totals.get("tokens", 0.0)
        stats["logp_old_gap"] = gap / max(float(batch.mask.sum()), 1.0) if t.recompute_logp_old else 0.0
        stats["lr"] = lr
        return stats

    def _loss(self, b: Packed, own_old: bool = False) -> tuple[torch.Tensor, LossStats, float]:
        """The GRPO loss of ``b`` (token mean over its rows) under the current policy, and the summed absolute gap
        between the policy's log-probs and the sampler's over the scored tokens when ``own_old`` (the policy's,
        detached, are then logp_old; else 0.0)."""
        t = self.spec.train
        logp, entropy = self._logp(self.model, b)
        logp_old, gap = b.logp_old, 0.0
        if own_old:
            logp_old = logp.detach() * b.mask
            gap = float(((logp_old - b.logp_old).abs() * b.mask).sum())
        logp_ref = None
        if self.reference is not None:
            with torch.no_grad():
                logp_ref = self._logp(self.reference, b, entropy=False)[0]
        loss, stats = grpo_loss(
            logp,
            logp_old,
            b.advantages,
            b.mask,
            delta=t.delta,
            eps=t.eps,
            eps_high=t.eps_high,
            entropy=entropy,
            entropy_coef=t.entropy_coef,
            logp_ref=logp_ref,
            kl_coef=t.kl_coef,
        )
        return loss, stats, gap

    def _minibatch(self, b: Packed, own_old: bool = False) -> dict[str, float]:
        """One optimizer step on ``b``: gradients accumulated over ``train.micro_rows`` rows at a time, each
        micro-batch's token-mean loss weighted by its share of the minibatch's tokens (so the gradient is the
        token mean over the whole minibatch, as in one pass). ``own_old``: ``_loss``'s."""
        t = self.spec.train
        rows = b.ids.shape[0]
        micro = t.micro_rows or rows
        total = float(b.mask.sum().clamp(min=1.0))
        acc = {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "clipped_fraction": 0.0, "tokens": 0.0, "logp_old_gap_sum": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, rows, micro):
            m = b.rows(slice(start, start + micro))
            weight = float(m.mask.sum()) / total
            if weight == 0.0:
                continue
            loss, stats, gap = self._loss(m, own_old)
            (loss * weight).backward()
            for key, value in (
                ("loss", stats.loss),
                ("entropy", stats.entropy),
                ("kl", stats.kl),
                ("clipped_fraction", stats.clipped_fraction),
            ):
                acc[key] += value * weight
            acc["tokens"] += stats.tokens
            acc["logp_old_gap_sum"] += gap
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.skipped += 1
            logger.error("skipped an optimizer step: gradient norm is %s", float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)  # 4 bytes per parameter not held while judging between steps
        return {**acc, "grad_norm": float(grad_norm)}

    def export_state(self) -> dict[str, torch.Tensor]:
        """The weights to publish, in the run's published dtype."""
        dtype = DTYPES[self.spec.model.dtype]
        if self.spec.train.lora_rank:
            return merged_state(self.model, dtype)
        return state_dict_for_export(self.model, dtype)

    def state(self) -> dict[str, Any]:
        """Everything a resumed trainer needs to continue bit-for-bit: fp32 weights and the optimizer."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "skipped": self.skipped}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped = int(state.get("skipped", 0))

    def close(self) -> None:
        """Nothing to release in one process (node/policy/fsdp.py stops its other ranks here)."""


EngineFactory = Callable[[RunSpec, Any], PolicyEngine]
"""How the trainer gets its engine: ``local_engine``, or a sharded one under torchrun (node/policy/fsdp.py)."""


def local_engine(spec: RunSpec, tokenizer: Any, device: str = "auto") -> PolicyEngine:
    """The policy in this process, on ``device`` (``--device``; node/policy/fsdp.py makes a sharded one under
    torchrun). On a GPU it computes in bf16 autocast as on the CPU (``train.compute_dtype``)."""
    where = resolve_device(device)
    reference = None  # the KL term's reference policy (version 0, frozen) when train.kl_coef > 0
    if spec.train.kl_coef > 0:
        reference = build_model(spec.model, tokenizer, torch.float32).to(where)
    return PolicyEngine(spec, build_model(spec.model, tokenizer, torch.float32).to(where), reference)
