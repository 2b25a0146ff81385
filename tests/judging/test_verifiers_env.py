"""The verifiers task family: the real verifiers 0.4.0, two small environments shaped like installed Hub ones
(tests/helpers/verifiers_envs), rewards computed in the real jail; no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.judging.tasks import load_task_source, reward, task_source
from intellect_protocol.messages import TaskSpec

ENVS = Path(__file__).resolve().parent.parent / "helpers" / "verifiers_envs"
SUMS = TaskSpec(family="verifiers", source="intellect-toy-sums", options={"num_tasks": 40}, held_out=10)
NODE = "ef" * 16


@pytest.fixture(autouse=True)
def _environments_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))


_DERIVE = """
import json, sys
from intellect_node.judging.tasks import load_task_source
from intellect_protocol.messages import TaskSpec
source = load_task_source(TaskSpec.model_validate_json(sys.argv[1]))
print(json.dumps([[t.id, t.prompt] for t in [source.assigned(1, "ef" * 16, 0, b, 0) for b in range(20)]]))
"""


@pytest.mark.integration  # seconds by design (another interpreter imports verifiers)
def test_rows_become_tasks_alike_on_every_node_and_held_out_ones_are_never_assigned() -> None:
    source = load_task_source(SUMS)
    held = {t.id for t in source.held_out_tasks()}
    assert len(held) == 10 and len(source) == 30
    drawn = [source.assigned(1, NODE, 0, b, 0) for b in range(20)]
    assert not {t.id for t in drawn} & held and len({t.id for t in drawn}) > 10
    assert drawn[0].prompt.startswith("Answer with the number only.\n\nWhat is ")  # system prompt, then the user's
    done = subprocess.run(
        [sys.executable, "-c", _DERIVE, SUMS.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ENVS)},
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[t.id, t.prompt] for t in drawn]


def test_the_environments_rewards_score_the_reply() -> None:
    task = task_source(SUMS).assigned(1, NODE, 0, 0, 0)
    a, b = (int(x) for x in task.prompt.rsplit("What is ", 1)[1].rstrip("?").split(" + "))
    assert task.answer == str(a + b)
    assert reward(task, task.answer, True, 2, SUMS) == 1.5  # exact (weight 1) and evaluates (weight 0.5)
    assert reward(task, f"{a}+{b}", True, 4, SUMS) == 0.5
    assert reward(task, str(a + b + 1), True, 2, SUMS) == 0.0
    assert reward(task, task.answer, False, 2, SUMS) == 0.0  # cut off: no answer


def test_a_reply_the_rubric_evaluates_runs_in_the_jail(tmp_path: Path) -> None:
    task = task_source(SUMS).assigned(1, NODE, 0, 1, 0)
    marker = tmp_path / "written-by-a-completion"
    hostile = (
        f"(__import__('os').makedirs({str(tmp_path)!r}, exist_ok=True), "
        f"open({str(marker)!r}, 'w').write('x'), {task.answer})[2]"
    )
    assert reward(task, hostile, True, 60, SUMS) == 0.5  # it ran: it evaluated to the sum
    assert not marker.exists()  # in the jail's own /tmp


def test_environments_this_node_cannot_score_are_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="reward tests_pass needs a runtime .*multi-turn and tool environments"):
        load_task_source(TaskSpec(family="verifiers", source="intellect-toy-tools", held_out=1))
    with pytest.raises(RuntimeError, match="'no-such-env' is not installed on this node .*install its package"):
        load_task_source(TaskSpec(family="verifiers", source="no-such-env"))
    with pytest.raises(ValueError, match="refused options .*fix task.options"):
        load_task_source(TaskSpec(family="verifiers", source="intellect-toy-sums", options={"num_taskz": 3}))
    with pytest.raises(ValueError, match="more than half"):
        load_task_source(TaskSpec(family="verifiers", source="intellect-toy-sums", options={"num_tasks": 4}))
