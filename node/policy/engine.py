"""The trainable policy: fp32 master weights, the optimizer, the reference model, and one GRPO step.

The trainer (node/roles/trainer.py) owns the network, the queue and validation; this owns the numbers. A rollout step
takes a packed batch (rows of ``prompt + completion``, the completion mask, the sampler's log-probs and the
group advantages) and runs ``train.optimizer_steps`` optimizer steps on consecutive minibatches of it. With
``train.recompute_logp_old`` the trainer's own log-probs, taken before the first update, replace the sampler's
as logp_old. A non-finite gradient skips that optimizer step: weights that turned into NaN are never published.

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
from intellect_node.policy.model import DTYPES, bf16_is_fast, build_model, resolve_device, state_dict_for_export
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


class PolicyEngine:
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
        """Log-probs and (with ``entropy``) entropies ``[rows, width - 1]``, computed only from the first column any
        completion scores on (the LM head and the softmaxes over a 49k vocabulary at prompt positions are half the
        step); columns before it are zero, where the mask is zero too. The entropy carries a gradient only when
        the loss uses it (``train.entropy_coef``); as a statistic it is computed without one, a piece at a time
        (its softmaxes held for backward would be three more copies of the logits)."""
        scored = b.mask.any(dim=0).nonzero()
        first = int(scored[0]) if len(scored) else b.mask.shape[1] - 1
        keep = b.ids.shape[1] - first
        with self._autocast():
            logits = model(input_ids=b.ids, attention_mask=b.attention, logits_to_keep=keep).logits[:, :-1].float()
        temp = self.spec.sampling.temperature
        pad = (first, 0)
        logp = torch.nn.functional.pad(token_logprobs(logits, b.ids[:, first + 1 :], temp), pad)
        if not entropy:
            return logp, None
        source = logits if self.spec.train.entropy_coef else logits.detach()
        return logp, torch.nn.functional.pad(token_entropy(source, temp), pad)

    def step(self, batch: Packed, lr: float) -> dict[str, float]:
        t = self.spec.train
        batch = batch.to(next(self.model.parameters()).device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        logp_gap = 0.0
        if t.recompute_logp_old:  # in micro-batches too: the whole batch's logits at once are ~0.5 GB per copy
            with torch.no_grad():
                micro = t.micro_rows or batch.ids.shape[0]
                mine = torch.cat(
                    [
                        self._logp(self.model, batch.rows(slice(i, i + micro)), entropy=False)[0]
                        for i in range(0, batch.ids.shape[0], micro)
                    ]
                )
            tokens = batch.mask.sum().clamp(min=1.0)
            logp_gap = float(((mine - batch.logp_old).abs() * batch.mask).sum() / tokens)
            batch = Packed(batch.ids, batch.attention, batch.mask, mine, batch.advantages)
        rows = batch.ids.shape[0]
        parts = min(t.optimizer_steps, rows)
        bounds = [rows * i // parts for i in range(parts + 1)]
        self.model.train()
        totals: dict[str, float] = {}
        try:
            for i in range(parts):
                part = self._minibatch(batch.rows(slice(bounds[i], bounds[i + 1])))
                for key, value in part.items():
                    totals[key] = totals.get(key, 0.0) + value
        finally:
            self.model.eval()
        stats = {k: v / parts for k, v in totals.items()}
        stats["tokens"] = totals.get("tokens", 0.0)
        stats["logp_old_gap"] = logp_gap
        stats["lr"] = lr
        return stats

    def _loss(self, b: Packed) -> tuple[torch.Tensor, LossStats]:
        """The GRPO loss of ``b`` (token mean over its rows) under the current policy."""
        t = self.spec.train
        logp, entropy = self._logp(self.model, b)
        logp_ref = None
        if self.reference is not None:
            with torch.no_grad():
                logp_ref = self._logp(self.reference, b, entropy=False)[0]
        return grpo_loss(
            logp,
            b.logp_old,
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

    def _minibatch(self, b: Packed) -> dict[str, float]:
        """One optimizer step on ``b``: gradients accumulated over ``train.micro_rows`` rows at a time, each
        micro-batch's token-mean loss weighted by its share of the minibatch's tokens (so the gradient is the
        token mean over the whole minibatch, as in one pass)."""
        t = self.spec.train
        rows = b.ids.shape[0]
        micro = t.micro_rows or rows
        total = float(b.mask.sum().clamp(min=1.0))
        acc = {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "clipped_fraction": 0.0, "tokens": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, rows, micro):
            m = b.rows(slice(start, start + micro))
            weight = float(m.mask.sum()) / total
            if weight == 0.0:
                continue
            loss, stats = self._loss(m)
            (loss * weight).backward()
            for key, value in (
                ("loss", stats.loss),
                ("entropy", stats.entropy),
                ("kl", stats.kl),
                ("clipped_fraction", stats.clipped_fraction),
            ):
                acc[key] += value * weight
            acc["tokens"] += stats.tokens
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
