"""A Hugging Face model by folder (``model.kind = "hf"``) goes through generation and validation like the tiny
one: a tiny Llama and its tokenizer saved with save_pretrained stand in for a downloaded checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from intellect_node.config import RunConfig
from intellect_node.judging.validator import Validator
from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt
from intellect_node.roles.inference import generate_batch
from intellect_protocol.messages import ModelSpec
from tests.helpers.tiny import run_spec


def test_a_model_folder_generates_verifiable_rollouts(tmp_path: Path) -> None:
    run = RunConfig()
    tok = build_tokenizer(run.model)
    tiny = build_model(run.model, tok)
    tiny.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    spec_model = ModelSpec(kind="hf", name=str(tmp_path / "m"), dtype="bfloat16", compute_dtype="float32")
    spec = run_spec(run, seed=3, model=spec_model)
    hf_tok = build_tokenizer(spec.model)
    model = build_model(spec.model, hf_tok)
    assert encode_prompt(hf_tok, "3+4=") == encode_prompt(tok, "3+4=")  # no chat template: BOS + text
    assert next(model.parameters()).dtype == torch.float32  # compute dtype
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor)
    batch = generate_batch(spec, model, hf_tok, "b" * 32, 0, 0)
    finding = Validator(spec, hf_tok, build_model(spec.model, hf_tok)).check(batch)
    assert finding.ok, (finding.reason, finding.detail)
    assert finding.completions == spec.task.tasks_per_batch * spec.sampling.group_size
