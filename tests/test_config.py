"""Shipped configs parse; overrides apply and are bounded; node flags are made from the fields; --help does not
import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from intellect_node.config import NodeConfig, RunConfig, load_run_config, node_settings, parse_override, split_overrides

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "node" / "configs").glob("*.toml"))
"""Run configs; ``verify/<model>-<dtype>.toml`` are [verify] sections measured by benchmarks/calibrate_validator.py,
the thresholds of every run of that model and compute dtype (given as --config, they are refused: test below)."""
CALIBRATIONS = sorted((CONFIGS[0].parent / "verify").glob("*.toml"))


def test_configs_ship() -> None:
    assert CONFIGS, "node/configs/ holds the example run configs"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses(path: Path) -> None:
    assert isinstance(load_run_config(path), RunConfig)


@pytest.mark.parametrize("path", CALIBRATIONS, ids=lambda p: p.name)
def test_a_run_of_a_calibrated_model_and_dtype_takes_its_thresholds(path: Path) -> None:
    import tomllib

    from intellect_protocol.messages import VerifySpec

    with open(path, "rb") as f:
        section = tomllib.load(f)["verify"]
    assert VerifySpec.model_validate(section)  # every key known, every value in bounds
    model, dtype = path.stem.split("-")
    kind = ["model.kind=tiny-llama"] if model == "tiny" else ["model.kind=hf", f"model.name={model}"]
    own = [f"model.compute_dtype={dtype}", "verify.check_fraction=1.0", "train.recompute_logp_old=true"]
    run = load_run_config(None, [*kind, *own])
    assert run.verify.model_dump() == {**VerifySpec().model_dump(), **section, "check_fraction": 1.0}


def test_a_run_in_bf16_without_calibrated_thresholds_is_refused_with_the_way_out() -> None:
    """The fp32 defaults would refuse every honest bf16 rollout and ban its producer."""
    hf = ["model.kind=hf", "model.name=/models/other", "model.compute_dtype=bfloat16"]
    with pytest.raises(ValueError, match=r"no verify thresholds were calibrated for '/models/other' computing in "):
        load_run_config(None, hf)
    some = [*hf, "verify.max_mant_err_mean=4.0", "verify.max_exp_mismatches=12"]
    with pytest.raises(ValueError, match="no verify thresholds were calibrated"):  # the rest would be fp32's
        load_run_config(None, some)
    rest = ["verify.max_mant_err_median=3", "verify.max_sampling_gap=0.7", "verify.min_rederived=0.8"]
    given = load_run_config(None, [*some, *rest, "verify.max_logprob_error=0.7", "train.recompute_logp_old=true"])
    assert (given.verify.max_mant_err_mean, given.verify.max_exp_mismatches) == (4.0, 12)  # the run's own


def test_loose_log_prob_thresholds_need_the_trainers_own_logp_old() -> None:
    """A bf16 calibration lets reported log-probs be 0.68 off (a factor of two in GRPO's ratio): such a run must not
    train on them."""
    bf16 = ["model.kind=hf", "model.name=smollm2", "model.compute_dtype=bfloat16", "verify.check_fraction=1.0"]
    with pytest.raises(ValueError, match=r"verify.max_logprob_error=0.684 .* set train.recompute_logp_old = true"):
        load_run_config(None, bf16)
    assert load_run_config(None, [*bf16, "train.recompute_logp_old=true"]).verify.max_logprob_error == 0.684
    assert load_run_config(None, ["model.compute_dtype=bfloat16"]).verify.max_logprob_error < 0.05  # tiny: allowed


def test_an_uncalibrated_model_in_fp32_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """Its run takes thresholds measured on the tiny model: the trainer's operator is told how to measure its own."""
    with caplog.at_level("WARNING", logger="intellect_node.config"):
        run = load_run_config(None, ["model.kind=hf", "model.name=/models/other"])
    assert run.verify.topk == 64
    assert "no verify thresholds were calibrated for '/models/other' computing in float32" in caplog.text
    assert "calibrate_validator.py" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="intellect_node.config"):
        load_run_config(None, ["model.kind=hf", "model.name=smollm2"])  # shipped: smollm2-float32.toml
    assert caplog.text == ""


def test_a_calibration_is_not_mixed_with_another_proof_shape() -> None:
    """Thresholds measured at one topk do not hold at another: a run changing it gives them all."""
    with pytest.raises(ValueError, match=r"verify.topk = 32: the calibrated thresholds .* measured at topk = 64"):
        load_run_config(None, ["model.compute_dtype=bfloat16", "verify.topk=32"])


def test_the_runs_own_verify_settings_win_over_the_calibration() -> None:
    run = load_run_config(
        None, ["model.compute_dtype=float16", "verify.max_mant_err_median=9", "verify.check_fraction=1.0"]
    )
    calibrated = load_run_config(None, ["model.compute_dtype=float16"]).verify
    assert run.verify.max_mant_err_median == 9 and run.verify.max_mant_err_mean == calibrated.max_mant_err_mean


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
    fragment = CALIBRATIONS[0]
    with pytest.raises(ValueError, match=r"\[verify\] outside \[run\].*\[run\.verify\]"):
        load_run_config(fragment)


# ---- one config tree: run settings declared once (protocol's RunSettings), node flags made from NodeConfig --------


def test_run_and_node_settings_do_not_share_a_key() -> None:
    """``--set`` tells them apart by the first key."""
    assert not set(RunConfig.model_fields) & set(NodeConfig.model_fields)


def test_the_spec_carries_every_run_setting() -> None:
    run = load_run_config(None, ["name=probe", "seed=9", "train.lr=0.01", "admission.policy=invite"])
    spec = run.spec("ab" * 16, created=2.0)
    assert {k: getattr(spec, k) for k in RunConfig.model_fields} == dict(run)
    assert (spec.run_id, spec.created, spec.epoch) == ("ab" * 16, 2.0, 0)


def test_set_reaches_node_settings_for_each_role() -> None:
    run, node = split_overrides(["threads=3", "checkpoint_every=5", "train.lr=0.01"])
    assert run == ["train.lr=0.01"] and node == ["threads=3", "checkpoint_every=5"]
    trainer = NodeConfig(**node_settings(node, {"threads": 1}, role="trainer"))
    assert (trainer.threads, trainer.checkpoint_every) == (3, 5)  # --set wins over a flag
    assert NodeConfig(**node_settings(["join_timeout_s=5", "relay=false"], role="volunteer")).relay is False
    with pytest.raises(
        ValueError,
        match=r"checkpoint_every: a trainer setting \(`intellect-node bootstrap`.*volunteer node's settings: .*join_t",
    ):
        node_settings(["checkpoint_every=5"], role="volunteer")
    with pytest.raises(
        ValueError,
        match=r"run_id: a volunteer setting \(`intellect-node join` takes it\); a trainer node's settings: .*stripes",
    ):
        node_settings(["run_id=" + "a" * 32], role="trainer")
    with pytest.raises(ValueError, match="threads"):
        node_settings(["threads=0"], role="trainer")


def test_an_unknown_key_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown setting 'thread'; run settings: admission, .*node settings: .*threads"
    ):
        split_overrides(["thread=2"])
    with pytest.raises(ValueError, match=r"unknown setting 'thread'"):
        load_run_config(None, ["thread=2"])


def _node(argv: list[str]) -> NodeConfig:
    from intellect_node.cli import build_parser, node_fields

    args = build_parser().parse_args(argv)
    return NodeConfig(**node_settings(split_overrides(args.overrides)[1], node_fields(args), role=args.node_role))


JOIN = ["join", "--role", "inference", "--peers", "/ip4/127.0.0.1/tcp/1", "--run-id", "a" * 32]


def test_node_flags_are_made_from_the_fields() -> None:
    from intellect_node.cli import build_parser
    from intellect_node.config import ROLE_SETTINGS

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices  # type: ignore[union-attr]
    for command, role in (("bootstrap", "trainer"), ("join", "volunteer")):
        dests = {a.dest.removeprefix("node.") for a in sub[command]._actions if a.dest.startswith("node.")}
        fields = {n for m in ROLE_SETTINGS[role] for n in m.model_fields if n != "inference"} | {"inference.backend"}
        assert dests == fields
    assert _node(["bootstrap"]) == NodeConfig()  # a flag not given: the field's default
    assert _node(JOIN).model_dump() == NodeConfig(peers=["/ip4/127.0.0.1/tcp/1"], run_id="a" * 32).model_dump()


def test_flags_keep_their_names_and_meaning(tmp_path: Path) -> None:
    boot = _node(
        ["bootstrap", "--shard-mb", "0.5", "--validator", "b" * 32, "--validator", "c" * 32, "--fresh"]
        + ["--checkpoint-every", "0", "--stripes", "2", "--invite-uses", "3", "--invite-days", "1.5"]
        + ["--backend", "vllm", "--threads", "2", "--data-dir", str(tmp_path), "--track", "wandb"]
    )
    assert boot.shard_bytes == 2**19 and boot.validators == ["b" * 32, "c" * 32] and boot.fresh
    assert (boot.checkpoint_every, boot.stripes, boot.invite_uses, boot.invite_days) == (0, 2, 3, 1.5)
    assert (boot.inference.backend, boot.threads, boot.data_dir, boot.track) == ("vllm", 2, tmp_path, "wandb")
    join = _node(JOIN + ["--no-relay", "--join-timeout", "5", "--invite", "x", "--set", "threads=4"])
    assert (join.relay, join.join_timeout_s, join.invite, join.threads) == (False, 5.0, "x", 4)


def test_help_shows_the_fields_defaults_and_bounds() -> None:
    from intellect_node.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices  # type: ignore[union-attr]
    text = " ".join(sub["bootstrap"].format_help().split())
    assert "--stripes STRIPES Trainer: stripes each version is split into" in text
    assert "(default 4; 1 to 64)" in text and "(in MB; default 64)" in text
