"""Experiment tracking: the trainer's step metrics land in TensorBoard event files or an offline W&B run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from intellect_node.roles.tracking import Tracker


def test_step_metrics_are_written_as_tensorboard_scalars(tmp_path: Path) -> None:
    tracker = Tracker("tensorboard", tmp_path, "run1", {"model": {"kind": "tiny-llama"}})
    for step in (1, 2, 3):
        tracker.log(step, {"step": step, "loss": 1.0 / step, "reward_mean": 0.1 * step, "note": "not a number"})
    tracker.close()
    events = EventAccumulator(str(tmp_path / "run1"))
    events.Reload()
    assert {"train/loss", "train/reward_mean"} <= set(events.Tags()["scalars"])
    assert "train/step" not in events.Tags()["scalars"] and "train/note" not in events.Tags()["scalars"]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (3, 0.333333)]


@pytest.mark.integration  # seconds by design (wandb starts its own service process)
def test_step_metrics_go_to_an_offline_wandb_run(tmp_path: Path) -> None:
    """``--track wandb`` needs no account or network: an offline run a researcher can ``wandb sync`` later."""
    tracker = Tracker("wandb", tmp_path, "run2", {"model": {"kind": "tiny-llama"}})
    for step in (1, 2, 3):
        tracker.log(step, {"step": step, "loss": 1.0 / step, "reward_mean": 0.1 * step, "note": "not a number"})
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-run2"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    records = (runs[0] / "run-run2.wandb").read_bytes()  # the record log `wandb sync` uploads (protobuf records)
    for key, value in (("train/loss", 1.0 / 3), ("train/reward_mean", 0.1 * 3)):
        assert key.encode() in records and json.dumps(value).encode() in records
    assert b"train/step" not in records and b"train/note" not in records
