"""Experiment tracking: the trainer's step metrics land in TensorBoard event files a researcher can open."""

from __future__ import annotations

from pathlib import Path

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
