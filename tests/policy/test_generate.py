"""Sampling: well-formed completions, reproducible, and log-probs the trainer recomputes exactly (ratio 1)."""

from __future__ import annotations

import torch

from intellect_kernels.logprobs import token_logprobs
from intellect_node.config import RunConfig
from intellect_node.policy.engine import Group, pack_sequences
from intellect_node.policy.generate import sample_groups
from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt

RUN = RunConfig()
TOK = build_tokenizer(RUN.model)
MODEL = build_model(RUN.model, TOK)
EOS, PAD = int(TOK.eos_token_id), int(TOK.pad_token_id)
PROMPTS = [encode_prompt(TOK, p) for p in ("1+2=", "13+4=", "7+15=", "0+0=")]  # unequal lengths: left padding


def _sample(seed: int, temperature: float = 1.0, max_new: int = 8) -> list:
    seeds = [seed * 1000 + i for i in range(4 * len(PROMPTS))]
    return sample_groups(MODEL, PROMPTS, 4, max_new, temperature, EOS, PAD, seeds)


def test_tokenizer_round_trip() -> None:
    ids = TOK.encode("12+7=", add_special_tokens=False)
    assert len(ids) == 5 and TOK.decode(ids) == "12+7="
    assert encode_prompt(TOK, "1+1=")[0] == TOK.bos_token_id


def test_completions_are_well_formed() -> None:
    groups = _sample(0)
    assert len(groups) == len(PROMPTS) and all(len(g) == 4 for g in groups)
    for group in groups:
        for c in group:
            assert 1 <= len(c.tokens) <= 8 and len(c.logprobs) == len(c.tokens)
            assert EOS not in c.tokens[:-1]
            assert c.terminated == (c.tokens[-1] == EOS)
            assert all(lp <= 0.0 for lp in c.logprobs)


def test_sampling_is_reproducible_from_its_seed() -> None:
    a, b, c = _sample(1), _sample(1), _sample(2)
    tokens = lambda groups: [[x.tokens for x in g] for g in groups]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)


def test_trainer_recomputes_the_sampling_logprobs() -> None:
    """On-policy the trainer's ratio exp(logp - logp_old) must be 1: same positions, masks and temperature."""
    for temperature in (1.0, 0.7):
        groups = [
            Group("n" * 32, 0, prompt, [c.tokens for c in g], [c.logprobs for c in g], [0.0] * len(g))
            for prompt, g in zip(PROMPTS, _sample(3, temperature), strict=True)
        ]
        ids, attn, mask, logp_old = pack_sequences(groups, PAD)
        with torch.no_grad():
            logits = MODEL(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = token_logprobs(logits, ids[:, 1:], temperature)
        assert int(mask.sum()) == sum(len(c) for g in groups for c in g.completions)
        assert torch.allclose(logp * mask, logp_old * mask, atol=1e-4)


def test_the_transformers_backend_is_the_reference_sampler_behind_the_interface() -> None:
    """A backend row is exactly sample_groups' row for the same prompt and seed (proofs included), and
    load_weights swaps the policy it samples from."""
    from intellect_node.policy.backend import GenerationBackend, SamplingRequest, TransformersBackend
    from intellect_node.policy.generate import ProofSettings
    from intellect_node.policy.model import state_dict_for_export

    backend = TransformersBackend(build_model(RUN.model, TOK))
    assert isinstance(backend, GenerationBackend)
    backend.load_weights(state_dict_for_export(MODEL))
    request = SamplingRequest(8, 1.0, EOS, PAD, ProofSettings())
    seeds = [11, 12, 13, 14]
    rows = backend.generate(PROMPTS, seeds, request)
    reference = sample_groups(MODEL, PROMPTS, 1, 8, 1.0, EOS, PAD, seeds, proofs=ProofSettings())
    assert [(c.tokens, c.logprobs, c.proofs) for c in rows] == [
        (g[0].tokens, g[0].logprobs, g[0].proofs) for g in reference
    ]
    assert all(c.proofs for c in rows)
    other = build_model(RUN.model, TOK)  # random weights of another draw
    torch.manual_seed(1)
    for p in other.parameters():
        p.data.normal_(0, 0.5)
    backend.load_weights(state_dict_for_export(other))
    assert [c.tokens for c in backend.generate(PROMPTS, seeds, request)] != [c.tokens for c in rows]
