"""One typed config tree: the run (what the trainer signs into the RunSpec) and the node (this process).

The run: ``RunConfig`` is ``intellect_protocol.messages.RunSettings`` (each run setting's default, bounds and doc)
plus the checks a run must pass before it starts; ``RunConfig.spec`` adds what the trainer fills in at start and
gives the RunSpec. Loaded from a TOML file (``--config``; see ``node/configs/tiny.toml``) with dotted overrides
(``--set train.lr=1e-3``).

The node: ``NodeConfig``, its settings grouped by the roles that take them (``ROLE_SETTINGS``); the CLI makes its
flags from these fields (node/cli.py), and ``--set threads=2`` or ``--set inference.backend=vllm`` reaches them too.

Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import logging
import math
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from intellect_protocol.messages import SPECIAL_TOKENS, ModelSpec, RunSettings, RunSpec, VerifySpec, tiny_model

logger = logging.getLogger(__name__)


TRUSTED_LOGPROB_ERROR = 0.05
"""The largest ``verify.max_logprob_error`` under which a run may train on the producers' reported log-probs as
logp_old: a ratio off by at most 5%, within PPO's clip of 0.2. Calibrations in bf16 allow far more (SmolLM2 0.68:
a factor of two), so such runs must set ``train.recompute_logp_old``."""


class RunConfig(RunSettings):
    """The run a trainer starts: the run settings (their defaults, bounds and docs are RunSettings', in
    protocol/messages.py) and the checks a run must pass before it starts. It becomes the signed RunSpec every node
    follows."""

    model_config = ConfigDict(frozen=False)

    def spec(self, run_id: str, created: float = 0.0) -> RunSpec:
        """The signed-to-be RunSpec of this run under ``run_id`` (the trainer's key; any id for local use)."""
        return RunSpec(
            run_id=run_id, created=created, **{name: getattr(self, name) for name in RunSettings.model_fields}
        )

    @model_validator(mode="after")
    def _buildable(self) -> RunConfig:
        if self.verify.check_fraction < 1.0 and not self.train.recompute_logp_old:
            raise ValueError(
                f"verify.check_fraction={self.verify.check_fraction} leaves completions whose reported log-probs "
                "nobody checks, and they would reach the loss: set train.recompute_logp_old = true (the trainer "
                "takes logp_old from its own forward) or verify.check_fraction = 1.0"
            )
        if self.verify.max_logprob_error > TRUSTED_LOGPROB_ERROR and not self.train.recompute_logp_old:
            raise ValueError(
                f"verify.max_logprob_error={self.verify.max_logprob_error:g} lets a producer's reported log-probs "
                f"be off by that much (a factor of {math.exp(self.verify.max_logprob_error):.2f} in GRPO's ratio; "
                f"bf16 and fp16 calibrations allow it), and they would reach the loss: set "
                "train.recompute_logp_old = true (the trainer takes logp_old from its own forward)"
            )
        m = self.model
        if m.kind == "hf":
            if not m.name:
                raise ValueError("model.kind = 'hf' needs model.name: a local folder, a hub id, or 'smollm2'")
            return self
        if self.sampling.max_new_tokens >= m.max_positions:
            raise ValueError(
                f"sampling.max_new_tokens = {self.sampling.max_new_tokens} leaves no room for a prompt "
                f"in model.max_positions = {m.max_positions}: lower it, or raise "
                "model.max_positions"
            )
        if 2 * self.verify.topk > m.hidden_size:
            raise ValueError(
                f"verify.topk={self.verify.topk} exceeds half of model.hidden_size={m.hidden_size}: a "
                "proof over one decode step would commit to near-zero values too, whose bf16 bits are "
                "rounding noise (honest rollouts refused); lower verify.topk"
            )
        missing = [t for t in SPECIAL_TOKENS if t not in m.vocab]
        if missing:
            raise ValueError(f"model.vocab lacks {missing}")
        if len(set(m.vocab)) != len(m.vocab):
            raise ValueError("model.vocab repeats a token")
        if m.hidden_size % m.num_heads or m.num_heads % m.num_kv_heads:
            raise ValueError("model.hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self


def default_data_dir() -> Path:
    return Path(os.environ.get("INTELLECT_NODE_HOME", Path.home() / ".intellect-node"))


DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]{1,2})?)$"


class InferenceSettings(BaseModel):
    """Inference nodes: how rollouts are generated (``--set inference.backend=vllm``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    backend: Literal["transformers", "vllm", "auto"] = "transformers"
    """Inference: the generation engine. ``vllm`` needs vLLM installed (docs/inference.md); ``auto`` takes vLLM where
    it is installed and a CUDA device is present, transformers otherwise."""


class CommonSettings(BaseModel):
    """Every node: where it keeps its key and files, where it listens, whom it first contacts, what it computes on."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    data_dir: Path = Field(default_factory=default_data_dir)
    """Holds node.key (the identity) and downloaded or published checkpoints (default: $INTELLECT_NODE_HOME or
    ~/.intellect-node)."""
    fresh: bool = False
    """Start over: a trainer deletes this run key's checkpoints and weights and starts the run over; a volunteer
    deletes the weights it holds and fetches them again (its identity, and the trust it earned, stay)."""
    host: str = "127.0.0.1"
    """Address to listen on and announce (libp2p and HTTP). Use a public address to serve other machines."""
    announce: str | None = None
    """Address to announce instead of ``host`` (libp2p and HTTP): the public address of a router that forwards
    this node's ports, or of a machine listening on 0.0.0.0."""
    p2p_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """libp2p TCP port (0: any free port)."""
    http_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """HTTP port for weights, /health, /status and /metrics (0: any free port)."""
    peers: list[str] = []
    """Multiaddr of a DHT peer to join through, as `bootstrap` prints it (repeatable). A restarted trainer
    without one uses the peers it saved in its checkpoint."""
    threads: Annotated[int, Field(ge=1, le=1024)] = 1
    """torch threads for generation or training."""
    inference: InferenceSettings = InferenceSettings()
    device: Annotated[str, Field(pattern=DEVICE_PATTERN)] = "auto"
    """Where the transformers backend, the trainer's engine and the validator compute: ``cpu``, ``cuda`` or
    ``cuda:N``; ``auto`` takes the first CUDA device where one is present, else the CPU."""


class WeightSettings(BaseModel):
    """Every node: how it keeps the weight versions it holds and serves them to others (its place in the relay
    tree, node/weights/)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    relay_slots: Annotated[int, Field(ge=1, le=1024)] | None = None
    """How many downstream nodes may fetch from this node at once (its fan-out in its stripe's relay tree); by
    default, from its measured upload against the rate the swarm's uploads can carry (weights/stripes.py)."""
    upload_limit_mbps: Annotated[float, Field(gt=0)] | None = None
    """Cap on what the node uploads, in Mbit/s (none by default)."""
    keep_versions: Annotated[int, Field(ge=1, le=64)] | None = None
    """Weight versions kept on disk (default: the run's async_level + 1)."""
    max_disk_gb: Annotated[float, Field(gt=0)] | None = None
    """Disk budget for weights; older versions go first, the newest is always kept."""


class TrainerSettings(BaseModel):
    """The trainer's (``bootstrap``): how long it trains, how it checkpoints, tracks and publishes."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_steps: Annotated[int, Field(ge=0)] | None = None
    """Trainer: stop training after this many steps (the node keeps serving until stopped)."""
    checkpoint_every: Annotated[int, Field(ge=0)] = 1
    """Trainer: checkpoint every this many steps (0: never). A restarted trainer (the same --data-dir) resumes from
    its newest one; with N > 1 a crash loses up to N - 1 steps of training (version numbers still never repeat)."""
    track: Literal["none", "tensorboard", "wandb"] = "none"
    """Trainer: log every step's metrics to TensorBoard event files or a W&B run in offline mode."""
    track_dir: Path | None = None
    """Trainer: where tracking writes (default ``<data_dir>/tracking``)."""
    shard_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    """Trainer: the largest safetensors shard it writes."""
    validators: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = []
    """Trainer: a validator node whose signed verdicts it takes (repeatable; it validates itself when none
    answers)."""
    stripes: Annotated[int, Field(ge=1, le=64)] = 4
    """Trainer: stripes each version is split into, each spread by its own relay tree (1: a single tree;
    weights/stripes.py)."""
    invite_uses: Annotated[int, Field(ge=1, le=1_000_000)] = 100
    """Bootstrap of an invite-only run (``admission.policy = "invite"``): how many nodes the printed join line's
    invite admits."""
    invite_days: Annotated[float, Field(gt=0, le=3650)] = 7.0
    """Bootstrap of an invite-only run: how many days the printed invite is valid."""


JOIN_TIMEOUT_ENV = "INTELLECT_NODE_JOIN_TIMEOUT"
LEDGER_LOG_ENV = "INTELLECT_NODE_LEDGER_LOG"
"""Set to 1, the trainer logs a LEDGER line per accepted batch and per outcome of its groups (roles/trainer_state.py;
~110 KB a minute with two producers): what benchmarks/chaos.py and gossip.py add up. Off by default."""


def ledger_log_enabled() -> bool:
    return os.environ.get(LEDGER_LOG_ENV) == "1"


def distributed_rank() -> int:
    """This process's rank under torchrun ($RANK), 0 without it."""
    raw = os.environ.get("RANK", "0")
    return int(raw) if raw.isdigit() else 0


def _env_seconds(name: str, default: float) -> float:
    """A number of seconds (0 or more) from the environment variable ``name``, else ``default``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise SystemExit(f"intellect-node: ${name}={raw!r}: give a number of seconds, 0 or more (0: for ever)")
    return value


class VolunteerSettings(BaseModel):
    """A volunteer's (``join``: inference, relay, validator, auditor): which run it joins and how."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    run_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")] | None = None
    """The run to join, as `bootstrap` prints it; pins the run key, so a spec signed by any other key is ignored."""
    join_timeout_s: Annotated[float, Field(ge=0)] = Field(default_factory=lambda: _env_seconds(JOIN_TIMEOUT_ENV, 60.0))
    """Seconds `join` tries to reach the run (its peers, its record, the trainer) before giving up with advice; 0:
    for ever. Default: $INTELLECT_NODE_JOIN_TIMEOUT (the Docker image sets 0), else 60."""
    relay: bool = True
    """Serve the weights this node holds to other nodes (inference nodes; ``--no-relay`` turns it off)."""
    invite: Annotated[str, Field(max_length=1024)] | None = None
    """The invite (from the run's operator) a run with ``admission.policy = "invite"`` asks for."""
    credit_check_s: Annotated[float, Field(ge=0)] = 60.0
    """Seconds between an inference node's checks of its credit against the trainer's contribution ledger (its
    ``/status`` ``credit`` and the dashboard's credit card; ``intellect-node credit`` checks on demand); 0: never."""
    audit_every_s: Annotated[float, Field(gt=0)] = 600.0
    """Seconds between an auditor's replays of a training step (``join --role auditor``): each downloads the
    checkpoint the step started from (about 12 bytes a parameter) and runs one training step on this machine."""


class NodeConfig(VolunteerSettings, TrainerSettings, WeightSettings, CommonSettings):
    """This process: every node setting, grouped above by the roles that read them; the attributes stay flat
    (``node.threads``, ``node.checkpoint_every``) for the code that reads them."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


ROLE_SETTINGS: dict[str, tuple[type[BaseModel], ...]] = {
    "trainer": (CommonSettings, WeightSettings, TrainerSettings),
    "volunteer": (CommonSettings, WeightSettings, VolunteerSettings),
}
"""The node settings each kind of node takes: ``bootstrap``'s flags and ``--set`` keys, and ``join``'s."""
ROLE_COMMANDS = {"trainer": "bootstrap", "volunteer": "join"}


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {part} is not a section")
    node[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``train.lr=1e-3`` → ``("train.lr", 0.001)``; the value is read as TOML, else kept as a string."""
    if "=" not in item:
        raise ValueError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def _reject_unknown(tree: dict[str, Any], model: type[BaseModel], path: str = "", what: str = "run setting") -> None:
    """Wire schemas ignore unknown fields (forward compatibility); a config must not: a typo would be silent."""
    for key, value in tree.items():
        field = model.model_fields.get(key)
        if field is None:
            known = ", ".join(sorted(model.model_fields))
            raise ValueError(f"unknown {what} {path}{key!r}; known here: {known}")
        sub = field.annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            _reject_unknown(value, sub, f"{path}{key}.", what)


def _keys(models: tuple[type[BaseModel], ...]) -> list[str]:
    return sorted(name for model in models for name in model.model_fields)


def split_overrides(overrides: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(run settings, node settings) of ``--set`` items, told apart by their first key: ``train.lr=1e-3`` is the
    run's, ``threads=2`` and ``inference.backend=vllm`` this node's. A key that is neither is refused."""
    run: list[str] = []
    node: list[str] = []
    for item in overrides:
        key = parse_override(item)[0]
        top = key.split(".")[0]
        if top in NodeConfig.model_fields:
            node.append(item)
        elif top in RunConfig.model_fields:
            run.append(item)
        else:
            raise ValueError(
                f"--set {key}: unknown setting {top!r}; run settings: {', '.join(sorted(RunConfig.model_fields))}; "
                f"node settings: {', '.join(sorted(NodeConfig.model_fields))}"
            )
    return run, node


def node_settings(
    overrides: list[str] | tuple[str, ...], fields: dict[str, Any] | None = None, role: str | None = None
) -> dict[str, Any]:
    """``fields`` (NodeConfig's, from flags) with the node's ``--set`` items applied, keys and values checked
    before any process starts. ``role`` (a key of ROLE_SETTINGS) refuses the settings another kind of node takes."""
    tree: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (fields or {}).items()}
    allowed = _keys(ROLE_SETTINGS[role]) if role else sorted(NodeConfig.model_fields)
    touched: set[str] = set()
    for item in overrides:
        key, value = parse_override(item)
        top = key.split(".")[0]
        if top not in NodeConfig.model_fields:
            raise ValueError(f"--set {key}: not a node setting (node settings: {', '.join(allowed)})")
        if top not in allowed:
            owner = next(r for r, models in ROLE_SETTINGS.items() if top in _keys(models))
            raise ValueError(
                f"--set {key}: a {owner} setting (`intellect-node {ROLE_COMMANDS[owner]}` takes it); a {role} "
                f"node's settings: {', '.join(allowed)}"
            )
        _set_dotted(tree, key, value)
        touched.add(top)
    _reject_unknown({k: tree[k] for k in touched}, NodeConfig, what="node setting")
    NodeConfig(**{k: tree[k] for k in touched})  # values too; flags' values are checked with the whole config
    return tree


CALIBRATED = Path(__file__).resolve().parent / "configs" / "verify"
"""``<model>-<compute dtype>.toml``: a ``[verify]`` section from benchmarks/calibrate_validator.py for the built-in
tiny model (``tiny``) or SmolLM2 (``smollm2``) computing in that dtype."""
THRESHOLDS = (
    "topk",
    "decode_batch",
    "max_exp_mismatches",
    "max_mant_err_mean",
    "max_mant_err_median",
    "max_sampling_gap",
    "min_rederived",
    "max_logprob_error",
)
"""The verify settings a calibration measures under (topk, decode_batch) or chooses; the others (``check_fraction``,
``ban``, ...) are each run's choice."""
LIMITS = THRESHOLDS[2:]
"""The thresholds themselves: what a run computing in bf16 or fp16 without a shipped calibration must give."""


def calibrated_verify(kind: str, name: str, compute_dtype: str) -> dict[str, Any] | None:
    """The shipped thresholds for a model computing in ``compute_dtype``, or None where none were measured."""
    model = "tiny" if kind == "tiny-llama" else name
    path = CALIBRATED / f"{model}-{compute_dtype}.toml"
    if "/" in model or not path.is_file():
        return None
    with open(path, "rb") as f:
        section: dict[str, Any] = tomllib.load(f)["verify"]
    return {k: v for k, v in section.items() if k in THRESHOLDS}


def _with_calibrated_thresholds(tree: dict[str, Any]) -> None:
    """Fill ``tree["verify"]`` from the shipped calibration for the run's model and compute dtype, under the values
    the run gives itself. A run computing in bf16 or fp16 with neither is refused: the fp32 defaults would refuse
    every honest rollout (bf16's honest TOPLOC errors are ten times fp32's limits) and ban its producers."""
    if not isinstance(tree.get("model", {}), dict) or not isinstance(tree.get("verify", {}), dict):
        return  # refused by the validation that follows, with the field's name
    model = {**ModelSpec().model_dump(), **tree.get("model", {})}
    own = tree.get("verify", {})
    found = calibrated_verify(model["kind"], model["name"], model["compute_dtype"])
    if found is not None:
        shape = [k for k in ("topk", "decode_batch") if k in own and own[k] != found[k]]
        if shape and not all(k in own for k in LIMITS):
            raise ValueError(
                f"verify.{shape[0]} = {own[shape[0]]}: the calibrated thresholds of this model and dtype were measured "
                f"at {shape[0]} = {found[shape[0]]}; give every threshold for the new value ({', '.join(LIMITS)}; "
                "benchmarks/calibrate_validator.py measures them) or leave it"
            )
        tree["verify"] = {**found, **own}
    elif model["compute_dtype"] == "float32" and model["kind"] == "hf" and not all(k in own for k in LIMITS):
        logger.warning(
            "no verify thresholds were calibrated for %r computing in float32: its run takes the defaults, measured "
            "on the tiny model (topk %d); honest rollouts of another model may fail them, or cheats pass. Run "
            "benchmarks/calibrate_validator.py for it and put the [verify] section it prints under [run.verify]",
            model["name"],
            VerifySpec().topk,
        )
    elif model["compute_dtype"] != "float32" and not all(k in own for k in LIMITS):
        which = "the tiny model" if model["kind"] == "tiny-llama" else repr(model["name"])
        shipped = ", ".join(sorted(p.stem for p in CALIBRATED.glob("*.toml")))
        raise ValueError(
            f"no verify thresholds were calibrated for {which} computing in {model['compute_dtype']} (shipped: "
            f"{shipped}): run benchmarks/calibrate_validator.py for it and put the [verify] section it prints "
            "under [run.verify], or compute in float32"
        )


def load_run_config(path: Path | None, overrides: tuple[str, ...] | list[str] = ()) -> RunConfig:
    """The run a TOML file (or the defaults) and ``--set`` overrides describe; verify thresholds the run does not
    give come from the calibration shipped for its model and compute dtype (``calibrated_verify``)."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"--config {path}: no such file (node/configs/ has examples)") from None
        except IsADirectoryError:
            raise ValueError(f"--config {path}: a directory, not a TOML file") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: not valid TOML: {e}") from None
        outside = sorted(k for k in doc if k != "run")
        if outside:
            hint = [k for k in outside if k in RunConfig.model_fields]
            raise ValueError(
                f"--config {path}: {', '.join(f'[{k}]' if isinstance(doc[k], dict) else k for k in outside)} "
                "outside [run]: run settings go under [run], e.g. "
                + (f"[run.{hint[0]}]" if hint else "[run.train]")
                + " (see node/configs/tiny.toml)"
            )
        tree = doc.get("run", {})
    for item in split_overrides(overrides)[0]:  # node settings are the caller's to apply (node_settings)
        _set_dotted(tree, *parse_override(item))
    _reject_unknown(tree, RunConfig)
    if "model" in tree and "vocab" not in tree["model"] and tree["model"].get("kind", "tiny-llama") == "tiny-llama":
        tree["model"]["vocab"] = tiny_model().vocab
    _with_calibrated_thresholds(tree)
    return RunConfig.model_validate(tree)
