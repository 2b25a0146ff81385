"""A PNG of mean reward and held-out accuracy against wall-clock time (demo and benchmarks/learning.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Curve:
    name: str
    rewards: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the run began, mean reward of the rollouts of that step)"""
    accuracy: list[tuple[float, float]] = field(default_factory=list)
    """(seconds, held-out greedy accuracy of the policy at that time)"""


def plot(curves: list[Curve], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for curve in curves:
        if curve.rewards:
            xs, ys = zip(*curve.rewards, strict=True)
            top.plot([x / 60 for x in xs], ys, label=curve.name, alpha=0.8)
        if curve.accuracy:
            xs, ys = zip(*curve.accuracy, strict=True)
            bottom.plot([x / 60 for x in xs], [100 * y for y in ys], marker="o", label=curve.name)
    top.set_ylabel("mean reward (training rollouts)")
    bottom.set_ylabel("held-out greedy accuracy (%)")
    bottom.set_xlabel("wall-clock minutes")
    top.set_title(title)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
