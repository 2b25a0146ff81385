"""The policy engine on the tiny model: minibatches are optimizer steps, the trainer's own logp_old, the logits
trimmed to the completion columns, and bf16 publishing from fp32 master weights."""

from __future__ import annotations

import pytest
import torch

from intellect_kernels.logprobs import token_logprobs
from intellect_node.policy.engine import PolicyEngine
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
