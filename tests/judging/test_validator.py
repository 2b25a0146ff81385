"""The validator on the tiny model: honest batches pass at every batch size; each way of cheating is caught
for the reason it should be (the detection benchmark does the same on SmolLM2, benchmarks/toploc_detect.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from intellect_node.config import RunConfig
from intellect_node.judging.validator import Validator, expected_proofs
from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt
from intellect_node.roles.inference import generate_batch
from intellect_protocol.messages import RolloutBatch, RunSpec
from tests.helpers.tiny import run_spec

RUN = RunConfig(sampling={"max_new_tokens": 12, "group_size": 4})  # type: ignore[arg-type]
NODE = "b" * 32


SPEC = run_spec(RUN, seed=11, task={"tasks_per_batch": 2})
TOK = build_tokenizer(SPEC.model)
MODEL = build_model(SPEC.model, TOK)
VALIDATOR = Validator(SPEC, TOK, copy.deepcopy(MODEL))


def _batch(index: int = 0, model: torch.nn.Module = MODEL, spec: RunSpec = SPEC, **sampling: object) -> RolloutBatch:
    return generate_batch(spec, model, TOK, NODE, 0, index, **sampling)


def _edit(batch: RolloutBatch, **changes: object) -> RolloutBatch:
    groups = [batch.groups[0].model_copy(update=changes), *batch.groups[1:]]
    return batch.model_copy(update={"groups": groups})


@pytest.mark.parametrize("tasks_per_batch", [1, 2, 8])
def test_honest_batches_pass_at_every_batch_size(tasks_per_batch: int) -> None:
    spec = run_spec(RUN, seed=11, task={"tasks_per_batch": tasks_per_batch})
    validator = Validator(spec, TOK, copy.deepcopy(MODEL))
    for index in range(3):
        finding = validator.check(_batch(index, spec=spec))
        assert finding.ok, (finding.reason, finding.detail)
        assert finding.completions == tasks_per_batch * spec.sampling.group_size
        assert min(finding.rederived) == 1.0


def test_greedy_and_another_temperature_fail_the_sampling_check() -> None:
    assert VALIDATOR.check(_batch(greedy=True)).reason == "sampling"
    assert VALIDATOR.check(_batch(draw_temperature=0.5)).reason == "sampling"


def test_a_token_edited_after_generation_is_caught() -> None:
    batch = _batch()
    completion = list(batch.groups[0].completions[0])
    middle = len(completion) // 2
    completion[middle] = (completion[middle] + 1) % len(SPEC.model.vocab)
    completions = [completion, *batch.groups[0].completions[1:]]
    assert VALIDATOR.check(_edit(batch, completions=completions)).reason in ("toploc", "sampling")


def test_perturbed_weights_and_another_model_fail_toploc() -> None:
    perturbed = copy.deepcopy(MODEL)
    with torch.no_grad():
        w = perturbed.model.layers[0].mlp.down_proj.weight
        w.add_(0.01 * w.abs() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    assert VALIDATOR.check(_batch(model=perturbed)).reason == "toploc"
    other = build_model(SPEC.model.model_copy(update={"init_seed": 99}), TOK)
    assert VALIDATOR.check(_batch(model=other)).reason == "toploc"


def test_reward_task_termination_and_missing_proofs() -> None:
    batch = _batch()
    assert VALIDATOR.check(_edit(batch, rewards=[1.0] * 4)).reason == "reward_mismatch"
    other = generate_batch(SPEC, MODEL, TOK, NODE, 0, 5).groups[0]
    assert other.prompt_ids != batch.groups[0].prompt_ids
    assert VALIDATOR.check(_edit(batch, prompt_ids=other.prompt_ids)).reason == "unassigned_task"
    # a completion stopped early without EOS: drop the EOS (or, if none, all but the first token)
    short = [c[:-1] if len(c) > 1 else c for c in batch.groups[0].completions]
    assert short != batch.groups[0].completions and all(len(c) < 12 for c in short)
    logprobs = [lp[: len(c)] for lp, c in zip(batch.groups[0].logprobs, short, strict=True)]
    proofs = [
        ps[: expected_proofs(len(c), SPEC.verify.decode_batch)]
        for ps, c in zip(batch.groups[0].proofs, short, strict=True)
    ]
    cut = _edit(batch, completions=short, logprobs=logprobs, proofs=proofs, rewards=[])
    assert VALIDATOR.check(cut).reason == "termination"
    no_proofs = _edit(batch, proofs=[[] for _ in batch.groups[0].completions])
    assert VALIDATOR.check(no_proofs).reason == "bad_content"  # malformed: refused, not judged


def test_proofs_of_other_rollouts_and_made_up_logprobs_are_caught() -> None:
    batch, other = _batch(0), _batch(1)
    g0, g1 = batch.groups[0], other.groups[0]
    # borrow proofs of the same shape from another rollout
    borrowed = [
        next(p for p in (q for g in other.groups for q in g.proofs) if len(p) == len(mine))
        if any(len(q) == len(mine) for g in other.groups for q in g.proofs)
        else mine
        for mine in g0.proofs
    ]
    assert borrowed != g0.proofs and g1.proofs
    assert VALIDATOR.check(_edit(batch, proofs=borrowed)).reason == "toploc"
    # log-probs are GRPO's logp_old: a worker that shades them steers the update
    shaded = [[min(0.0, x + 0.5) for x in lp] for lp in g0.logprobs]
    assert VALIDATOR.check(_edit(batch, logprobs=shaded)).reason == "logprobs"
    assert encode_prompt(TOK, "1+1=")[0] == TOK.bos_token_id


def test_spot_checks_choose_an_unpredictable_share_and_catch_a_cheat_on_a_chosen_row() -> None:
    spec = run_spec(RUN, seed=11, task={"tasks_per_batch": 2}, verify={"check_fraction": 0.25})
    a = Validator(spec, TOK, copy.deepcopy(MODEL), secret=b"a" * 32)
    b = Validator(spec, TOK, copy.deepcopy(MODEL), secret=b"b" * 32)
    batch = generate_batch(spec, MODEL, TOK, NODE, 0, 0)
    n = sum(len(g.completions) for g in batch.groups)
    chosen = a.spot_check(batch, n)
    assert len(chosen) == 2 == len(set(chosen)) and chosen == a.spot_check(batch, n)  # 25% of 8, stable per key
    picks = {tuple(Validator(spec, TOK, MODEL, secret=bytes([i]) * 32).spot_check(batch, n)) for i in range(12)}
    assert len(picks) > 3  # another key, another choice: a worker cannot know which rows are checked
    finding = a.check(batch)
    assert finding.ok and len(finding.rederived) == 2  # only the chosen rows cost model time
    # one row sampled at another temperature: caught exactly by the validators whose draw includes it
    cheat = generate_batch(spec, MODEL, TOK, NODE, 0, 0, draw_temperature=0.3)
    rows = [c for g in batch.groups for c in g.completions]
    bad = [c for g in cheat.groups for c in g.completions]
    changed = {i for i in range(n) if rows[i] != bad[i]}
    for validator in (a, b):
        caught = validator.check(cheat).reason == "sampling"
        assert caught == bool(changed & set(validator.spot_check(cheat, n)))


def test_the_gate_admits_each_batch_once_in_order_and_one_at_a_time_per_node() -> None:
    from intellect_node.judging.validator import Gate
    from intellect_protocol.envelope import Rejected

    gate = Gate(async_level=2)
    first, second = _batch(0), _batch(1)

    def refusal(batch: RolloutBatch, step: int = 2) -> str:
        try:
            gate.check(batch, step)
        except Rejected as e:
            return e.reason
        return ""

    assert refusal(second) == "out_of_order"
    assert refusal(first) == ""
    gate.reserve(first)  # being checked: the same batch, or the node's next, must wait
    assert refusal(first) == refusal(second) == "busy"
    gate.release(first)  # refused after all: the node may send it again
    assert refusal(first) == ""
    gate.reserve(first)
    gate.admit(first)
    assert refusal(first) == "duplicate" and refusal(second) == ""
    assert refusal(first, step=3) == "stale_version"
    assert refusal(_batch(0), step=-1) == "future_version"


def test_a_cheating_batch_costs_the_validator_one_row_an_honest_one_every_row() -> None:
    """Validation starts with one row the worker cannot predict and stops at the first failing part, so a batch
    of bad rows costs one short forward pass; the benchmarks' exhaustive mode still measures every row."""
    spec = run_spec(RUN, seed=11, task={"tasks_per_batch": 4})
    validator = Validator(spec, TOK, copy.deepcopy(MODEL), secret=b"s" * 32)  # a fixed first row: deterministic
    honest = generate_batch(spec, MODEL, TOK, NODE, 0, 0)
    n = sum(len(g.completions) for g in honest.groups)
    assert validator.check(honest).ok and len(validator.check(honest).rederived) == n
    cheat = generate_batch(spec, MODEL, TOK, NODE, 0, 0, greedy=True)
    finding = validator.check(cheat)
    assert finding.reason == "sampling" and len(finding.rederived) == 1
    assert len(validator.check(cheat, exhaustive=True).rederived) == n


def test_an_fp16_run_proves_over_fp16_activations_and_catches_tampering() -> None:
    """GPUs without bf16 compute in fp16 (``model.compute_dtype = "float16"``): producer and validator then commit
    to fp16 activations, with the thresholds calibrated for them (node/configs/verify/tiny-float16.toml, which a run
    in fp16 takes)."""
    from intellect_node.config import load_run_config

    verify = load_run_config(None, ["model.compute_dtype=float16"]).verify
    spec = run_spec(RUN, seed=11, task={"tasks_per_batch": 2}, model={"compute_dtype": "float16"}, verify=verify)
    model = build_model(spec.model, TOK)
    assert next(model.parameters()).dtype == torch.float16
    validator = Validator(spec, TOK, copy.deepcopy(model))
    honest = _batch(model=model, spec=spec)
    assert validator.check(honest).ok
    perturbed = copy.deepcopy(model)  # every matrix of the last layer x (1 + 0.01 N(0, 1)), as calibrated
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in perturbed.model.layers[-1].parameters():
            if w.dim() == 2:
                w.copy_(w.float() * (1 + 0.01 * torch.randn(w.shape, generator=g)))
    assert validator.check(_batch(index=1, model=perturbed, spec=spec)).reason == "toploc"
    # a bf16 proof of the same rollout does not pass for an fp16 one
    bf16 = _batch(model=build_model(SPEC.model.model_copy(update={"compute_dtype": "bfloat16"}), TOK), spec=spec)
    assert validator.check(bf16).reason == "toploc"


def test_a_bf16_run_accepts_honest_rollouts_made_in_other_batch_shapes_and_refuses_another_model() -> None:
    """GPUs compute in bf16: a run with ``model.compute_dtype = "bfloat16"`` takes the thresholds calibrated for it
    (node/configs/verify/tiny-bfloat16.toml). Honest rollouts made one row at a time and all rows at once pass a
    validator that prefills them 16 at a time; a model of the same shape but other weights does not. (What bf16
    cannot tell from rounding, a 1% perturbation of one layer, is measured in docs/validation.md.)"""
    from intellect_node.config import load_run_config

    verify = load_run_config(None, ["model.compute_dtype=bfloat16"]).verify
    assert verify.max_mant_err_mean > RunConfig().verify.max_mant_err_mean  # not the fp32 thresholds
    spec = run_spec(RUN, seed=11, task={"tasks_per_batch": 4}, model={"compute_dtype": "bfloat16"}, verify=verify)
    model = build_model(spec.model, TOK)
    assert next(model.parameters()).dtype == torch.bfloat16
    validator = Validator(spec, TOK, copy.deepcopy(model))
    for index, rows in enumerate((1, None)):
        finding = validator.check(generate_batch(spec, model, TOK, NODE, 0, index, max_rows=rows), full=True)
        assert finding.ok, (finding.reason, finding.detail)
    other = build_model(spec.model.model_copy(update={"init_seed": 1}), TOK)
    assert validator.check(generate_batch(spec, other, TOK, NODE, 0, 2), full=True).reason in ("toploc", "sampling")


def test_truncating_samplers_are_caught_on_the_rows_they_change() -> None:
    """A cheater that draws with the run's seeds over the top-k tokens (or the top-p nucleus) only reports the full
    distribution's log-probs and agrees with the honest draw wherever that lies inside: only rows where it does not
    are refused, each by the sampling check."""
    honest_batch = _batch(index=5)
    assert VALIDATOR.check(honest_batch, exhaustive=True).ok
    honest = [c for g in honest_batch.groups for c in g.completions]
    for cheat in ({"draw_top_k": 14}, {"draw_top_p": 0.9}):  # the untrained model's 20 tokens: ~half the rows
        batch = _batch(index=5, **cheat)
        finding = VALIDATOR.check(batch, exhaustive=True)
        changed = [c != h for c, h in zip((c for g in batch.groups for c in g.completions), honest, strict=True)]
        assert any(changed) and not all(changed)
        refused = [bool(r) for r in finding.row_reasons]
        # refused only where it drew another token, and there unless the other token was a near-tie the run excuses
        assert any(refused) and all(c for c, r in zip(changed, refused, strict=True) if r)
        assert set(finding.row_reasons) - {""} == {"sampling"}


def test_rows_sharing_a_prompt_are_checked_on_its_keys_and_values_as_if_run_whole() -> None:
    """A group's samples share their prompt: the validator runs it once and the completions on top. Activations
    (in the proof dtype), logits and the verdict equal those of every row run whole, which it still does for a row
    alone."""
    batch = _batch(index=5)
    rows = [
        (g.slot, j, g.prompt_ids, c, g.proofs[j], g.logprobs[j])
        for g in batch.groups
        for j, c in enumerate(g.completions)
    ]
    assert len({tuple(r[2]) for r in rows}) == 2 < len(rows)
    with torch.no_grad():
        shared = VALIDATOR._forward(rows)
        whole = [VALIDATOR._forward([row])[0] for row in rows]  # one row: no prompt to share
    for (prompt_a, decode_a, logits_a), (prompt_b, decode_b, logits_b), row in zip(shared, whole, rows, strict=True):
        assert prompt_a.shape == (len(row[2]), MODEL.config.hidden_size) == prompt_b.shape
        assert decode_a.shape == (len(row[3]) - 1, MODEL.config.hidden_size) == decode_b.shape
        assert logits_a.shape == (len(row[3]), MODEL.config.vocab_size) == logits_b.shape
        assert torch.allclose(prompt_a.float(), prompt_b.float(), rtol=1e-2, atol=1e-2)  # bf16: 8 mantissa bits
        assert torch.allclose(decode_a.float(), decode_b.float(), rtol=1e-2, atol=1e-2)
        assert torch.allclose(logits_a, logits_b, atol=1e-4)
    finding = VALIDATOR.check(batch, full=True)
    assert finding.ok and finding.completions == len(rows) and min(finding.rederived) == 1.0
