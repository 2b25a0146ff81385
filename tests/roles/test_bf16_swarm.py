"""Integration: a run computing in bf16 (GPU volunteers' dtype) trains end to end with two transformers inference
nodes on different thread counts and a validator node, refusing none of their honest rollouts. Before the bf16
thresholds (node/configs/verify/tiny-bfloat16.toml) a bf16 volunteer's honest rollouts were refused on TOPLOC
and its node banned."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.bf16_swarm import assert_no_honest_rollout_refused, run_bf16_swarm

pytestmark = pytest.mark.integration


def test_a_bf16_run_accepts_every_honest_producer(tmp_path: Path) -> None:
    assert_no_honest_rollout_refused(run_bf16_swarm(tmp_path, [("transformers", 1), ("transformers", 2)]))
