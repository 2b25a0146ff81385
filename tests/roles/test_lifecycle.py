"""Processes as an operator sees them (issue 13 items 5, 8, 9): a node's DHT process and go-libp2p daemon die
with it however it dies, never hold its ports, every role exits within seconds on SIGTERM (to it alone or to its
process group), and a restarted node keeps its libp2p identity and port, so the join line it printed stays valid."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from intellect_node.launch import NodeProcess, join_argv
from tests.helpers.net import free_port
from tests.helpers.wait import until

pytestmark = pytest.mark.integration


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running after up to ``timeout`` seconds (waits on their exit, not on a clock)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if _running(p)]


def _running(p: psutil.Process) -> bool:
    """Not gone, and not a zombie waiting for a reaper (an orphan whose exit init has not collected yet)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_trainer_killed_alone_takes_its_dht_along_and_restarts_on_the_same_ports_and_identity(
    tmp_path: Path,
) -> None:
    http_port, p2p_port = free_port(), free_port()
    boot = [
        "bootstrap",
        "--data-dir",
        str(tmp_path / "t"),
        "--http-port",
        str(http_port),
        "--p2p-port",
        str(p2p_port),
        "--max-steps",
        "0",
    ]
    nodes: list[NodeProcess] = []
    try:
        first = NodeProcess("trainer", boot, tmp_path / "logs")
        nodes.append(first)
        ready = first.wait_ready(timeout=120)
        children = _descendants(first.proc.pid)
        assert children, "the trainer runs its DHT in a child process (and p2pd below it)"
        first.proc.send_signal(signal.SIGKILL)  # to it alone: no chance to clean anything up
        left = _wait_gone(children, timeout=10)  # while it is a zombie (not reaped yet), as under an OOM kill
        assert not left, [p.cmdline()[:3] for p in left]
        first.proc.wait(timeout=10)

        # the README's command again, with the same fixed ports: it starts, as the same libp2p peer
        second = NodeProcess("trainer-2", boot, tmp_path / "logs")
        nodes.append(second)
        ready2 = second.wait_ready(timeout=120)
        assert ready2["p2p_maddrs"] == ready["p2p_maddrs"]
        assert ready2["status_url"] == ready["status_url"]

        # SIGTERM to the whole group (timeout, kill -- -PGID, systemd): everything ends within seconds
        family = [psutil.Process(second.proc.pid), *_descendants(second.proc.pid)]
        os.killpg(second.proc.pid, signal.SIGTERM)
        second.proc.wait(timeout=20)
        assert not _wait_gone(family, timeout=10)
    finally:
        for node in reversed(nodes):
            node.stop()


def test_a_volunteer_exits_within_seconds_on_sigterm_and_its_dht_goes_with_it(tmp_path: Path) -> None:
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess(
            "trainer", ["bootstrap", "--data-dir", str(tmp_path / "t"), "--max-steps", "0"], tmp_path / "logs"
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        relay = NodeProcess("relay", join_argv("relay", ready, tmp_path / "r"), tmp_path / "logs")
        nodes.append(relay)
        relay_ready = relay.wait_ready(timeout=120)
        family = [psutil.Process(relay.proc.pid), *_descendants(relay.proc.pid)]
        assert len(family) >= 2
        relay.proc.send_signal(signal.SIGTERM)  # to it alone
        relay.proc.wait(timeout=20)
        assert not _wait_gone(family, timeout=10)

        # it rejoins with the same data dir as the same libp2p peer
        again = NodeProcess("relay-2", join_argv("relay", ready, tmp_path / "r"), tmp_path / "logs")
        nodes.append(again)
        again_ready = again.wait_ready(timeout=120)
        peer = relay_ready["p2p_maddrs"][0].rsplit("/p2p/", 1)[1]
        assert again_ready["p2p_maddrs"][0].endswith(f"/p2p/{peer}")
    finally:
        for node in reversed(nodes):
            node.stop()


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_validator_that_joined_before_a_restart_still_judges_for_the_restarted_trainer(tmp_path: Path) -> None:
    """Issue 13 item 8, as an operator met it: trainer started, validator joined, trainer restarted (before any
    checkpoint) with ``--validator <its id>``, an inference node joined with the printed line. The validator's DHT
    contact was the trainer; the trainer keeps its address, so the validator is back in the run and judges."""
    data = tmp_path / "t"
    boot = ["bootstrap", "--data-dir", str(data), "--checkpoint-every", "0"]
    nodes: list[NodeProcess] = []
    try:
        first = NodeProcess("trainer", boot, tmp_path / "logs")
        nodes.append(first)
        ready = first.wait_ready(timeout=120)
        validator = NodeProcess("validator", join_argv("validator", ready, tmp_path / "v"), tmp_path / "logs")
        nodes.append(validator)
        validator_ready = validator.wait_ready(timeout=120)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)

        second = NodeProcess("trainer-2", [*boot, "--validator", validator_ready["node_id"]], tmp_path / "logs")
        nodes.append(second)
        ready2 = second.wait_ready(timeout=120)
        assert ready2["p2p_maddrs"] == ready["p2p_maddrs"]  # the join line printed before is still right
        worker = NodeProcess("inference", join_argv("inference", ready2, tmp_path / "i"), tmp_path / "logs")
        nodes.append(worker)
        worker.wait_ready(timeout=120)
        second.wait_for_line("STEP 1 ", timeout=300)
        # the validator notices the trainer's record is no longer renewed, re-joins the DHT through the trainer's
        # address (REBOOTSTRAP_S) and its next record reaches the trainer: it judges again
        deadline = time.monotonic() + 180
        while True:
            with urllib.request.urlopen(ready2["status_url"] + "/status", timeout=10) as resp:
                status = json.load(resp)
            verdicts = _metric(ready2["status_url"], "node_trainer_remote_verdicts_total")
            if (status["validators_missing"] == [] and verdicts > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status["validators_missing"] == [], validator.tail()
        assert verdicts > 0
    finally:
        for node in reversed(nodes):
            node.stop()


def test_a_trainer_stopped_while_it_judges_a_batch_exits_at_once_without_a_traceback(tmp_path: Path) -> None:
    """Judging is abandoned, not awaited (issue 38 item 5): its rewards come from a verifiers environment whose
    reward takes a minute (tests/helpers/verifiers_envs/intellect_toy_slow), so a SIGTERM lands mid-judging."""
    config = tmp_path / "slow.toml"
    config.write_text('[run.task]\nfamily = "verifiers"\nsource = "intellect-toy-slow"\nheld_out = 2\n')
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent / "helpers" / "verifiers_envs")}
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess(
            "trainer", ["bootstrap", "--config", str(config), "--data-dir", str(tmp_path / "t")], tmp_path / "logs", env
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        worker = NodeProcess("inference", join_argv("inference", ready, tmp_path / "i"), tmp_path / "logs", env)
        nodes.append(worker)
        worker.wait_ready(timeout=180)

        def judging() -> bool:
            with urllib.request.urlopen(ready["status_url"] + "/status", timeout=10) as resp:
                return int(json.load(resp)["judging"]) >= 1

        asyncio.run(until(judging, "the trainer to judge a batch", 180, 0.5))
        stopped = time.monotonic()
        trainer.proc.send_signal(signal.SIGTERM)
        trainer.proc.wait(timeout=30)
        assert time.monotonic() - stopped < 10
        log = trainer.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    finally:
        for node in reversed(nodes):
            node.stop()
