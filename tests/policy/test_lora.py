"""Low-rank adapters (train.lora_rank): only the adapters learn, version 0 is the base model, and the published
weights are the merged ones, which an ordinary model (a producer's, a validator's) loads and runs as the trainer's
adapted model does."""

from __future__ import annotations

import copy

import torch

from intellect_node.policy.engine import PolicyEngine
from intellect_node.policy.lora import merged_state
from intellect_node.policy.model import build_model, load_weights, state_dict_for_export
from tests.helpers.tiny import RUN, TOK, packed_batch, run_spec

LENGTHS = (2, 3, 4, 5)
"""The completions' lengths in each group of the batches here."""


def _engine(rank: int = 4, seed: int = 1) -> PolicyEngine:
    spec = run_spec(RUN, seed=seed, train={"lora_rank": rank, "lr": 1e-2})
    return PolicyEngine(spec, build_model(RUN.model, TOK))


def test_only_the_adapters_learn_and_version_0_is_the_base_model() -> None:
    engine = _engine()
    base = state_dict_for_export(build_model(RUN.model, TOK))
    assert all(torch.equal(merged_state(engine.model, torch.float32)[k], v) for k, v in base.items())
    trained = [p for p in engine.model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in engine.model.parameters())
    assert 0 < sum(p.numel() for p in trained) < 0.2 * total
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.step(packed_batch(engine.model, LENGTHS, logp_old="log_softmax"), lr=1e-2)
    after = engine.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(".lora_b") or k.endswith(".lora_a") for k in changed)
    assert len(engine.optimizer.state) == len(trained)  # no optimizer state for the frozen weights


def test_the_merged_weights_run_in_a_plain_model_as_the_adapted_one() -> None:
    engine = _engine()
    batch = packed_batch(engine.model, LENGTHS, logp_old="log_softmax")
    for _ in range(3):
        engine.step(batch, lr=1e-2)
    plain = build_model(RUN.model, TOK)
    merged = merged_state(engine.model, torch.float32)
    assert not any("lora" in k for k in merged)
    load_weights(plain, merged)
    with torch.no_grad():
        want = engine.model(input_ids=batch.ids, attention_mask=batch.attention).logits
        got = plain(input_ids=batch.ids, attention_mask=batch.attention).logits
        base = build_model(RUN.model, TOK)(input_ids=batch.ids, attention_mask=batch.attention).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert (want - base).abs().max() > 1e-3  # and the adapters did change the policy
    exported = engine.export_state()  # the published dtype
    assert set(exported) == set(merged) and {t.dtype for t in exported.values()} == {torch.float32}


def test_a_resumed_trainer_rebuilds_the_same_adapters_and_state() -> None:
    engine = _engine(seed=7)
    engine.step(packed_batch(engine.model, LENGTHS, logp_old="log_softmax"), lr=1e-2)
    resumed = _engine(seed=7)
    resumed.load_state(copy.deepcopy(engine.state()))  # as a checkpoint holds it
    batch = packed_batch(engine.model, LENGTHS, logp_old="log_softmax")
    engine.step(batch, lr=1e-2)
    resumed.step(batch, lr=1e-2)
    assert all(
        torch.equal(a, b) for a, b in zip(engine.export_state().values(), resumed.export_state().values(), strict=True)
    )
