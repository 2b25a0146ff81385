"""Shipped configs parse; overrides apply and are bounded; --help does not import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.config import NodeConfig, RunConfig, load_run_config, node_settings, parse_override, split_overrides

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "node" / "configs").glob("*.toml"))


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
        [sys.executable, "-m", "intellect_node.cli", "join", "--role", "trainer", "--peers", "/ip4/127.0.0.1/tcp/1",
         "--run-id", "0" * 32],
        capture_output=True, text=True,
    )  # fmt: skip
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
        (["--device", "gpu"], "expected auto, cpu, cuda or cuda:N"),
    ],
)
def test_join_refuses_bad_node_settings_with_advice(argv: list[str], says: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "intellect_node.cli", "join", "--role", "inference", "--peers", "/ip4/127.0.0.1/tcp/1",
         "--run-id", "0" * 32, *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
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
