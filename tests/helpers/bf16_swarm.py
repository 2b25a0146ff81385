"""A run computing in bf16, as GPU volunteers do, with real processes on loopback: a trainer, a validator node and
inference nodes of the given backends and thread counts (tests/roles/test_bf16_swarm.py: two transformers nodes;
tests/vllm/test_mixed_swarm.py: a vLLM node beside a transformers one). Every node takes the run's bf16
thresholds from the signed spec (node/configs/verify/tiny-bfloat16.toml, filled in by the trainer's config)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

from intellect_node.launch import NodeProcess
from intellect_node.p2p.keys import load_or_create
from tests.helpers.wait import until

STEPS = 4
FLOW_CONTROL = {"busy", "backlog_full", "stale_version"}
"""Refusals that decide nothing about a batch (the producer sends it again later): flow control, not judgements."""


def status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/status", timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


def run_bf16_swarm(root: Path, producers: list[tuple[str, int]]) -> dict[str, Any]:
    """Train STEPS steps with one inference node per (backend, threads), wait (bounded) until each has groups
    accepted; the trainer's status then, and each producer's node id under ``"producers"``."""
    logs = root / "logs"
    nodes: list[NodeProcess] = []
    try:
        validator_id = load_or_create(root / "validator" / "node.key").node_id
        trainer = NodeProcess(
            "trainer",
            [
                "bootstrap",
                "--data-dir",
                str(root / "trainer"),
                "--max-steps",
                str(STEPS),
                "--validator",
                validator_id,
                "--set",
                "model.compute_dtype=bfloat16",
            ],
            logs,
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        join = ["join", "--peers", ready["p2p_maddrs"][0], "--run-id", ready["run_id"]]
        validator = NodeProcess(
            "validator", [*join, "--role", "validator", "--data-dir", str(root / "validator")], logs
        )
        nodes.append(validator)
        validator.wait_ready(timeout=120)
        workers = []
        for i, (backend, threads) in enumerate(producers):
            argv = [*join, "--role", "inference", "--data-dir", str(root / f"inference-{i}")]
            argv += ["--backend", backend, "--threads", str(threads)]
            workers.append(NodeProcess(f"inference-{i}-{backend}", argv, logs))
        nodes += workers
        ids = [w.wait_ready(timeout=300)["node_id"] for w in workers]
        trainer.wait_for_line(f"STEP {STEPS} ", timeout=600)

        def contributed(node_id: str) -> bool:
            return bool(status(ready["status_url"])["accepted_groups_by_node"].get(node_id, 0) > 0)

        for node_id in ids:  # the trainer goes on judging fresh batches after its last step
            asyncio.run(until(lambda n=node_id: contributed(n), f"groups of {node_id[:8]}", timeout=180, every=0.5))
        return {**status(ready["status_url"]), "producers": ids}
    finally:
        for node in reversed(nodes):
            node.stop()


def assert_no_honest_rollout_refused(trainer: dict[str, Any]) -> None:
    """The run trained its steps with every producer's groups accepted, none judged bad, none banned."""
    assert trainer["step"] == STEPS
    assert all(trainer["accepted_groups_by_node"].get(n, 0) > 0 for n in trainer["producers"])
    assert not trainer["banned"]
    assert trainer["validation_failures_by_reason"] == {}, trainer["validation_failures_by_reason"]
    assert set(trainer["rejected_batches_by_reason"]) <= FLOW_CONTROL, trainer["rejected_batches_by_reason"]
