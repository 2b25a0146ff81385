"""Checking rollouts: the exact weights claimed, TOPLOC proofs, seeded sampling, termination, task, reward.

For a batch produced with weight version ``v`` the validator holds a model with exactly version ``v`` (the
caller loads it) and runs one prefill over every prompt + completion (a prompt its rows share runs once, its
completions on its keys and values, as the producer ran them). Then, per completion:

- toploc: the proofs are re-checked against its own last hidden states (prompt positions, then the positions
  of the completion's tokens but its last): exponent mismatches and mantissa error mean / median per proof
  must stay within the run's thresholds; a missing or malformed proof fails.
- sampling: from its own logits and the completion's seed (run seed, node, version, batch, slot, sample) it
  re-derives each token by Gumbel-max. The fraction re-derived must reach ``min_rederived``, and a token it
  does not re-derive is excused only if its perturbed score is within ``max_sampling_gap`` of the best (a
  numerical near-tie). Greedy decoding, another temperature, an edited token or another sampler fail here.
- termination: the completion ends with EOS, or has exactly the run's ``max_new_tokens`` tokens.
- task and reward: the prompt is the task the run assigns to that node for that version, batch and slot; the
  reward is recomputed from the completion, and a reward the worker reported must equal it.

The cheap checks on the envelope (signature, registration, run, version window, duplicates, order) are the
trainer's (node/roles/trainer.py); this module is the part that needs the model.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from intellect_kernels import toploc
from intellect_kernels.logprobs import token_logprobs
from intellect_kernels.sampling import position_keys, sampling_gaps
from intellect_node.judging.tasks import Task, reward, task_source
from intellect_node.policy.generate import HiddenCapture
from intellect_node.policy.model import cache_kwarg, cache_of, encode_prompt
from intellect_protocol.envelope import Rejected
from intellect_protocol.messages import RolloutBatch, RunSpec, TaskSpec, Verdict
from intellect_protocol.tasks import sampling_seed

LOGPROB_FLOOR = -100.0
"""Sampling log-probs below this are refused: no honest sampler draws a token of probability e^-100."""
MAX_PROMPT_TOKENS = 8192
ROWS_PER_PREFILL = 16
"""Completions per validation forward: bounds memory (logits are rows x positions x vocabulary)."""


def expected_proofs(completion_tokens: int, decode_batch: int) -> int:
    """The prefill's proof, then one per ``decode_batch`` decode steps (all completion tokens but the last)."""
    return 1 + math.ceil((completion_tokens - 1) / decode_batch)


def task_reward(tokenizer: Any, task: Task, tokens: list[int], terminated: bool, spec: TaskSpec) -> float:
    """The reward of a completion's tokens (EOS, when it ended with one, is not part of the text). May block for
    seconds on code tasks: call it off the event loop."""
    text = tokenizer.decode(tokens[:-1] if terminated else tokens, skip_special_tokens=False)
    return reward(task, text, terminated, len(tokens), spec)


@dataclass
class Finding:
    """What the validator measured on one batch; ``reason`` empty when every completion passed."""

    reason: str = ""
    detail: str = ""
    completions: int = 0
    exp_mismatches: list[int] = field(default_factory=list)
    mant_err_mean: list[float] = field(default_factory=list)
    mant_err_median: list[float] = field(default_factory=list)
    rederived: list[float] = field(default_factory=list)
    """Per completion: fraction of tokens re-derived."""
    max_gap: list[float] = field(default_factory=list)
    """Per completion: the largest sampling gap."""
    logprob_err: list[float] = field(default_factory=list)
    """Per completion: largest |reported - recomputed| sampling log-prob."""
    rewards: list[list[float]] = field(default_factory=list)
    row_reasons: list[str] = field(default_factory=list)
    """Per completion (slot-major): the first check it failed, or ""."""

    def fail(self, reason: str, detail: str) -> None:
        if not self.reason:
            self.reason, self.detail = reason, detail

    def row(self, where: str, reason: str, detail: str) -> None:
        self.row_reasons.append(reason)
        if reason:
            self.fail(reason, f"{where}: {detail}")

    def row_fail(self, index: int, where: str, reason: str, detail: str) -> None:
        if not self.row_reasons[index]:
            self.row_reasons[index] = reason
            self.fail(reason, f"{where}: {detail}")

    @property
    def ok(self) -> bool:
        return not self.reason

    def verdict(self, batch: RolloutBatch, envelope: bytes) -> Verdict:
        return Verdict(
            run_id=batch.run_id,
            node_id=batch.node_id,
            version=batch.version,
            batch_index=batch.batch_index,
            batch_sha256=hashlib.sha256(envelope).hexdigest(),
            ok=self.ok,
            reason=self.reason,
            detail=self.detail[:500],
            completions=self.completions,
            worst_exp_mismatches=max(self.exp_mismatches, default=0),
            worst_mant_err_mean=max(self.mant_err_mean, default=0.0),
            worst_mant_err_median=max(self.mant_err_median, default=0.0),
            min_rederived=min(self.rederived, default=1.0),
            max_sampling_gap=max(self.max_gap, default=0.0),
        )


class Gate:
    """The trainer's stateful checks on a batch's header, before any model work: the version must lie in
    ``[step - async_level, step]``, and batches of a (node, version) come once each and in order, so a worker can
    neither resend a rollout nor skip one batch's tasks for the next one's. (It can still stop producing on a
    version, or choose among the open versions: tasks are fixed per version, not per wall-clock time.)"""

    def __init__(self, async_level: int) -> None:
        self.async_level = async_level
        self.next_index: dict[tuple[str, int], int] = {}
        self.busy: set[str] = set()
        """Nodes with a batch between ``reserve`` and ``admit``/``release``: one at a time per node."""

    def floor(self, step: int) -> int:
        return step - self.async_level

    def check(self, batch: RolloutBatch, step: int, newest: int | None = None) -> None:
        """``step``: the trainer's step (the window's top); ``newest``: the newest published version, if lower."""
        newest = step if newest is None else min(step, newest)
        if batch.version > newest:
            raise Rejected("future_version", f"version {batch.version} > published {newest}")
        if batch.version < self.floor(step):
            raise Rejected("stale_version", f"version {batch.version} < step {step} - async_level")
        if batch.node_id in self.busy:
            raise Rejected("busy", "another batch of this node is being checked; send one at a time")
        expected = self.next_index.get((batch.node_id, batch.version), 0)
        if batch.batch_index < expected:
            raise Rejected("duplicate", f"batch {batch.batch_index} of version {batch.version} already received")
        if batch.batch_index > expected:
            raise Rejected("out_of_order", f"expected batch {expected} of version {batch.version}")

    def reserve(self, batch: RolloutBatch) -> None:
        """Hold the node's place while its batch is checked (call right after ``check``, with no await between)."""
        self.busy.add(batch.node_id)

    def release(self, batch: RolloutBatch) -> None:
        """The reserved batch was refused: the node may send again."""
        self.busy.discard(batch.node_id)

    def admit(self, batch: RolloutBatch) -> None:
        """Record a batch that passed every header and content check."""
        self.busy.discard(batch.node_id)
        self.next_index[(batch.node_id, batch.version)] = batch.batch_index + 1

    def forget_before(self, floor: int) -> None:
        self.next_index = {k: v for k, v in self.next_index.items() if k[1] >= floor}


class Validator:
    def __init__(self, spec: RunSpec, tokenizer: Any, model: Any, secret: bytes | None = None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.model = model
        self.eos = int(tokenizer.eos_token_id)
        self.pad = int(tokenizer.pad_token_id)
        self.vocab = int(model.config.vocab_size)
        positions = getattr(model.config, "max_position_embeddings", None)
        if isinstance(positions, int) and spec.sampling.max_new_tokens >= positions:
            raise ValueError(
                f"sampling.max_new_tokens = {spec.sampling.max_new_tokens} leaves no room for a prompt "
                f"in the model's {positions} positions: lower it"
            )
        self.source = task_source(spec.task)
        self.secret = secret if secret is not None else os.urandom(32)
        """Keys the spot-check choice (``verify.check_fraction``); never leaves this process."""

    def task(self, batch: RolloutBatch, slot: int) -> Task:
        return self.source.assigned(self.spec.seed, batch.node_id, batch.version, batch.batch_index, slot)

    def check_shape(self, batch: RolloutBatch) -> None:
        """What a well-formed batch of this run looks like; raises Rejected("bad_content") before any model work.
        A batch failing here is refused as malformed (a client bug, say), not judged as cheating."""
        s = self.spec
        if len(batch.groups) != s.task.tasks_per_batch:
            raise Rejected("bad_content", f"{len(batch.groups)} groups, the run asks for {s.task.tasks_per_batch}")
        if sorted(g.slot for g in batch.groups) != list(range(s.task.tasks_per_batch)):
            raise Rejected("bad_content", "slots must be 0..tasks_per_batch-1, each once")
        size = toploc.proof_bytes(s.verify.topk)
        for g in batch.groups:
            if len(g.completions) != s.sampling.group_size:
                raise Rejected(
                    "bad_content", f"group of {len(g.completions)}, the run asks for {s.sampling.group_size}"
                )
            if not g.prompt_ids or len(g.prompt_ids) > MAX_PROMPT_TOKENS or max(g.prompt_ids) >= self.vocab:
                raise Rejected("bad_content", "empty or oversized prompt, or a token outside the vocabulary")
            if len(g.proofs) != len(g.completions):
                raise Rejected("bad_content", "one list of TOPLOC proofs per completion is required")
            if g.rewards and not all(math.isfinite(r) for r in g.rewards):
                raise Rejected("bad_content", "reported rewards must be finite")
            for c, lp, proofs in zip(g.completions, g.logprobs, g.proofs, strict=True):
                if len(c) > s.sampling.max_new_tokens or max(c) >= self.vocab:
                    raise Rejected("bad_content", "completion too long or token outside the vocabulary")
                if self.eos in c[:-1]:
                    raise Rejected("bad_content", "tokens after end of sequence")
                if not all(LOGPROB_FLOOR <= x <= 0.0 for x in lp):
                    raise Rejected("bad_content", f"log-probs must lie in [{LOGPROB_FLOOR:g}, 0]")
                if len(proofs) != expected_proofs(len(c), s.verify.decode_batch) or any(len(x) != size for x in proofs):
                    raise Rejected(
                        "bad_content",
                        f"a completion of {len(c)} tokens carries {expected_proofs(len(c), s.verify.decode_batch)} "
                        f"TOPLOC proofs of {size} bytes",
                    )

    def check_cheap(self, batch: RolloutBatch, finding: Finding) -> None:
        """Assignment, termination and reward (no model needed), one reason per completion."""
        s = self.spec
        for g in batch.groups:
            task = self.task(batch, g.slot)
            assigned = g.prompt_ids == encode_prompt(self.tokenizer, task.prompt)
            rewards = []
            # a worker's own rewards are informational (never used); they are compared where scoring is exact and
            # cheap: code runs under time limits and may score differently on a slower machine
            deterministic = self.source.exact_reward(task)
            for j, c in enumerate(g.completions):
                terminated = c[-1] == self.eos
                rewards.append(task_reward(self.tokenizer, task, c, terminated, s.task) if deterministic else 0.0)
                where = f"slot {g.slot} sample {j}"
                if not assigned:
                    finding.row(where, "unassigned_task", "not the task the run assigns to this node")
                elif not terminated and len(c) != s.sampling.max_new_tokens:
                    finding.row(where, "termination", "neither EOS nor the run's maximum length")
                elif deterministic and g.rewards and not abs(g.rewards[j] - rewards[j]) <= 1e-6:
                    finding.row(where, "reward_mismatch", f"reported {g.rewards[j]}, recomputed {rewards[j]}")
                else:
                    finding.row(where, "", "")
            finding.rewards.append(rewards)

    @torch.no_grad()
    def check(self, batch: RolloutBatch, exhaustive: bool = False, full: bool = False) -> Finding:
        """Every check, cheapest first; the model must hold exactly ``batch.version``. Stops at the first failing
        part unless ``exhaustive`` (the benchmarks measure every completion); ``full`` ignores spot checks (a key on
        probation has every completion checked)."""
        finding = Finding()
        try:
            self.check_shape(batch)
        except Rejected as e:
            finding.fail(e.reason, e.detail)
            finding.row_reasons = [e.reason] * sum(len(g.completions) for g in batch.groups)
            return finding
        self.check_cheap(batch, finding)
        if not finding.ok:  # no model time for a batch already refused
            return finding
        rows = [
            (g.slot, j, g.prompt_ids, c, g.proofs[j], g.logprobs[j])
            for g in batch.groups
            for j, c in enumerate(g.completions)
        ]
        finding.completions = len(rows)
        chosen = list(range(len(rows))) if full else self.spot_check(batch, len(rows))
        if exhaustive or len(chosen) < 2:
            parts = [chosen[i : i + ROWS_PER_PREFILL] for i in range(0, len(chosen), ROWS_PER_PREFILL)]
        else:  # one row the worker cannot predict first, alone: a cheater costs us one short forward pass
            first = self._keyed(batch, "first", chosen)[0]
            rest = [i for i in chosen if i != first]
            parts = [[first]] + [rest[i : i + ROWS_PER_PREFILL] for i in range(0, len(rest), ROWS_PER_PREFILL)]
        for part in parts:  # bounded memory
            self._check_rows(batch, [rows[i] for i in part], part, finding)
            if not finding.ok and not exhaustive:
                break  # the batch is refused: checking the rest costs model time and changes nothing
        return finding

    def _keyed(self, batch: RolloutBatch, purpose: str, items: list[int]) -> list[int]:
        """``items`` in an order keyed by this validator's secret: the worker cannot predict it."""
        tag = f"{purpose}/{batch.node_id}/{batch.version}/{batch.batch_index}/".encode()
        return sorted(items, key=lambda i: hmac.new(self.secret, tag + str(i).encode(), "sha256").digest())

    def spot_check(self, batch: RolloutBatch, n: int) -> list[int]:
        """The completions the model checks: all of them, or with ``verify.check_fraction`` < 1 a share chosen by a
        keyed hash the worker cannot predict (this validator's secret). A worker that cheats on a few rows is
        caught with that probability per batch, and one catch bans it for the run with all its queued work."""
        fraction = self.spec.verify.check_fraction
        if fraction >= 1.0:
            return list(range(n))
        k = max(1, math.ceil(fraction * n))
        return sorted(self._keyed(batch, "spot", list(range(n)))[:k])

    def _forward(self, rows: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The model on ``rows`` (``(slot, sample, prompt, completion, proofs, logprobs)``): per row, its last hidden
        states at the prompt's positions ``[p, hidden]`` (on the CPU, where proofs are checked), at the positions
        whose input was one of the completion's tokens but its last ``[n - 1, hidden]`` (likewise), and the logits
        that score the completion's tokens ``[n, vocab]``. Rows that share a prompt (a group's samples) run it once
        (``_forward_shared``); else every row runs whole, left-padded."""
        prompts = [r[2] for r in rows]
        shared = len(rows) > 1 and min(len(x) for x in prompts) > 1
        shared = shared and any(prompts[i] == prompts[i - 1] for i in range(1, len(rows)))
        if shared:
            return self._forward_shared(rows)
        seqs = [prompt + completion for _, _, prompt, completion, _, _ in rows]
        width = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, width - len(x) :] = torch.tensor(x)
            mask[i, width - len(x) :] = 1
        device = next(self.model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(r[3]) for r in rows) + 1  # left-padded: every completion's scores lie in the last columns
        with HiddenCapture(self.model) as capture:
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=keep
            ).logits
            hidden = capture.take().cpu()
        cut = width - keep  # column 0 of ``logits`` is column ``cut`` of the sequence
        out = []
        for i, (_, _, prompt, completion, _, _) in enumerate(rows):
            off, n, p = width - len(seqs[i]), len(completion), len(prompt)
            out.append(
                (
                    hidden[i, off : off + p],
                    hidden[i, off + p : off + p + n - 1],
                    logits[i, off + p - 1 - cut : off + p - 1 + n - cut],
                )
            )
        return out

    def _forward_shared(self, rows: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``_forward`` with each run of rows sharing a prompt running it once: the prompts less their last token
        (right-padded) in one forward that keeps its keys and values, those copied to their rows; then each row's
        rest, the prompt's last token and the completion but its last token, at its own positions on top. As a
        producer computes (a prefill, then decode on its cache): the numbers equal the whole rows' up to rounding."""
        device = next(self.model.parameters()).device
        first: list[int] = []
        prompt_of: list[int] = []
        for i, r in enumerate(rows):
            if not first or rows[first[-1]][2] != r[2]:
                first.append(i)
            prompt_of.append(len(first) - 1)
        prefix = [len(rows[f][2]) - 1 for f in first]
        prefix_ids = torch.full((len(first), max(prefix)), self.pad, dtype=torch.long)
        prefix_attn = torch.zeros_like(prefix_ids)
        for u, f in enumerate(first):
            prefix_ids[u, : prefix[u]] = torch.tensor(rows[f][2][:-1])
            prefix_attn[u, : prefix[u]] = 1
        rests = [[prompt[-1], *completion[:-1]] for _, _, prompt, completion, _, _ in rows]
        width = max(len(x) for x in rests)
        rest_ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        rest_attn = torch.zeros_like(rest_ids)
        for i, x in enumerate(rests):
            rest_ids[i, : len(x)] = torch.tensor(x)
            rest_attn[i, : len(x)] = 1
        index = torch.tensor(prompt_of)
        positions = torch.tensor([prefix[u] for u in prompt_of]).unsqueeze(1) + torch.arange(width)
        prefix_ids, prefix_attn, rest_ids, rest_attn = (
            t.to(device) for t in (prefix_ids, prefix_attn, rest_ids, rest_attn)
        )
        with HiddenCapture(self.model) as capture:
            out = self.model(input_ids=prefix_ids, attention_mask=prefix_attn, use_cache=True, logits_to_keep=1)
            prefix_hidden = capture.take().cpu()
            past = cache_of(out)
            past.reorder_cache(index.to(device))
            logits = self.model(
                input_ids=rest_ids,
                attention_mask=torch.cat([prefix_attn[index.to(device)], rest_attn], dim=1),
                position_ids=positions.to(device),
                use_cache=True,
                **{cache_kwarg(self.model): past},
            ).logits
            rest_hidden = capture.take().cpu()
        result = []
        for i, (_, _, _, completion, _, _) in enumerate(rows):
            n, u = len(completion), prompt_of[i]
            prompt_states = torch.cat([prefix_hidden[u, : prefix[u]], rest_hidden[i, :1]])
            result.append((prompt_states, rest_hidden[i, 1:n], logits[i, :n]))
        return result

    def _check_rows(self, batch: RolloutBatch, rows: list[Any], index: list[int], finding: Finding) -> None:
        v = self.spec.verify
        s = self.spec
        device = next(self.model.parameters()).device
        computed = self._forward(rows)
        # One batched TOPLOC verification and one batched re-derivation for all rows
        chunks: list[torch.Tensor] = []
        claimed: list[bytes] = []
        spans: list[tuple[int, int]] = []
        step_logits: list[torch.Tensor] = []
        keys: list[int] = []
        steps: list[int] = []
        tokens: list[int] = []
        reported: list[float] = []
        for (slot, j, _, completion, proofs, logprobs), (prompt_states, decode_states, row_logits) in zip(
            rows, computed, strict=True
        ):
            n = len(completion)
            # the prefill's positions, then those whose input was one of the completion's tokens
            activations = [prompt_states] + list(decode_states.unsqueeze(1))
            mine = toploc.chunk_activations(activations, v.decode_batch)
            if len(proofs) != len(mine):  # check_shape makes this impossible; a missing proof fails
                proofs = [b""] * len(mine)
            spans.append((len(chunks), len(chunks) + len(mine)))
            chunks += mine
            claimed += proofs
            step_logits.append(row_logits)
            keys += [sampling_seed(s.seed, batch.node_id, batch.version, batch.batch_index, slot, j)] * n
            steps += range(n)
            tokens += completion
            reported += logprobs
        results = toploc.verify_chunk_proofs(chunks, claimed, v.topk, foreign_share=toploc.FOREIGN_SHARE)
        all_logits = torch.cat(step_logits)
        all_tokens = torch.tensor(tokens, device=device)
        logprob_err = (
            (
                token_logprobs(all_logits.unsqueeze(0), all_tokens.unsqueeze(0), s.sampling.temperature)[0]
                - torch.tensor(reported, device=device)
            )
            .abs()
            .cpu()
        )
        gaps = sampling_gaps(all_logits, s.sampling.temperature, position_keys(keys, steps), all_tokens).cpu()
        at = 0
        for i, (slot, j, _, completion, _, _) in enumerate(rows):
            mine_results = results[spans[i][0] : spans[i][1]]
            worst = max(mine_results, key=lambda r: (r.exp_mismatches, r.mant_err_mean, r.mant_err_median))
            finding.exp_mismatches.append(max(r.exp_mismatches for r in mine_results))
            finding.mant_err_mean.append(max(r.mant_err_mean for r in mine_results))
            finding.mant_err_median.append(max(r.mant_err_median for r in mine_results))
            row_gaps = gaps[at : at + len(completion)]
            row_lp_err = float(logprob_err[at : at + len(completion)].max())
            at += len(completion)
            misses = int((row_gaps > 0).sum())
            rederived = 1.0 - misses / len(completion)
            max_gap = float(row_gaps.max())
            finding.rederived.append(rederived)
            finding.max_gap.append(max_gap)
            finding.logprob_err.append(row_lp_err)
            # near-ties the validator's numerics resolve the other way: at most this many, each within the gap
            allowed = max(1, math.floor((1.0 - v.min_rederived) * len(completion)))
            where = f"slot {slot} sample {j}"
            if any(
                r.exp_mismatches > v.max_exp_mismatches
                or r.mant_err_mean > v.max_mant_err_mean
                or r.mant_err_median > v.max_mant_err_median
                for r in mine_results
            ):
                finding.row_fail(
                    index[i], where, "toploc", f"hidden states do not match the proofs (worst {tuple(worst)})"
                )
            elif misses > allowed or max_gap > v.max_sampling_gap:
                finding.row_fail(
                    index[i],
                    where,
                    "sampling",
                    f"{misses} of {len(completion)} tokens not re-derived, largest gap {max_gap:.3f} "
                    f"(run allows {allowed}, each within {v.max_sampling_gap:.3f})",
                )
            elif row_lp_err > v.max_logprob_error:
                finding.row_fail(
                    index[i],
                    where,
                    "logprobs",
                    f"reported sampling log-probs off by up to {row_lp_err:.3f} (run allows {v.max_logprob_error:.3f})",
                )
