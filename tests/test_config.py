"""Shipped configs parse; overrides apply and are bounded; --help does not import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.config import NodeConfig, RunConfig, load_run_config, node_settings, parse_override, split_overrides

CONFIGS = sorted(
    p
    for p in (Path(__file__).resolve().parent.parent / "node" / "configs").glob("*.toml")
    if not p.name.startswith("verify-")
)
"""Run configs; ``verify-*.toml`` are [verify] sections measured by benchmarks/calibrate_validator.py, to copy
under [run.verify] (given as --config, they are refused: test below)."""


def test_configs_ship() -> None:
    assert CONFIGS, "node/configs/ holds the example run configs"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses(path: Path) -> None:
    assert isinstance(load_run_config(path), RunConfig)


def test_tiny_config_equals_the_defaults() -> None:
    assert load_run_config(Path(__file__).resolve().parent.parent / "node" / "configs" / "tiny.toml") == RunConfig()


def test_overrides() -> None:
    cfg = load_run_config(None, ["train.lr=1e-3", "train.async_level=0", "name=probe", "sampling.temperature=0.7"])
    assert cfg.train.lr == 1e-3 and cfg.train.async_level == 0 and cfg.name == "probe"
    assert cfg.sampling.temperature == 0.7
    assert parse_override("name=hello world") == ("name", "hello world")


@pytest.mark.parametrize("bad", ["train.lr=-1", "train.async_level=1000", "sampling.group_size=1", "train.nope=1"])
def test_out_of_bounds_override_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):  # pydantic.ValidationError for bounds, ValueError naming the key for typos
        load_run_config(None, [bad])


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom intellect_node.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "bootstrap" in out and out.strip().endswith("NO-TORCH")


def test_an_unknown_role_lists_the_roles_there_are() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "intellect_node.cli",
            "join",
            "--role",
            "trainer",
            "--peers",
            "/ip4/127.0.0.1/tcp/1",
            "--run-id",
            "0" * 32,
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "'inference', 'relay', 'validator'" in result.stderr


def test_spot_checks_require_the_trainer_to_recompute_log_probs() -> None:
    """With check_fraction < 1 most completions' reported log-probs are never checked: a run must not put them in
    the loss (a worker could bias its importance ratios)."""
    with pytest.raises(ValueError, match="recompute_logp_old"):
        RunConfig(verify={"check_fraction": 0.25})  # type: ignore[arg-type]
    ok = RunConfig(verify={"check_fraction": 0.25}, train={"recompute_logp_old": True})  # type: ignore[arg-type]
    assert ok.verify.check_fraction == 0.25


def test_inference_settings_are_the_nodes_not_the_runs() -> None:
    """``--set inference.backend=vllm`` picks this node's engine: never part of the signed run spec, checked
    (key and value) before any process starts."""
    run, node = split_overrides(["train.lr=1e-3", "inference.backend=vllm"])
    assert run == ["train.lr=1e-3"] and node == ["inference.backend=vllm"]
    assert load_run_config(None, ["train.lr=1e-3", "inference.backend=vllm"]).train.lr == 1e-3
    fields = node_settings(node, {"threads": 2})
    assert NodeConfig(**fields).inference.backend == "vllm"
    with pytest.raises(ValueError, match="unknown node setting inference.'bakend'"):
        node_settings(["inference.bakend=vllm"])
    with pytest.raises(ValueError, match="inference.backend"):
        node_settings(["inference.backend=vlm"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--set", "train.lr=1"], "that is a run setting"),
        (["--set", "inference.backend=fast"], "inference.backend"),
        pytest.param(  # the device check imports torch in the child: seconds
            ["--device", "gpu"], "expected auto, cpu, cuda or cuda:N", marks=pytest.mark.integration
        ),
    ],
)
def test_join_refuses_bad_node_settings_with_advice(argv: list[str], says: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "intellect_node.cli",
            "join",
            "--role",
            "inference",
            "--peers",
            "/ip4/127.0.0.1/tcp/1",
            "--run-id",
            "0" * 32,
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and says in result.stderr, result.stderr


def test_devices() -> None:
    import torch

    from intellect_node.policy.model import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="expected auto, cpu, cuda"):
        resolve_device("cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:0")


# ---- messages that say what to fix (issue 16) ---------------------------------------------------------


def test_settings_outside_run_are_refused_with_where_they_go(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlr = 1e-3\n")
    with pytest.raises(ValueError, match=r"\[train\] outside \[run\].*\[run\.train\]") as e:
        load_run_config(path)
    assert str(path) in str(e.value)


def test_a_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[run.train\nlr = \n")
    with pytest.raises(ValueError, match="not valid TOML") as e:
        load_run_config(path)
    assert str(path) in str(e.value)


def test_a_missing_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--config .*nope\.toml: no such file"):
        load_run_config(tmp_path / "nope.toml")


def test_max_new_tokens_past_the_models_positions_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sampling.max_new_tokens = 200 .* model.max_positions = 128"):
        load_run_config(None, ["sampling.max_new_tokens=200"])


def test_too_few_dataset_rows_for_held_out_names_the_setting(tmp_path: Path) -> None:
    from intellect_node.judging.tasks import task_source
    from intellect_protocol.messages import TaskSpec

    rows = tmp_path / "tasks.jsonl"
    rows.write_text(
        "".join(
            f'{{"problem_id": "p{i}", "prompt": "What is {i}+1?", "task_type": "verifiable_math", '
            f'"verification_info": "{{\\"ground_truth\\": \\"{i + 1}\\"}}"}}\n'
            for i in range(4)
        )
    )
    with pytest.raises(ValueError, match=r"task.held_out = 4 leaves none of the 4 usable rows.*--set task.held_out"):
        task_source(TaskSpec(family="dataset", source=str(rows), held_out=4))


def test_a_bad_data_dir_says_which_flag(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "intellect_node.cli",
            "join",
            "--role",
            "inference",
            "--peers",
            "/ip4/127.0.0.1/tcp/1",
            "--run-id",
            "0" * 32,
            "--data-dir",
            str(blocker / "node"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"--data-dir {blocker / 'node'}: cannot create or write files there" in result.stderr, result.stderr


@pytest.mark.integration
def test_a_p2p_port_in_use_is_named() -> None:
    import asyncio
    import socket

    from intellect_node.p2p.dht import Membership
    from intellect_node.p2p.metrics import Metrics
    from intellect_protocol.identity import Identity

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        key = Identity.generate()
        with pytest.raises(SystemExit, match=f"--p2p-port {port} is already in use"):
            asyncio.run(Membership(key, key.node_id, Metrics()).start("127.0.0.1", port, ["/ip4/127.0.0.1/tcp/1"]))


def test_id_prints_the_same_node_id_before_and_after_the_key_exists(tmp_path: Path) -> None:
    from intellect_node.p2p.keys import load_or_create

    cmd = [sys.executable, "-m", "intellect_node.cli", "id", "--data-dir", str(tmp_path / "v")]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    again = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert first == again == load_or_create(tmp_path / "v" / "node.key").node_id


def test_a_verify_fragment_given_as_a_run_config_is_refused() -> None:
    fragment = Path(__file__).resolve().parent.parent / "node" / "configs" / "verify-smollm2.toml"
    with pytest.raises(ValueError, match=r"\[verify\] outside \[run\].*\[run\.verify\]"):
        load_run_config(fragment)
