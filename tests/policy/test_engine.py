"""The policy engine on the tiny model: minibatches are optimizer steps, the trainer's own logp_old, the logits
trimmed to the completion columns, shared prompts run once, and bf16 publishing from fp32 master weights."""

from __future__ import annotations

import pytest
import torch

from intellect_kernels.logprobs import token_logprobs
from intellect_node.policy.engine import Packed, PolicyEngine, shared_prompts
from intellect_node.policy.model import build_model
from tests.helpers.tiny import RUN, TOK, packed_batch, run_spec

LENGTHS = (1, 2, 3, 4)
"""The completions' lengths in each group of the batches here: prompts of different lengths, rows of all four."""


def test_logits_trimmed_to_the_completion_columns_give_the_full_forward_values() -> None:
    engine = PolicyEngine(run_spec(RUN, seed=1), build_model(RUN.model, TOK))
    batch = packed_batch(engine.model, LENGTHS)
    logp, entropy = engine._logp(engine.model, batch)
    with torch.no_grad():
        full = token_logprobs(
            engine.model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1], batch.ids[:, 1:], 1.0
        )
    assert torch.allclose(logp * batch.mask, full * batch.mask, atol=1e-5)
    assert entropy.shape == batch.mask.shape


def _full_forward(engine: PolicyEngine, batch: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of every row run whole, padded: what the shared prompts must reproduce."""
    from intellect_kernels.logprobs import token_entropy

    logits = engine.model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]
    return token_logprobs(logits, batch.ids[:, 1:], 1.0) * batch.mask, token_entropy(logits) * batch.mask


def test_shared_prompts_run_once_and_give_the_full_rows_values_and_gradients() -> None:
    spec = run_spec(RUN, seed=1, train={"entropy_coef": 0.1})  # the entropy carries a gradient too
    engine = PolicyEngine(spec, build_model(RUN.model, TOK))
    batch = packed_batch(engine.model, LENGTHS)
    shared = shared_prompts(batch)
    assert shared is not None and shared.first_row == [0, 4]  # two prompts, four rows each
    assert shared.prompt_of.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]

    def grads(logp: torch.Tensor, entropy: torch.Tensor) -> dict[str, torch.Tensor]:
        engine.model.zero_grad(set_to_none=True)
        weights = torch.linspace(-1.0, 1.0, logp.numel()).reshape(logp.shape)  # every position counts differently
        ((logp * weights).sum() + (entropy * batch.mask).sum()).backward()
        return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}

    logp, entropy = engine._logp(engine.model, batch)
    assert entropy is not None
    mine = grads(logp * batch.mask, entropy)
    full_logp, full_entropy = _full_forward(engine, batch)
    full = grads(full_logp, full_entropy)
    assert torch.allclose(logp * batch.mask, full_logp, atol=1e-5)
    assert torch.allclose(entropy * batch.mask, full_entropy, atol=1e-5)
    assert mine.keys() == full.keys() and len(mine) == len(list(engine.model.parameters()))
    for name, grad in full.items():
        assert torch.allclose(mine[name], grad, atol=1e-5, rtol=1e-4), name


def test_rows_that_share_no_prompt_run_whole() -> None:
    engine = PolicyEngine(run_spec(RUN, seed=1), build_model(RUN.model, TOK))
    batch = packed_batch(engine.model, LENGTHS)
    alone = batch.rows(slice(3, 5))  # the last row of one group and the first of the other
    assert shared_prompts(alone) is None
    silent = Packed(batch.ids, batch.attention, batch.mask.clone(), batch.logp_old, batch.advantages)
    silent.mask[2] = 0  # a row that scores nothing has no prompt to read off its mask
    assert shared_prompts(silent) is None
    for b in (alone, silent):
        logp, _ = engine._logp(engine.model, b, entropy=False)
        with torch.no_grad():
            assert torch.allclose(logp * b.mask, _full_forward(engine, b)[0], atol=1e-5)


def test_the_trainers_own_logp_old_makes_the_step_whatever_the_sampler_reported() -> None:
    """One optimizer step with ``recompute_logp_old``: the loss's own forward is logp_old (no second pass), so a
    sampler off by 0.5 a token moves the weights exactly as an exact one does."""
    recomputing = run_spec(RUN, seed=1, train={"recompute_logp_old": True, "lr": 1e-2})
    model = build_model(RUN.model, TOK)
    after = []
    for noise in (0.0, 0.5):
        engine = PolicyEngine(recomputing, build_model(RUN.model, TOK))
        stats = engine.step(packed_batch(model, LENGTHS, sampler_noise=noise), lr=1e-2)
        assert abs(stats["logp_old_gap"] - noise) < 1e-4 and stats["clipped_fraction"] == 0.0
        after.append(engine.model.state_dict())
    for name, tensor in after[0].items():
        assert torch.equal(tensor, after[1][name]), name
    assert any(not torch.equal(t, model.state_dict()[n]) for n, t in after[0].items())


def test_each_minibatch_is_one_optimizer_step() -> None:
    for steps in (1, 2, 4):
        spec = run_spec(RUN, seed=1, train={"optimizer_steps": steps, "lr": 1e-2})
        engine = PolicyEngine(spec, build_model(RUN.model, TOK))
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.step(packed_batch(engine.model, LENGTHS), lr=1e-2)
        adam_steps = {int(s["step"]) for s in engine.optimizer.state.values()}
        assert adam_steps == {steps}
        assert any(not torch.equal(before[k], v) for k, v in engine.model.state_dict().items())


def test_recomputed_logp_old_replaces_a_sampler_that_is_off() -> None:
    model = build_model(RUN.model, TOK)
    # the sampler's numbers differ from the trainer's by 0.5 a token
    off = packed_batch(model, LENGTHS, sampler_noise=0.5)
    sampler = PolicyEngine(run_spec(RUN, seed=1), build_model(RUN.model, TOK)).step(off, lr=0.0)
    recomputing = run_spec(RUN, seed=1, train={"recompute_logp_old": True})
    own = PolicyEngine(recomputing, build_model(RUN.model, TOK)).step(off, lr=0.0)
    assert abs(own["logp_old_gap"] - 0.5) < 1e-4  # the gap it replaced
    assert own["clipped_fraction"] == 0.0 < sampler["clipped_fraction"]  # ratio 1 vs exp(-0.5) (below 1 - eps)


def test_published_weights_are_bf16_while_the_master_stays_fp32() -> None:
    spec = run_spec(RUN, seed=1)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": "bfloat16"})})
    engine = PolicyEngine(spec, build_model(spec.model, TOK))
    exported = engine.export_state()
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}


def test_gradient_accumulation_over_micro_batches_gives_the_same_step() -> None:
    whole = PolicyEngine(run_spec(RUN, seed=1, train={"lr": 1e-2}), build_model(RUN.model, TOK))
    micro = PolicyEngine(run_spec(RUN, seed=1, train={"lr": 1e-2, "micro_rows": 3}), build_model(RUN.model, TOK))
    for engine in (whole, micro):  # SGD: the weights move by the gradient itself (Adam's first step is its sign)
        engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=1e-2)
    batch = packed_batch(whole.model, LENGTHS)
    a, b = whole.step(batch, lr=1e-2), micro.step(batch, lr=1e-2)
    assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens"] == b["tokens"]
    for name, tensor in whole.model.state_dict().items():
        assert torch.allclose(tensor, micro.model.state_dict()[name], atol=1e-6), name
    assert any(
        not torch.equal(t, build_model(RUN.model, TOK).state_dict()[n]) for n, t in whole.model.state_dict().items()
    )


def test_a_model_stored_in_bf16_computes_exactly_as_its_fp32_upcast_in_half_the_memory() -> None:
    """The trainer's (and a validator's) judging copy is kept in the published dtype: it must give the very numbers
    an fp32 model holding the same published weights gives, or honest producers' proofs would be judged off."""
    from intellect_node.policy.model import load_weights, state_dict_for_export, stored_in

    published = state_dict_for_export(build_model(RUN.model, TOK, torch.float32), torch.bfloat16)
    reference = build_model(RUN.model, TOK, torch.float32)
    load_weights(reference, published)
    stored = stored_in(build_model(RUN.model, TOK, torch.float32), torch.bfloat16)
    load_weights(stored, published)
    assert {p.dtype for p in stored.parameters()} == {torch.bfloat16}
    size = sum(p.numel() * p.element_size() for p in stored.parameters())
    assert size * 2 == sum(p.numel() * p.element_size() for p in reference.parameters())
    batch = packed_batch(reference, LENGTHS)
    with torch.no_grad():
        want = reference(input_ids=batch.ids, attention_mask=batch.attention).logits
        got = stored(input_ids=batch.ids, attention_mask=batch.attention).logits
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert {p.dtype for p in stored.parameters()} == {torch.bfloat16}  # the fp32 copies were dropped
    with pytest.raises(IndexError):  # a forward that fails half-way leaves the weights stored as they were
        stored(input_ids=torch.tensor([[10**6]]))
    assert {p.dtype for p in stored.parameters()} == {torch.bfloat16}
