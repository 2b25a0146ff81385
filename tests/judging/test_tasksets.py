"""Task sets and rewards: real files (jsonl, parquet), real math-verify, real sandboxed subprocesses; no network."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from intellect_node.judging.tasks import Task, last_integer, length_shaped, load_task_source, reward
from intellect_node.judging.verifiers import run_code_tests, verify_math
from intellect_protocol.messages import TaskSpec
from intellect_protocol.tasks import assigned_task

NODE = "ab" * 16


def _rows() -> list[dict[str, object]]:
    """Rows in INTELLECT-2's shape: 6 math (solve rates 0.0 .. 1.0), 2 code, 4 bad ones."""
    rows: list[dict[str, object]] = []
    for i, rate in enumerate([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]):
        rows.append(
            {
                "problem_id": f"math-{i}",
                "task_type": "verifiable_math",
                "prompt": f"Compute {i} / 2. Put the answer in \\boxed{{}}.",
                "verification_info": json.dumps({"ground_truth": str(i / 2)}),
                "solve_rate_qwen_r1_distill_7b": rate,
            }
        )
    for i in range(2):
        rows.append(
            {
                "problem_id": f"code-{i}",
                "task_type": "verifiable_code",
                "prompt": "Read two integers and print their sum.",
                "verification_info": {
                    "language": "python",
                    "test_cases": [
                        {"type": "stdin_stdout", "input": "1 2\n", "output": "3\n"},
                        {"type": "stdin_stdout", "input": "5 5\n", "output": "10\n"},
                    ],
                },
                "solve_rate_qwen_r1_distill_7b": 0.5,
            }
        )
    rows.append({"problem_id": "bad-0", "task_type": "verifiable_math", "verification_info": "{}"})  # no prompt
    rows.append({"problem_id": "bad-1", "task_type": "verifiable_math", "prompt": "x", "verification_info": "{oops"})
    rows.append({"problem_id": "bad-2", "task_type": "verifiable_math", "prompt": "x", "verification_info": "{}"})
    rows.append(
        {
            "problem_id": "math-0",
            "task_type": "verifiable_math",
            "prompt": "again",  # duplicate id
            "verification_info": json.dumps({"ground_truth": "0"}),
        }
    )
    return rows


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows()) + "\nnot json at all\n")
    return path


def _spec(path: Path, **kw: object) -> TaskSpec:
    return TaskSpec(family="dataset", source=str(path), **{"held_out": 2, **kw})


def test_jsonl_loads_skips_and_counts_bad_rows(jsonl: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        source = load_task_source(_spec(jsonl))
    assert len(source) == 8 - 2 and len(source.held_out_tasks()) == 2
    warning = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warning) == 1 and "skipped=5 of=13" in warning[0]
    code = [
        t for t in source.held_out_tasks() + [source.assigned(0, NODE, 0, 0, s) for s in range(64)] if t.kind == "code"
    ]
    assert code and code[0].tests == (("1 2\n", "3\n"), ("5 5\n", "10\n"))


def test_parquet_loads_like_jsonl(tmp_path: Path, jsonl: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = _rows()
    for r in rows:  # parquet wants one type per column: verification_info as a JSON string, as INTELLECT-2 has it
        if isinstance(r["verification_info"], dict):
            r["verification_info"] = json.dumps(r["verification_info"])
    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    a, b = load_task_source(_spec(path)), load_task_source(_spec(jsonl))
    assert len(a) == len(b) == 6
    assert [t.id for t in a.held_out_tasks()] == [t.id for t in b.held_out_tasks()]
    assert a.assigned(3, NODE, 1, 2, 0) == b.assigned(3, NODE, 1, 2, 0)


def test_sha256_pin_refuses_another_file(jsonl: Path) -> None:
    digest = hashlib.sha256(jsonl.read_bytes()).hexdigest()
    assert len(load_task_source(_spec(jsonl, source_sha256=digest))) == 6
    jsonl.write_text(jsonl.read_text() + json.dumps(_rows()[0] | {"problem_id": "extra"}) + "\n")
    with pytest.raises(ValueError, match="every node must hold the same task set"):
        load_task_source(_spec(jsonl, source_sha256=digest))


def test_source_with_no_usable_rows_says_why(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x", "verification_info": "nope"}) + "\n")
    with pytest.raises(ValueError, match="no usable rows"):
        load_task_source(_spec(path, held_out=0))
    with pytest.raises(FileNotFoundError, match="every node needs"):
        load_task_source(_spec(tmp_path / "missing.jsonl"))


def test_assignment_is_deterministic_and_never_held_out(jsonl: Path) -> None:
    a, b = load_task_source(_spec(jsonl)), load_task_source(_spec(jsonl))
    held = {t.id for t in a.held_out_tasks()}
    seen = set()
    for slot in range(200):
        task = a.assigned(7, NODE, 3, 1, slot)
        assert task == b.assigned(7, NODE, 3, 1, slot)
        assert task.id not in held
        seen.add(task.id)
    assert len(seen) == len(a)  # every assignable task comes up


def test_pass_rate_filter(jsonl: Path) -> None:
    source = load_task_source(_spec(jsonl, min_pass_rate=0.3, max_pass_rate=0.7, held_out=1))
    tasks = source.held_out_tasks() + [source.assigned(0, NODE, 0, 0, s) for s in range(100)]
    rates = {t.pass_rate for t in tasks}
    assert rates == {0.4, 0.5, 0.6}  # 0.0, 0.2, 0.8, 1.0 never used
    with pytest.raises(ValueError, match="widen the range"):
        load_task_source(_spec(jsonl, min_pass_rate=0.9, max_pass_rate=0.95))


def test_rows_without_pass_rate_kept_only_for_the_full_range(tmp_path: Path) -> None:
    path = tmp_path / "norate.jsonl"
    rows = [
        {"prompt": f"p{i}", "task_type": "verifiable_math", "verification_info": {"ground_truth": str(i)}}
        for i in range(5)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert len(load_task_source(_spec(path, held_out=1))) == 4
    with pytest.raises(ValueError, match="widen the range"):
        load_task_source(_spec(path, held_out=1, max_pass_rate=0.9))


def test_addition_held_out_is_exact_and_disjoint() -> None:
    spec = TaskSpec(family="addition", digits=2, held_out=200)
    source = load_task_source(spec)
    held = source.held_out_tasks()
    held_prompts = {t.prompt for t in held}
    assert len(held) == 200 and len(held_prompts) == 200 and len(source) == 90 * 90 - 200
    for slot in range(3000):
        task = source.assigned(1, NODE, 0, slot // 8, slot % 8)
        assert task.prompt not in held_prompts
    t = held[0]
    a, b = (int(x) for x in t.prompt.removeprefix("What is ").split("?")[0].split(" + "))
    assert 10 <= a <= 99 and 10 <= b <= 99 and t.answer == str(a + b)
    assert t.prompt == f"What is {a} + {b}? Reply with just the number."
    assert [x.id for x in load_task_source(spec).held_out_tasks()] == [x.id for x in held]


def test_addition_rewards() -> None:
    spec = TaskSpec(family="addition")
    task = Task(prompt="What is 63 + 11? Reply with just the number.", kind="integer", answer="74")
    assert reward(task, "74", True, 2, spec) == 1.0
    assert reward(task, " 74.\n", True, 3, spec) == 1.0
    assert reward(task, "63 + 11 = 74", True, 6, spec) == 1.0
    assert reward(task, "75", True, 2, spec) == 0.0
    assert reward(task, "74.5", True, 3, spec) == 0.0
    assert reward(task, "74", False, 2, spec) == 0.0  # cut off
    assert last_integer("about 1,234 or -5") == -5 and last_integer("none") is None


def test_arithmetic_family_is_unchanged() -> None:
    spec = TaskSpec()
    source = load_task_source(spec)
    for slot in range(20):
        ours, theirs = source.assigned(0, NODE, 2, 1, slot), assigned_task(0, NODE, 2, 1, slot, spec.max_operand)
        assert (ours.prompt, ours.answer) == (theirs.prompt, theirs.answer)
    task = source.assigned(0, NODE, 0, 0, 0)
    wrong = str(int(task.answer) + 1)
    assert reward(task, task.answer, True, 2, spec) == 1.0
    assert reward(task, wrong, True, 2, spec) == 0.2 and reward(task, task.answer, False, 2, spec) == 0.0


def test_math_verify_off_the_main_thread() -> None:
    results: dict[str, bool] = {}

    def check() -> None:
        results["frac"] = verify_math("0.5", "So the answer is \\boxed{\\frac{1}{2}}.")
        results["plain"] = verify_math("\\frac{1}{2}", "The answer is \\boxed{0.5}")
        results["wrong"] = verify_math("0.5", "The answer is \\boxed{\\frac{1}{3}}")

    thread = threading.Thread(target=check)
    thread.start()
    thread.join(timeout=180)
    assert results == {"frac": True, "plain": True, "wrong": False}
    task = Task(prompt="", kind="math", answer="1/2")
    spec = TaskSpec(family="addition")  # any non-arithmetic family dispatches on task.kind
    assert reward(task, "\\boxed{0.5}", True, 5, spec) == 1.0 and reward(task, "\\boxed{0.5}", False, 5, spec) == 0.0


SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_code_correct_and_wrong() -> None:
    tests = (("1 2\n", "3\n"), ("5 5\n", "10"))
    spec = TaskSpec(family="addition")
    task = Task(prompt="", kind="code", tests=tests)
    assert reward(task, "Here you go:\n```python\nprint(0)\n```\nand better:\n" + SUM, True, 9, spec) == 1.0
    assert reward(task, "```python\nprint(3)\n```", True, 9, spec) == 0.5
    assert reward(task, "```python\nprint(-1)\n```", True, 9, spec) == 0.0
    assert reward(task, SUM, False, 9, spec) == 0.0


def test_code_infinite_loop_is_killed() -> None:
    start = time.monotonic()
    assert run_code_tests("while True:\n    pass\n", (("", "1"),), timeout_s=1.0, memory_mb=256) == 0.0
    assert time.monotonic() - start < 10


def test_code_memory_hog_is_stopped() -> None:
    hog = "x = bytearray(2 << 30)\nprint('ok')\n"
    assert run_code_tests(hog, (("", "ok"),), timeout_s=10.0, memory_mb=256) == 0.0
    assert run_code_tests("x = bytearray(1 << 20)\nprint('ok')\n", (("", "ok"),), 10.0, 256) == 1.0


def test_code_has_no_network() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.1)
        port = server.getsockname()[1]
        program = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "    print('connected')\n"
            "except OSError:\n"
            "    print('failed')\n"
        )
        assert run_code_tests(program, (("", "failed"),), timeout_s=10.0, memory_mb=256) == 1.0
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever reached the listener


def test_length_rewards() -> None:
    assert length_shaped(1.0, 500, None, "exact", 0.001) == 1.0  # no target: unshaped
    assert length_shaped(1.0, 900, 1000, "exact", 0.001) == pytest.approx(0.9)
    assert length_shaped(0.0, 1200, 1000, "exact", 0.001) == pytest.approx(-0.2)
    assert length_shaped(1.0, 1000, 1000, "max", 0.001) == pytest.approx(0.5)
    assert length_shaped(1.0, 100, 1000, "max", 0.001) == 1.0
    assert length_shaped(1.0, 1300, 1000, "max", 0.001) == pytest.approx(0.2)
    assert length_shaped(1.0, 2000, 1000, "max", 0.001) == 0.0
    assert length_shaped(1.0, 1000, 1000, "clip", 0.001) == 1.0 and length_shaped(1.0, 1001, 1000, "clip", 0.0) == 0.0


def test_target_length_in_prompt_and_reward() -> None:
    spec = TaskSpec(family="addition", length_reward="exact", target_tokens=[100, 200, 400], length_coef=0.001)
    source = load_task_source(spec)
    tasks = [source.assigned(0, NODE, 0, 0, s) for s in range(30)] + source.held_out_tasks()
    assert {t.target_tokens for t in tasks} == {100, 200, 400}
    t = tasks[0]
    assert t.prompt.endswith(f" Think for {t.target_tokens} tokens before giving a response.")
    assert t.target_tokens is not None
    assert reward(t, t.answer, True, t.target_tokens + 50, spec) == pytest.approx(0.95)
    clip = TaskSpec(family="addition", length_reward="clip", target_tokens=[8])
    c = load_task_source(clip).assigned(0, NODE, 0, 0, 0)
    assert "at most 8 tokens" in c.prompt
    assert reward(c, c.answer, True, 8, clip) == 1.0 and reward(c, c.answer, True, 9, clip) == 0.0


def test_spec_bounds() -> None:
    with pytest.raises(ValueError, match="needs a source"):
        TaskSpec(family="dataset")
    with pytest.raises(ValueError, match="needs target_tokens"):
        TaskSpec(family="addition", length_reward="max")
    with pytest.raises(ValueError, match="min_pass_rate"):
        TaskSpec(min_pass_rate=0.8, max_pass_rate=0.2)
    with pytest.raises(ValueError, match="lower held_out"):
        TaskSpec(family="addition", digits=1)


@pytest.mark.integration
def test_math_check_that_hangs_counts_as_wrong_and_the_helper_recovers() -> None:
    start = time.monotonic()
    assert not verify_math("1", "\\boxed{9^{9^{9^{9}}}}")  # a power too big to evaluate
    assert time.monotonic() - start < 30
    assert verify_math("2", "\\boxed{2}")


def test_hf_source_without_datasets_says_how_to_fix() -> None:
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed: loading would reach the network")
    with pytest.raises(RuntimeError, match="pip install datasets"):
        load_task_source(TaskSpec(family="dataset", source="hf:PrimeIntellect/INTELLECT-2-RL-Dataset"))
