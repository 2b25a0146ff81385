"""Shipped configs parse; overrides apply and are bounded; --help does not import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.config import RunConfig, load_run_config, parse_override

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
