"""The task family seam: a family defined here and nowhere else (one class, one entry in ``FAMILIES``) is derived,
scored and validated like a built-in one; a family a node does not have is refused with a clear error."""

from __future__ import annotations

import copy

import pytest

from intellect_node.config import RunConfig
from intellect_node.judging.families.base import Task, TaskFamily, TaskSet
from intellect_node.judging.tasks import FAMILIES, load_task_source, needs_jail, require_jail, reward, task_source
from intellect_node.judging.validator import Validator
from intellect_node.policy.model import build_model, build_tokenizer, encode_prompt
from intellect_node.roles.inference import generate_batch
from intellect_protocol.messages import RunSpec, TaskSpec

NODE = "cd" * 16
WORDS = 10**4


class Reverse(TaskFamily):
    """Reverse a four-letter word over the demo's alphabet (digits), so the tiny character-level model can be asked
    it: "0427=" -> "7240". The first ``held_out`` words are kept for evaluation."""

    def load(self, spec: TaskSpec) -> TaskSet:
        held = min(spec.held_out, WORDS // 2)

        def task(index: int) -> Task:
            word = f"{index:04d}"
            return Task(prompt=f"{word}=", kind="reverse", answer=word[::-1], id=f"reverse/{word}")

        return TaskSet(lambda seed: task(held + seed % (WORDS - held)), WORDS - held, [task(i) for i in range(held)])

    def score(self, task: Task, text: str, spec: TaskSpec) -> float:
        return 1.0 if text == task.answer else 0.0

    def exact_reward(self, task: Task) -> bool:
        return True


@pytest.fixture(autouse=True)
def reverse_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FAMILIES, "reverse", Reverse())  # the one line a real family adds to FAMILIES


def test_a_registered_family_derives_its_tasks_deterministically_and_never_assigns_held_out_ones() -> None:
    spec = TaskSpec(family="reverse", held_out=3)
    a, b = load_task_source(spec), load_task_source(spec)
    held = {t.id for t in a.held_out_tasks()}
    assert held == {"reverse/0000", "reverse/0001", "reverse/0002"} and len(a) == WORDS - 3
    for slot in range(100):
        task = a.assigned(5, NODE, 1, 2, slot)
        assert task == b.assigned(5, NODE, 1, 2, slot) and task.id not in held
        assert task.answer == task.prompt.removesuffix("=")[::-1]
    assert len({a.assigned(5, NODE, 1, 2, s).id for s in range(100)}) > 90  # the seed, not the slot order, decides


def test_a_registered_family_scores_completions_with_termination_and_length_shaping() -> None:
    spec = TaskSpec(family="reverse")
    task = load_task_source(spec).assigned(0, NODE, 0, 0, 0)
    assert reward(task, task.answer, True, 5, spec) == 1.0
    assert reward(task, task.prompt, True, 5, spec) == 0.0
    assert reward(task, task.answer, False, 5, spec) == 0.0  # cut off: no end of sequence
    clip = TaskSpec(family="reverse", length_reward="clip", target_tokens=[4])
    shaped = load_task_source(clip).assigned(0, NODE, 0, 0, 0)
    assert shaped.prompt.endswith(" Think for at most 4 tokens before giving a response.")
    assert reward(shaped, shaped.answer, True, 4, clip) == 1.0 and reward(shaped, shaped.answer, True, 5, clip) == 0.0
    assert not needs_jail(spec)
    require_jail(spec)  # needs none: starts anywhere


def test_the_validator_checks_a_registered_familys_batches() -> None:
    run = RunConfig(sampling={"max_new_tokens": 6, "group_size": 2})  # type: ignore[arg-type]
    spec = RunSpec(
        run_id="a" * 32,
        created=0.0,
        seed=3,
        model=run.model,
        task=TaskSpec(family="reverse", tasks_per_batch=2),
        sampling=run.sampling,
        train=run.train,
        verify=run.verify,
    )
    tokenizer = build_tokenizer(spec.model)
    model = build_model(spec.model, tokenizer)
    validator = Validator(spec, tokenizer, copy.deepcopy(model))
    batch = generate_batch(spec, model, tokenizer, NODE, 0, 0)
    for g in batch.groups:
        task = task_source(spec.task).assigned(spec.seed, NODE, 0, 0, g.slot)
        assert validator.task(batch, g.slot) == task and g.prompt_ids == encode_prompt(tokenizer, task.prompt)
    validator.check_shape(batch)
    finding = validator.check(batch)
    assert finding.ok, (finding.reason, finding.detail)
    # the family says its reward is exact: a reported reward that differs from the recomputed one is refused
    reported = [r + 0.5 for r in batch.groups[0].rewards]
    forged = [batch.groups[0].model_copy(update={"rewards": reported}), *batch.groups[1:]]
    assert validator.check(batch.model_copy(update={"groups": forged})).reason == "reward_mismatch"
    other = generate_batch(spec, model, tokenizer, NODE, 0, 1).groups[0]
    assert other.prompt_ids != batch.groups[0].prompt_ids
    moved = [batch.groups[0].model_copy(update={"prompt_ids": other.prompt_ids}), *batch.groups[1:]]
    assert validator.check(batch.model_copy(update={"groups": moved})).reason == "unassigned_task"


def test_a_family_this_node_does_not_have_is_refused_saying_which_it_knows() -> None:
    spec = TaskSpec(family="no_such_family")  # the wire accepts any short name: the node decides
    with pytest.raises(ValueError, match=r"'no_such_family' is not one this node knows \(addition, arithmetic"):
        load_task_source(spec)
    with pytest.raises(ValueError, match="not one this node knows"):
        require_jail(spec)
    with pytest.raises(ValueError, match="pattern"):
        TaskSpec(family="Not A Name")
