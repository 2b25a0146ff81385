"""The reasoning_gym task family: the real reasoning-gym package, its scorers in the real jail; no network."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from intellect_node.config import load_run_config
from intellect_node.judging.families.reasoning_gym import read_answer
from intellect_node.judging.tasks import load_task_source, reward, task_source
from intellect_protocol.messages import TaskSpec

NODE = "cd" * 16
CHAIN_SUM = TaskSpec(
    family="reasoning_gym",
    source="chain_sum",
    options={"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 2, "size": 5000},
    answer_format="number",
    held_out=100,
)

_DERIVE = """
import json, random, sys
random.seed(int(sys.argv[1]))  # another global RNG state: tasks must not depend on it
from intellect_node.judging.tasks import load_task_source, reward
from intellect_protocol.messages import TaskSpec
spec = TaskSpec.model_validate_json(sys.argv[2])
source = load_task_source(spec)
tasks = [source.assigned(7, "cd" * 16, v, b, s) for v in range(3) for b in range(3) for s in range(4)]
out = {
    "assigned": [[t.id, t.prompt, t.answer] for t in tasks],
    "held_out": [t.id for t in source.held_out_tasks()],
    "scores": [[reward(t, t.answer, True, 4, spec), reward(t, "The answer is 1000.", True, 4, spec)] for t in tasks],
}
print(json.dumps(out))
"""


def _derive_in_a_process(spec: TaskSpec, rng_seed: int) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _DERIVE, str(rng_seed), spec.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.integration  # seconds by design (two more interpreters import reasoning-gym)
def test_two_processes_derive_the_same_tasks_and_scores() -> None:
    first = _derive_in_a_process(CHAIN_SUM, 1)
    second = _derive_in_a_process(CHAIN_SUM, 2)
    assert first == second
    assigned = first["assigned"]
    assert isinstance(assigned, list) and len({row[0] for row in assigned}) > 30  # distinct problems
    scores = first["scores"]
    assert isinstance(scores, list) and all(right == 1.0 for right, _ in scores)
    assert any(wrong == 0.0 for _, wrong in scores)


def test_held_out_problems_are_never_assigned() -> None:
    source = load_task_source(CHAIN_SUM)
    held = {t.id for t in source.held_out_tasks()}
    assert len(held) == 100 and len(source) == 5000 - 100
    drawn = {source.assigned(3, NODE, v, b, 0).id for v in range(40) for b in range(50)}
    assert len(drawn) > 1000 and not drawn & held
    prompt = source.held_out_tasks()[0].prompt
    assert prompt.startswith("State the final answer") and prompt.endswith("Reply with just the number.")


def test_the_datasets_scorer_decides_and_a_cut_off_answer_scores_zero() -> None:
    task = task_source(CHAIN_SUM).assigned(0, NODE, 1, 0, 0)
    answer = int(task.answer)
    assert reward(task, f"{task.answer}", True, 3, CHAIN_SUM) == 1.0
    assert reward(task, f"The three numbers make {answer}.", True, 8, CHAIN_SUM) == 1.0
    assert reward(task, f"{answer + 1}", True, 3, CHAIN_SUM) == 0.0
    assert reward(task, f"{task.answer}", False, 3, CHAIN_SUM) == 0.0  # not terminated
    assert reward(task, "no idea", True, 3, CHAIN_SUM) == 0.0
    plain = CHAIN_SUM.model_copy(update={"answer_format": "plain"})
    # plain reads the last line as the answer; chain_sum's scorer gives partial credit when it contains the sum
    partial = reward(task, f"x = {task.answer}", True, 3, plain)
    assert 0.0 < partial < 1.0
    tags = CHAIN_SUM.model_copy(update={"answer_format": "tags"})
    assert reward(task, f"so <answer>{task.answer}</answer>", True, 3, tags) == 1.0
    assert reward(task, f"{task.answer}", True, 3, tags) == 0.0


def test_the_shipped_harder_task_is_sums_of_three_numbers() -> None:
    """node/configs/smollm2-sum3.toml, the learning benchmark's harder task (docs/training.md): three terms from 0
    to 10, added; the dataset's scorer gives 1 to the sum as the reply's last number and 0 to anything else."""
    config = Path(__file__).resolve().parents[2] / "node" / "configs" / "smollm2-sum3.toml"
    spec = load_run_config(config).spec("f" * 32).task
    source = load_task_source(spec)
    held = {t.id for t in source.held_out_tasks()}
    assert len(held) == 200
    for batch in range(20):
        task = source.assigned(0, NODE, 1, batch, 0)
        assert task.id not in held
        question = task.prompt.split("Reply with just the number.")[0]
        terms = [int(x) for x in re.findall(r"-?\d+", question)]
        assert len(terms) == 3 and all(0 <= x <= 10 for x in terms) and "-" not in question
        assert int(task.answer) == sum(terms)
        assert reward(task, f"The sum is {task.answer}.", True, 6, spec) == 1.0
        assert reward(task, f"{sum(terms) + 1}", True, 3, spec) == 0.0


def test_answer_reading() -> None:
    assert read_answer("first\n\n 42. \n", "plain") == "42"
    assert read_answer("   \n", "plain") is None
    assert read_answer("3 + 4 = 7, then -2.5", "number") == "-2.5"
    assert read_answer("no numbers", "number") is None
    assert read_answer("<answer> a </answer> and <answer>b</answer>", "tags") == "b"


def test_an_answer_the_scorer_evaluates_runs_in_the_jail(tmp_path: Path) -> None:
    """string_insertion's scorer calls eval() on the answer: the completion's code runs, and only in the jail."""
    spec = TaskSpec(family="reasoning_gym", source="string_insertion", options={"size": 1000}, held_out=10)
    task = task_source(spec).assigned(0, NODE, 0, 0, 0)
    marker = tmp_path / "written-by-a-completion"
    hostile = (
        f"(__import__('os').makedirs({str(tmp_path)!r}, exist_ok=True), "
        f"__import__('pathlib').Path({str(marker)!r}).write_text('x'), list({task.answer!r}))[2]"
    )
    # the scorer gives 0.1 for a list of the right characters: the code ran (in the jail, where /tmp is its own)
    assert reward(task, hostile, True, 50, spec) == pytest.approx(0.1)
    assert not marker.exists()


def test_bad_run_specs_say_how_to_fix_them() -> None:
    with pytest.raises(ValueError, match="has no dataset 'no_such_task'; its datasets: .*chain_sum"):
        load_task_source(TaskSpec(family="reasoning_gym", source="no_such_task"))
    with pytest.raises(ValueError, match="fields of its config class"):
        load_task_source(TaskSpec(family="reasoning_gym", source="chain_sum", options={"min_termz": 3}))
    with pytest.raises(ValueError, match="cannot generate problems .*fix task.options"):
        bad = {"operators": ["+", "-"], "min_terms": 2, "max_terms": 2}  # operators_weights keeps 3 entries
        load_task_source(TaskSpec(family="reasoning_gym", source="simple_equations", options=bad))
    with pytest.raises(ValueError, match="more than half"):
        load_task_source(TaskSpec(family="reasoning_gym", source="chain_sum", options={"size": 100}, held_out=60))
    with pytest.raises(ValueError, match="options.size"):
        load_task_source(TaskSpec(family="reasoning_gym", source="chain_sum", options={"size": 0}))
    with pytest.raises(ValidationError, match="cannot set seed"):
        TaskSpec(family="reasoning_gym", source="chain_sum", options={"seed": 1})
    with pytest.raises(ValidationError, match="reasoning-gym dataset name"):
        TaskSpec(family="reasoning_gym", source="../etc/passwd")
