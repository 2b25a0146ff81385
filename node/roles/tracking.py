"""Experiment tracking for researchers: the trainer's step metrics in TensorBoard event files or W&B (offline).

``bootstrap --track tensorboard`` writes ``<--track-dir>/<run id>/events.out.tfevents.*`` (``tensorboard --logdir
<--track-dir>``); ``--track wandb`` logs a W&B run in offline mode under ``<--track-dir>`` (``wandb sync`` uploads
it later, if wanted). Every numeric field of a step's history entry is logged under ``train/<field>`` at that step.
The default ``--track-dir`` is ``<data dir>/tracking``. Both need their package: ``pip install -e '.[track]'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Tracker:
    def __init__(self, kind: str, root: Path, run_id: str, config: dict[str, Any]) -> None:
        self.kind = kind
        self._writer: Any = None
        self._wandb: Any = None
        root.mkdir(parents=True, exist_ok=True)
        try:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=str(root / run_id))
                self._writer.add_text("run/spec", "```\n" + _as_text(config) + "\n```", 0)
            elif kind == "wandb":
                os.environ.setdefault("WANDB_MODE", "offline")
                os.environ.setdefault("WANDB_SILENT", "true")
                import wandb

                self._wandb = wandb.init(
                    project="intellect-node",
                    name=run_id,
                    id=run_id,
                    dir=str(root),
                    config=config,
                    mode="offline",
                    resume="allow",
                )
            else:
                raise ValueError(f"--track {kind}: choose tensorboard or wandb")
        except ImportError as e:
            raise SystemExit(
                f"--track {kind} needs its package ({e.name} is not installed): pip install "
                "-e '.[track]' (or pip install tensorboard / wandb)"
            ) from None

    def log(self, step: int, stats: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(f"train/{key}", value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # finish() can return before W&B's service process has written the run's record log out (a CI run
            # read only its 8-byte header): shutting the service down waits for it
            wandb.teardown()
            self._wandb = None


def _as_text(config: dict[str, Any]) -> str:
    import json

    return json.dumps(config, indent=1, default=str)
