"""Replaying a training step to check the weights the trainer published came from what its ledger says it consumed.

A ledger entry (protocol/ledger.py) names what the step that produced version ``v`` consumed: the batches, the
groups in packing order, the hash of the training settings. ``replay`` takes the engine state of step ``v - 1``
(the trainer's checkpoint: fp32 weights and optimizer), checks that the published version is the one the entry
names (the manifest's digest of the weights), the batch bodies the entry names (the checkpoint's and the
spool's envelopes, each checked against its producer's signature and the entry's digest), recomputes every reward
from the completions (never the trainer's numbers), runs the trainer's own step function (trainer_learner.grpo_step)
and compares the result with the published, signed version ``v``: the largest difference of any weight against the
largest change the step made to any (``AUDIT_TOLERANCE``). A trainer that trained on other data, skipped a batch
or changed a hyper-parameter lands far from the replay (tests/roles/test_audit.py plays each).

``intellect-node audit --data-dir <trainer data dir>`` replays the newest step (``--version`` another one still
held: the trainer keeps its last two checkpoints). It runs where the checkpoint is: the trainer's machine, or a
copy of its data dir. Serving checkpoints and batch bodies to an auditor node over the network is not built.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from intellect_node.judging.tasks import require_jail, task_source
from intellect_node.judging.validator import task_reward
from intellect_node.p2p.keys import load_or_create
from intellect_node.policy.engine import Group, local_engine
from intellect_node.policy.model import build_tokenizer
from intellect_node.roles.trainer_checkpoint import CheckpointDir
from intellect_node.roles.trainer_learner import grpo_step
from intellect_node.roles.trainer_ledger import LedgerLog
from intellect_node.roles.trainer_validation import judged_group
from intellect_node.weights.files import MANIFEST_NAME, load_checkpoint, sha256_file, verify_manifest
from intellect_protocol.envelope import Rejected, open_signed
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import LedgerEntry, train_hash
from intellect_protocol.messages import Manifest, RolloutBatch, RunSpec

logger = logging.getLogger(__name__)
AUDIT_TOLERANCE = 0.01
"""A replay agrees with the published version when no weight differs by more than this share of the largest change
the step made to any weight. Measured on this CPU with the tiny model (fp32 weights): a replay in another process,
with 1 or 2 threads, differs from the trainer by exactly 0; a trainer that trained one group on other completions,
skipped a batch, or tripled the learning rate lands at 0.67-1.6 of the step's largest change (two runs). Not
measured: replays on another CPU or a GPU, and runs that publish bf16 weights (where one rounding flip is a whole
bf16 step of a weight): the tolerance for those is open."""


class AuditError(Exception):
    """A step that cannot be replayed here (not a finding about the trainer): ``reason`` is countable."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class AuditFinding(AuditError):
    """What the trainer serves or signed contradicts itself before any replay (a checkpoint other than the one
    its ledger committed to, a run spec other than the signed one, an entry whose credits its groups do not
    add up to): the trainer is caught, with ``reason``."""


@dataclass(frozen=True)
class AuditResult:
    version: int
    epoch: int
    batches: int
    groups: int
    max_abs_diff: float
    """The largest difference between a replayed and a published weight."""
    update_max: float
    """The largest change the published version made to any weight of the previous one."""
    verdict: str
    """``honest`` (within AUDIT_TOLERANCE), or ``caught`` with ``reason``."""
    reason: str = ""
    state_diff: float | None = None
    """How far the replayed engine state (fp32 weights, optimizer moments) is from the checkpoint the trainer wrote
    after the step, relative to what the step changed (``state_gap``; honest within AUDIT_TOLERANCE), when that
    checkpoint was held and committed to (None: not compared)."""

    def line(self) -> str:
        state = "unchecked" if self.state_diff is None else f"{self.state_diff:.3g}"
        return (
            f"audit version={self.version} batches={self.batches} groups={self.groups} "
            f"max_abs_diff={self.max_abs_diff:.3g} update_max={self.update_max:.3g} state_diff={state} "
            f"verdict={self.verdict}" + (f" reason={self.reason}" if self.reason else "")
        )


def _entry(ledger: LedgerLog, version: int | None) -> LedgerEntry:
    """The entry of ``version`` in the newest epoch that has one (the newest entry when None)."""
    if not len(ledger):
        raise AuditError("no_entry", f"the ledger {ledger.path} is empty: no step to audit")
    for index in reversed(range(len(ledger))):
        entry = ledger.entry(index)
        if version is None or entry.version == version:
            return entry
    raise AuditError("no_entry", f"no ledger entry for version {version}")


def parent_entry(entries: list[LedgerEntry], entry: LedgerEntry) -> LedgerEntry | None:
    """The entry of the version ``entry``'s step started from (same epoch), if the ledger holds one."""
    for other in entries:
        if other.epoch == entry.epoch and other.version == entry.parent:
            return other
    return None


def load_state(path: Path, committed: str) -> dict[str, object]:
    """A checkpoint file, checked against the SHA-256 its ledger entry commits to (``committed``; empty: the entry
    names none, as for a checkpoint written before entries did). AuditError ``state`` when it differs."""
    if committed and sha256_file(path) != committed:
        raise AuditFinding(
            "state",
            f"the checkpoint {path.name} is not the one the ledger committed to when it was written "
            f"(SHA-256 {committed[:16]}...): the state the step starts from was changed afterwards",
        )
    return dict(torch.load(path, map_location="cpu", weights_only=True))


def _checkpoint(ckpt: CheckpointDir, step: int, committed: str = "") -> dict[str, object]:
    path = ckpt.root / f"step-{step:08d}.pt"
    if not path.exists():
        raise AuditError(
            "not_held",
            f"no checkpoint of step {step} (held: {ckpt.steps()}): a step is replayed from the one before it, and the "
            "trainer keeps its last two (checkpoint_every > 0)",
        )
    return load_state(path, committed)


def _groups(spec: RunSpec, entry: LedgerEntry, envelopes: dict[str, bytes], tokenizer: object) -> list[Group]:
    """The entry's groups in packing order, from the producers' signed batches, with rewards recomputed here."""
    credits = entry.credits()
    batches: dict[int, RolloutBatch] = {}
    for i, credit in enumerate(credits):
        data = envelopes.get(credit.digest)
        if data is None:
            raise AuditError("batch_not_held", f"batch {credit.digest[:16]}... of {credit.producer} is not held here")
        try:
            signed = open_signed(data, RolloutBatch)
        except Rejected as e:
            raise AuditError("bad_batch", f"batch {credit.digest[:16]}...: {e}") from None
        if signed.signer_id != credit.producer or signed.message.version != credit.made_on:
            raise AuditError("bad_batch", f"batch {credit.digest[:16]}... is not the one the entry credits")
        batches[i] = signed.message
    source = task_source(spec.task)
    eos = int(tokenizer.eos_token_id)  # type: ignore[attr-defined]
    out = []
    counted = [[0, 0] for _ in credits]
    places = list(zip(entry.group_batch, entry.group_slot, strict=True))
    if len(set(places)) != len(places):
        raise AuditFinding("credits", "the entry names one group twice: it would weigh it twice in the step")
    for index, slot in places:
        batch = batches[index]
        found = [g for g in batch.groups if g.slot == slot]
        if not found:
            raise AuditError("bad_entry", f"the entry names slot {slot} of a batch that has none")
        g = found[0]
        counted[index][0] += len(g.completions)
        counted[index][1] += sum(len(c) for c in g.completions)
        task = source.assigned(spec.seed, batch.node_id, batch.version, batch.batch_index, slot)
        rewards = [task_reward(tokenizer, task, c, c[-1] == eos, spec.task) for c in g.completions]
        out.append(judged_group(batch, g, rewards, credits[index].digest))
    for credit, (rollouts, tokens) in zip(credits, counted, strict=True):
        if (credit.rollouts, credit.tokens) != (rollouts, tokens):
            raise AuditFinding(
                "credits",
                f"the entry credits batch {credit.digest[:16]}... with {credit.rollouts} rollouts and {credit.tokens} "
                f"tokens, and its groups in the step hold {rollouts} and {tokens}",
            )
    return out


@dataclass
class StepInputs:
    """What a replay of one step reads from the trainer's data dir, checked (``step_inputs``)."""

    run: Identity | None
    """The run key, when the trainer's data dir is read (a test signs forgeries with it); None over the network."""
    run_id: str
    entry: LedgerEntry
    spec: RunSpec
    engine_state: dict[str, object]
    groups: list[Group]
    tokenizer: Any
    published: dict[str, torch.Tensor]
    """The weights published as the entry's version, their manifest checked against the run key."""
    checkpoint_sha256: str
    """Their manifest's digest of the weights (what the entry must name)."""
    after: dict[str, object] | None = None
    """The engine state of the trainer's checkpoint of the entry's own version, checked against the entry's
    ``state`` (None: not held, or not committed to): the replay's optimizer state must land on it too."""


def step_inputs(trainer_dir: Path, version: int | None = None) -> StepInputs:
    """Read and check what the step that produced ``version`` (the newest entry's when None) consumed and made
    from a trainer's data dir (module docstring). Raises AuditError when something it needs is not held here."""
    key = trainer_dir / "node.key"
    if not key.exists():
        raise AuditError("no_run_key", f"no node.key in {trainer_dir}: pass the trainer's --data-dir")
    run = load_or_create(key)
    try:
        ledger = LedgerLog(trainer_dir / "ledger", run.node_id)  # the whole chain checked with the run id
    except SystemExit as e:
        raise AuditError("bad_ledger", str(e)) from None
    entry = _entry(ledger, version)
    entries = [ledger.entry(i) for i in range(len(ledger))]
    before = parent_entry(entries, entry)
    ckpt = CheckpointDir(trainer_dir / "checkpoints" / run.node_id)
    state = _checkpoint(ckpt, entry.parent, before.state if before is not None else "")
    folder = trainer_dir / "weights" / run.node_id / str(entry.version)
    if not (folder / MANIFEST_NAME).exists():
        raise AuditError("not_held", f"version {entry.version} is not held in {folder.parent}")
    manifest = verify_manifest((folder / MANIFEST_NAME).read_bytes(), run.node_id, entry.version, entry.epoch)
    published = load_checkpoint(folder, manifest)
    inputs = assemble(run.node_id, entry, state, ckpt.spooled_since(entry.parent), published, manifest)
    inputs.run = run
    if entry.state and (ckpt.root / f"step-{entry.version:08d}.pt").exists():
        inputs.after = engine_of(_checkpoint(ckpt, entry.version, entry.state))
    return inputs


def engine_of(state: dict[str, object]) -> dict[str, object]:
    """A checkpoint's engine state (``PolicyEngine.state``); AuditFinding when it holds none."""
    engine = state.get("engine")
    if not isinstance(engine, dict):
        raise AuditFinding("state_shape", "the checkpoint holds no engine state")
    return engine


def assemble(
    run_id: str,
    entry: LedgerEntry,
    state: dict[str, object],
    spooled: Iterable[bytes],
    published: dict[str, torch.Tensor],
    manifest: Manifest,
    followed: RunSpec | None = None,
) -> StepInputs:
    """The inputs of a replay of ``entry``'s step from what was read (on disk or from the trainer): the checkpoint
    the step started from (``state``, checked against the ledger by the caller), the envelopes spooled after it,
    and the published version (``manifest`` already verified against the run key). ``followed``: the run spec the
    auditor follows (signed by the run key): the checkpoint's must be it, and the replay uses the auditor's own copy
    (the task, seed and model never come from the trainer's file)."""
    try:
        spec = RunSpec.model_validate_json(str(state["spec"]))
    except (KeyError, ValueError) as bad:
        raise AuditFinding("spec", f"the checkpoint holds no readable run spec: {bad}") from None
    if followed is not None:
        if spec != followed:
            raise AuditFinding("spec", "the checkpoint's run spec is not the one the run key signed")
        spec = followed
    if spec.epoch != entry.epoch:
        raise AuditError("not_held", f"the checkpoint is of epoch {spec.epoch}, the entry of epoch {entry.epoch}")
    batches = state.get("batches", {})
    if not isinstance(batches, dict):
        raise AuditFinding("state_shape", "the checkpoint's batches are not a mapping")
    envelopes = {hashlib.sha256(e).hexdigest(): e for e in batches.values() if isinstance(e, bytes)}
    wanted = set(entry.digests)
    for e in spooled:
        digest = hashlib.sha256(e).hexdigest()
        if digest in wanted:
            envelopes[digest] = e
    require_jail(spec.task)  # rewards of code and math tasks run untrusted programs
    tokenizer = build_tokenizer(spec.model)
    groups = _groups(spec, entry, envelopes, tokenizer)
    return StepInputs(
        None, run_id, entry, spec, engine_of(state), groups, tokenizer, published, manifest.checkpoint_sha256
    )


def run_step(
    inputs: StepInputs, spec: RunSpec | None = None, groups: list[Group] | None = None, threads: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """The published weights before and after the step, and the engine state after it, run from the checkpoint's
    engine state with the trainer's own step function on ``groups`` under ``spec`` (the entry's and the run's
    unless given: a test plays a dishonest trainer by giving others)."""
    spec = spec or inputs.spec
    torch.set_num_threads(threads)
    engine = local_engine(spec, inputs.tokenizer, "cpu")
    made = [{k: g.get(k) for k in OPTIMIZER_SETTINGS} for g in engine.optimizer.param_groups]
    engine.load_state(inputs.engine_state)
    if [{k: g.get(k) for k in OPTIMIZER_SETTINGS} for g in engine.optimizer.param_groups] != made:
        raise AuditFinding("optimizer_settings", "the checkpoint's optimizer settings are not the run spec's")
    before = engine.export_state()
    groups = inputs.groups if groups is None else groups
    if groups:
        grpo_step(engine, spec, groups, int(inputs.tokenizer.pad_token_id), inputs.entry.parent)
    return before, engine.export_state(), engine.state()


def step_weights(
    inputs: StepInputs, spec: RunSpec | None = None, groups: list[Group] | None = None, threads: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The published weights before and after the step (``run_step``)."""
    before, after, _ = run_step(inputs, spec, groups, threads)
    return before, after


FLAT_NODES = 1_000_000
"""Containers and leaves a state may hold (a model's is a few thousand): a file that shares one list under many
names (the unpickler keeps references) cannot make the walk explode."""


def _flat(tree: object) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a nested state (dicts, lists), by path; AuditFinding past FLAT_NODES."""
    out: dict[str, torch.Tensor] = {}
    todo: list[tuple[str, object]] = [("", tree)]
    seen = 0
    while todo:
        at, node = todo.pop()
        seen += 1
        if seen > FLAT_NODES:
            raise AuditFinding("state_shape", f"the engine state holds more than {FLAT_NODES} entries")
        if isinstance(node, torch.Tensor):
            if node.is_floating_point():
                out[at] = node
        elif isinstance(node, dict):
            todo.extend((f"{at}/{key}", value) for key, value in node.items())
        elif isinstance(node, list | tuple):
            todo.extend((f"{at}/{i}", value) for i, value in enumerate(node))
    return out


def _finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


OPTIMIZER_SETTINGS = ("betas", "eps", "weight_decay", "amsgrad", "maximize")
"""The optimizer's settings that change what a step computes, besides the learning rate (set by the schedule at
every step): a checkpoint's must be those the run spec makes."""


def state_gap(before: object, replayed: object, committed: object) -> float | None:
    """How far the replayed engine state is from the committed one: over every tensor (weights, each optimizer
    moment, the step count), the largest difference over the largest change the step made to that tensor (one it
    did not change: over 1e-30; one it made: over its size), so that moments of 1e-8 are held to their own scale.
    None when the two do not hold the same tensors."""
    b, r, c = _flat(before), _flat(replayed), _flat(committed)
    if set(r) != set(c) or any(r[k].shape != c[k].shape for k in r):
        return None
    worst = 0.0
    for k in r:
        if not r[k].numel():
            continue
        diff = float((r[k].double() - c[k].double()).abs().max())
        if k in b and b[k].shape == c[k].shape:
            change = float((c[k].double() - b[k].double()).abs().max())
        else:  # made by the step (the optimizer's first): all of it is the change
            change = float(c[k].double().abs().max())
        ratio = diff / max(change, 1e-30)
        worst = ratio if not ratio <= worst else worst  # a NaN is the worst
    return worst


def verdict(inputs: StepInputs, threads: int = 1) -> AuditResult:
    """Replay the step and compare with what was published (module docstring)."""
    entry, published = inputs.entry, inputs.published
    base = AuditResult(entry.version, entry.epoch, len(entry.producers), len(inputs.groups), 0.0, 0.0, "caught")
    if train_hash(inputs.spec.train) != entry.train:
        return replace(base, reason="train_settings")
    if entry.weights != inputs.checkpoint_sha256:  # the published version is not the one the entry names
        return replace(base, reason="manifest")
    try:
        before, replayed, engine = run_step(inputs, threads=threads)
    except AuditFinding as e:
        return replace(base, reason=e.reason)
    if set(replayed) != set(published) or any(replayed[n].shape != published[n].shape for n in replayed):
        return replace(base, reason="tensor_names")
    if not _finite(published.values()):  # a NaN compares as neither larger nor smaller: it would hide anything
        return replace(base, reason="not_finite")
    diff = max(float((replayed[n].float() - published[n].float()).abs().max()) for n in replayed)
    update = max(float((published[n].float() - before[n].float()).abs().max()) for n in published)
    found = replace(base, max_abs_diff=diff, update_max=update)
    if not diff <= AUDIT_TOLERANCE * update:
        return replace(found, reason="weights")
    if inputs.after is not None:
        try:
            gap = state_gap(inputs.engine_state, engine, inputs.after)
        except AuditFinding as e:
            return replace(found, reason=e.reason)
        if gap is None:
            return replace(found, reason="state_tensors")
        found = replace(found, state_diff=gap)
        if not gap <= AUDIT_TOLERANCE:
            return replace(found, reason="state_after")
    return replace(found, verdict="honest")


def replay(trainer_dir: Path, version: int | None = None, threads: int = 1) -> AuditResult:
    """Replay the step that produced ``version`` (the newest entry's when None) from the trainer's data dir and
    compare with what was published. Raises AuditError when it cannot be replayed here."""
    try:
        inputs = step_inputs(trainer_dir, version)
    except AuditFinding as e:  # the data dir contradicts the trainer's own signed entries: caught before a replay
        entry = _entry(LedgerLog(trainer_dir / "ledger", load_or_create(trainer_dir / "node.key").node_id), version)
        return AuditResult(entry.version, entry.epoch, len(entry.producers), 0, 0.0, 0.0, "caught", e.reason)
    return verdict(inputs, threads)


def run_audit(trainer_dir: Path, version: int | None, threads: int) -> int:
    """``intellect-node audit``: prints the finding; exit status 0 honest, 2 caught, 1 when it cannot replay."""
    try:
        result = replay(trainer_dir, version, threads)
    except AuditError as e:
        print(f"intellect-node audit: cannot replay: {e}")
        return 1
    print(result.line())
    return 0 if result.verdict == "honest" else 2
