"""Integration: a run computing in bf16 (GPU volunteers' dtype) trains end to end with two transformers inference
nodes on different thread counts and a validator node, refusing none of their honest rollouts. Before the bf16
thresholds (node/configs/verify/tiny-bfloat16.toml) a bf16 volunteer's honest rollouts were refused on TOPLOC
and its node banned."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.bf16_swarm import STEPS, run_bf16_swarm

pytestmark = pytest.mark.integration

FLOW_CONTROL = {"busy", "backlog_full", "stale_version"}


def test_a_bf16_run_accepts_every_honest_producer(tmp_path: Path) -> None:
    trainer = run_bf16_swarm(tmp_path, [("transformers", 1), ("transformers", 2)])
    assert trainer["step"] == STEPS
    assert all(trainer["accepted_groups_by_node"].get(n, 0) > 0 for n in trainer["producers"])
    assert not trainer["banned"]
    assert trainer["validation_failures_by_reason"] == {}, trainer["validation_failures_by_reason"]
    # refusals that decide nothing about a batch (send it again later) are flow control, not judgements
    assert set(trainer["rejected_batches_by_reason"]) <= FLOW_CONTROL, trainer["rejected_batches_by_reason"]
