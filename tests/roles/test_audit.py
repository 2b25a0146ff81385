"""Issue 39 item 3: a step replayed from the trainer's checkpoint, its ledger entry and the producers' signed
batches lands on the weights it published, and a trainer that trained on other data, skipped a batch or changed a
hyper-parameter is caught. A real trainer and inference node (processes, loopback) make the run; the dishonest
trainers are played by publishing, under the run key, the weights such a trainer would have made from the same
checkpoint."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from intellect_node.launch import NodeProcess, join_argv
from intellect_node.p2p.keys import load_or_create
from intellect_node.policy.engine import Group
from intellect_node.roles.audit import AUDIT_TOLERANCE, AuditError, _checkpoint, replay, step_inputs, step_weights
from intellect_node.roles.trainer_checkpoint import CheckpointDir
from intellect_node.roles.trainer_ledger import LedgerLog
from intellect_node.weights.files import write_checkpoint
from intellect_protocol.envelope import seal
from intellect_protocol.ledger import train_hash
from intellect_protocol.messages import RunSpec
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A trainer's data dir after STEPS steps with one inference node (checkpoint every step, the default)."""
    root = tmp_path_factory.mktemp("audit")
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess(
            "trainer", ["bootstrap", "--data-dir", str(root / "trainer"), "--max-steps", str(STEPS)], root / "logs"
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        worker = NodeProcess("inference", join_argv("inference", ready, root / "inference"), root / "logs")
        nodes.append(worker)
        worker.wait_ready(timeout=120)
        trainer.wait_for_line(f"STEP {STEPS} ", timeout=300)

        def published() -> bool:  # the last version's entry and weights are written after its STEP line
            with urllib.request.urlopen(ready["status_url"] + "/status", timeout=10) as resp:
                status = json.load(resp)
            return bool(status["weight_version"] == STEPS and status["ledger"]["length"] == STEPS)

        asyncio.run(until(published, f"version {STEPS} published with its entry", timeout=60, every=0.2))
    finally:
        for node in reversed(nodes):
            node.stop()
    yield root / "trainer"


def _forge(
    trainer_dir: Path,
    to: Path,
    change: Callable[[RunSpec, list[Group]], tuple[RunSpec, list[Group]]],
    consistent: bool = True,
) -> Path:
    """A copy of the trainer's data dir whose newest version holds what a trainer that made ``change`` to the
    step's inputs would have published (signed by the run key, as the real trainer would), with a re-signed entry
    naming those weights (``consistent``) or the honest entry left as it was."""
    shutil.copytree(trainer_dir, to)
    inputs = step_inputs(to)
    spec, groups = change(inputs.spec, inputs.groups)
    _, tensors = step_weights(inputs, spec, groups)
    weights = to / "weights" / inputs.run_id
    entry = inputs.entry
    shutil.rmtree(weights / str(entry.version))
    manifest = write_checkpoint(weights, inputs.run, inputs.run_id, entry.version, tensors, 1 << 30, epoch=entry.epoch)
    if consistent:
        ledger = LedgerLog(to / "ledger", inputs.run_id)
        ledger.drop_unpublished(entry.epoch, entry.version - 1)
        forged = entry.model_copy(update={"weights": manifest.checkpoint_sha256, "prev": ledger.head.hash})
        ledger.append(seal(inputs.run, forged))
    return to


def test_an_honest_step_replays_to_the_published_weights(trained: Path) -> None:
    once = replay(trained)
    assert once.verdict == "honest" and once.version == STEPS and once.groups > 0 and once.update_max > 0
    again = replay(trained, threads=2)  # another process's replay, another thread count
    assert again.verdict == "honest"
    assert max(once.max_abs_diff, again.max_abs_diff) <= AUDIT_TOLERANCE * once.update_max
    with pytest.raises(AuditError, match="not_held"):  # the trainer keeps its last two checkpoints
        replay(trained, version=1)
    with pytest.raises(AuditError, match="no_entry"):
        replay(trained, version=STEPS + 5)


def test_a_trainer_that_trained_on_other_data_is_caught(trained: Path, tmp_path: Path) -> None:
    def other_data(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
        g, other = groups[0], groups[-1]  # the first group's completions swapped for another's, rewards reversed
        swapped = Group(g.node_id, g.version, g.prompt_ids, other.completions, other.logprobs, other.rewards[::-1])
        return spec, [swapped, *groups[1:]]

    result = replay(_forge(trained, tmp_path / "t", other_data))
    assert result.verdict == "caught" and result.reason == "weights", result.line()


def test_a_trainer_that_skipped_a_batch_is_caught(trained: Path, tmp_path: Path) -> None:
    def skipped(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
        first = groups[0].digest
        kept = [g for g in groups if g.digest != first]
        assert kept, "the step trained on one batch only: nothing to skip"
        return spec, kept

    result = replay(_forge(trained, tmp_path / "t", skipped))
    assert result.verdict == "caught" and result.reason == "weights", result.line()


def test_a_trainer_that_changed_a_hyper_parameter_is_caught(trained: Path, tmp_path: Path) -> None:
    def hotter(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
        return spec.model_copy(update={"train": spec.train.model_copy(update={"lr": spec.train.lr * 3})}), groups

    result = replay(_forge(trained, tmp_path / "t", hotter))
    assert result.verdict == "caught" and result.reason == "weights", result.line()


def test_weights_other_than_the_entry_names_are_caught(trained: Path, tmp_path: Path) -> None:
    """Issue 39 item 4: a manifest that does not match its entry (the weights published are not the ones the
    entry names) is a finding before any replay."""
    result = replay(_forge(trained, tmp_path / "t", lambda spec, groups: (spec, groups[1:]), consistent=False))
    assert result.verdict == "caught" and result.reason == "manifest", result.line()


def test_an_entry_that_names_other_training_settings_is_caught(trained: Path, tmp_path: Path) -> None:
    """The entry is the trainer's signed word; one whose settings hash is not the run's is a finding itself."""
    to = tmp_path / "t"
    shutil.copytree(trained, to)
    run = load_or_create(to / "node.key")
    ledger = LedgerLog(to / "ledger", run.node_id)
    last = ledger.entry(len(ledger) - 1)
    state = _checkpoint(CheckpointDir(to / "checkpoints" / run.node_id), last.parent)
    train = RunSpec.model_validate_json(str(state["spec"])).train
    ledger.drop_unpublished(last.epoch, last.version - 1)  # the entry rewritten, re-signed, chained again
    other = last.model_copy(
        update={"train": train_hash(train.model_copy(update={"lr": train.lr * 3})), "prev": ledger.head.hash}
    )
    ledger.append(seal(run, other))
    result = replay(to)
    assert result.verdict == "caught" and result.reason == "train_settings", result.line()
