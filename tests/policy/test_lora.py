"""Low-rank adapters (train.lora_rank): only the adapters learn, version 0 is the base model, and the published
weights are the merged ones, which an ordinary model (a producer's, a validator's) loads and runs as the trainer's
adapted model does."""

from __future__ import annotations

import copy

import torch

from intellect_kernels.grpo import group_advantages
from intellect_node.config import RunConfig
from intellect_node.policy.engine import Group, Packed, PolicyEngine, pack_sequences
from intellect_node.policy.lora import merged_state
from intellect_node.policy.model import (
    build_model,
    build_tokenizer,
    encode_prompt,
    load_weights,
    state_dict_for_export,
)
from intellect_protocol.messages import RunSpec

RUN = RunConfig()
TOK = build_tokenizer(RUN.model)


def _batch(model: torch.nn.Module) -> Packed:
    """Two groups of four completions, rewarded 1 0 0 1; logp_old from ``model``."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for prompt in ("3+4=", "12+9="):
        ids = encode_prompt(TOK, prompt)
        completions = [torch.randint(3, len(RUN.model.vocab), (n,), generator=gen).tolist() for n in (2, 3, 4, 5)]
        groups.append(Group("b" * 32, 0, ids, completions, [[0.0] * len(c) for c in completions], [1.0, 0, 0, 1.0]))
    ids, attn, mask, _ = pack_sequences(groups, int(TOK.pad_token_id))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp_old = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) * mask
    return Packed(ids, attn, mask, logp_old, group_advantages(torch.tensor([g.rewards for g in groups])).flatten())


def _engine(rank: int = 4, seed: int = 1) -> PolicyEngine:
    spec = RunSpec(
        run_id="a" * 32,
        created=0.0,
        seed=seed,
        model=RUN.model,
        task=RUN.task,
        sampling=RUN.sampling,
        train=RUN.train.model_copy(update={"lora_rank": rank, "lr": 1e-2}),
        verify=RUN.verify,
    )
    return PolicyEngine(spec, build_model(RUN.model, TOK))


def test_only_the_adapters_learn_and_version_0_is_the_base_model() -> None:
    engine = _engine()
    base = state_dict_for_export(build_model(RUN.model, TOK))
    assert all(torch.equal(merged_state(engine.model, torch.float32)[k], v) for k, v in base.items())
    trained = [p for p in engine.model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in engine.model.parameters())
    assert 0 < sum(p.numel() for p in trained) < 0.2 * total
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.step(_batch(engine.model), lr=1e-2)
    after = engine.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(".lora_b") or k.endswith(".lora_a") for k in changed)
    assert len(engine.optimizer.state) == len(trained)  # no optimizer state for the frozen weights


def test_the_merged_weights_run_in_a_plain_model_as_the_adapted_one() -> None:
    engine = _engine()
    batch = _batch(engine.model)
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
    engine.step(_batch(engine.model), lr=1e-2)
    resumed = _engine(seed=7)
    resumed.load_state(copy.deepcopy(engine.state()))  # as a checkpoint holds it
    batch = _batch(engine.model)
    engine.step(batch, lr=1e-2)
    resumed.step(batch, lr=1e-2)
    assert all(
        torch.equal(a, b) for a, b in zip(engine.export_state().values(), resumed.export_state().values(), strict=True)
    )
