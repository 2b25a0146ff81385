"""Starting a node as an operator or a volunteer does it, through the real CLI and processes (issue 38 items 2
to 5): one node per data dir, the second start told which process holds it; a volunteer started while the
trainer is down waits for it (until ``--join-timeout``) instead of exiting after one try; an untrusted validator
and a producer whose trainer went away say so; the trainer's log and scrape say what an operator needs, once."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from intellect_node.launch import NodeExited, NodeProcess, join_argv
from intellect_node.p2p.metrics import LABEL_NAMES
from tests.helpers.net import free_port
from tests.helpers.wait import until

pytestmark = pytest.mark.integration


def _state(data_dir: Path) -> tuple[int, str]:
    """``intellect-node status --data-dir``: its exit code (1: the node is not doing its job) and what it printed."""
    shown = subprocess.run(
        [sys.executable, "-m", "intellect_node.cli", "status", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "1000"},  # one table row a line: no text wrapped inside a cell
    )
    return shown.returncode, " ".join((shown.stdout + shown.stderr).split())


def _metric(node: NodeProcess, name: str) -> float:
    """A counter of a running node (summed over its labels), from its /metrics."""
    assert node.ready is not None
    with urllib.request.urlopen(node.ready["status_url"] + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith((name + " ", name + "{")))


def _exits_refused(node: NodeProcess, timeout: float) -> str:
    """The node's log once it exited with a non-zero code (it must not get as far as READY)."""
    with pytest.raises(NodeExited):
        node.wait_ready(timeout=timeout)
    assert node.proc.returncode not in (0, None)
    return node.log_path.read_text(errors="replace")


def test_a_second_node_on_a_data_dir_is_refused_naming_the_first_and_a_kill_frees_it(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess("trainer", ["bootstrap", "--data-dir", str(tmp_path / "t"), "--max-steps", "0"], logs)
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        relay = NodeProcess("relay", join_argv("relay", ready, tmp_path / "r"), logs)
        nodes.append(relay)
        relay_id = relay.wait_ready(timeout=120)["node_id"]
        saved_url = (tmp_path / "r" / "http.url").read_text()

        twin = NodeProcess("relay-twin", join_argv("relay", ready, tmp_path / "r"), logs)
        nodes.append(twin)
        said = _exits_refused(twin, timeout=60)
        assert f"--data-dir {tmp_path / 'r'} is in use by process {relay.proc.pid} on " in said, said
        assert "Traceback" not in said
        assert (tmp_path / "r" / "http.url").read_text() == saved_url  # `status --data-dir` still finds the first

        second_trainer = NodeProcess("trainer-twin", ["bootstrap", "--data-dir", str(tmp_path / "t")], logs)
        nodes.append(second_trainer)
        said = _exits_refused(second_trainer, timeout=60)
        assert f"is in use by process {trainer.proc.pid} on " in said, said

        held = tmp_path / "r" / "weights"
        asyncio.run(until(lambda: any(held.rglob("*.safetensors")), "the relay to hold a version", 120, 0.5))
        relay.proc.send_signal(signal.SIGKILL)  # no clean-up at all: the kernel drops the lock with the process
        relay.proc.wait(timeout=10)
        # and `join --fresh` (a volunteer's reset) starts it with no weights, as the same node
        again = NodeProcess("relay-again", join_argv("relay", ready, tmp_path / "r", "--fresh"), logs)
        nodes.append(again)
        assert again.wait_ready(timeout=120)["node_id"] == relay_id
        assert "--fresh: deleted the weights held under" in again.log_path.read_text()
    finally:
        for node in reversed(nodes):
            node.stop()


def test_a_volunteer_started_while_the_trainer_is_down_waits_for_it(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    http_port, p2p_port = free_port(), free_port()
    boot = ["bootstrap", "--data-dir", str(tmp_path / "t"), "--max-steps", "0"]
    boot += ["--http-port", str(http_port), "--p2p-port", str(p2p_port)]
    nodes: list[NodeProcess] = []
    doctor: subprocess.Popen[str] | None = None
    try:
        first = NodeProcess("trainer", boot, logs)
        nodes.append(first)
        ready = first.wait_ready(timeout=120)
        first.stop()  # the trainer restarts (its join line stays valid: same key, same ports)

        # while the trainer is away, three at once: a volunteer that waits for it, one with a finite --join-timeout,
        # and doctor
        relay = NodeProcess("relay", join_argv("relay", ready, tmp_path / "r", "--join-timeout", "300"), logs)
        nodes.append(relay)
        gone = NodeProcess("relay-alone", join_argv("relay", ready, tmp_path / "r2", "--join-timeout", "5"), logs)
        nodes.append(gone)
        doctor = subprocess.Popen(
            [sys.executable, "-m", "intellect_node.cli", "doctor", "--data-dir", str(tmp_path / "d"), "--host"]
            + ["127.0.0.1", "--peers", ready["p2p_maddrs"][0], "--run-id", ready["run_id"]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def retried() -> bool:
            assert relay.proc.poll() is None, relay.tail()  # it must not give up while the trainer is away
            return "none of --peers answered (try 2)" in relay.log_path.read_text(errors="replace")

        asyncio.run(until(retried, "the volunteer's second try to join", timeout=120, every=0.5))
        # a finite --join-timeout ends a volunteer whose peers never answer, with the reason and the way out
        said = _exits_refused(gone, timeout=120)
        assert "could not start the DHT peer" in said and "--join-timeout 0 waits for ever" in said, said
        # doctor against the same dead trainer: its local checks still shown, the run's check failed with the fix
        out, err = doctor.communicate(timeout=120)
        assert doctor.returncode == 1, out + err
        assert "memory" in out and "FAIL could not start the DHT peer" in out, out
        assert "Traceback" not in err, err
        back = NodeProcess("trainer-back", boot, logs)
        nodes.append(back)
        back.wait_ready(timeout=120)
        relay.wait_ready(timeout=180)
        assert _state(tmp_path / "r")[0] == 0

        # the trainer gone for good: the volunteer says so (it looked healthy), and `status` exits 1
        back.stop()
        asyncio.run(until(lambda: _state(tmp_path / "r")[0] == 1, "the relay to say its trainer is gone", 90, 1.0))
        assert "waiting for the trainer: no record of it for" in _state(tmp_path / "r")[1]
    finally:
        if doctor is not None and doctor.poll() is None:
            doctor.kill()
            doctor.communicate()
        for node in reversed(nodes):
            node.stop()


def test_a_validator_the_trainer_does_not_trust_says_so(tmp_path: Path) -> None:
    """Started without --validator for it, the trainer judges every batch itself and never names the validator;
    the validator used to judge nothing and say nothing. Now its status names the fix, and `status` exits 1."""
    logs = tmp_path / "logs"
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess("trainer", ["bootstrap", "--data-dir", str(tmp_path / "t")], logs)
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        validator = NodeProcess("validator", join_argv("validator", ready, tmp_path / "v"), logs)
        nodes.append(validator)
        vid = validator.wait_ready(timeout=120)["node_id"]
        worker = NodeProcess("inference", join_argv("inference", ready, tmp_path / "i"), logs)
        nodes.append(worker)
        worker.wait_ready(timeout=120)
        assert _state(tmp_path / "i")[0] == 0
        asyncio.run(until(lambda: _state(tmp_path / "v")[0] == 1, "the validator to say it is not asked", 240, 2.0))
        said = _state(tmp_path / "v")[1]
        assert "not asked to judge" in said and f"--validator {vid}" in said, said
        assert _state(tmp_path / "i")[0] == 0  # the producer's batches are judged (by the trainer): it works

        # what an operator reads: no LEDGER line per event unless asked for (INTELLECT_NODE_LEDGER_LOG=1), and a
        # scrape whose labels say what they count (a DHT key, a gossip topic), each metric with a real HELP
        asyncio.run(
            until(lambda: _metric(trainer, "node_trainer_groups_accepted_total") >= 1, "an accepted batch", 120, 0.5)
        )
        assert "LEDGER " not in trainer.log_path.read_text(errors="replace")
        with urllib.request.urlopen(ready["status_url"] + "/metrics", timeout=10) as resp:
            scrape = resp.read().decode().splitlines()
        for name, label in LABEL_NAMES.items():
            labelled = [x for x in scrape if x.startswith(name + "{")]
            assert all(x.startswith(f"{name}{{{label}=") for x in labelled), labelled
        assert any(x.startswith("node_dht_stores_total{key=") for x in scrape)
        assert any(x.startswith("node_gossip_published_total{topic=") for x in scrape)
        helps = [x.split(" ", 3) for x in scrape if x.startswith("# HELP ")]
        bare = [h for h in helps if len(h) < 4 or not h[3].strip() or h[3].strip() == h[2]]
        assert helps and not bare, bare

        # the trainer goes away: the producer backs off (it sent its batch every 250 ms, and warned each time) and
        # says it is not working
        went = time.monotonic()  # deliveries start failing during the stop
        trainer.stop()
        asyncio.run(until(lambda: _state(tmp_path / "i")[0] == 1, "the producer to say it cannot work", 90, 1.0))
        away = time.monotonic() - went
        log = worker.log_path.read_text(errors="replace")
        assert log.count("could not deliver batch") <= 1, log[-2000:]
        failures = _metric(worker, "node_inference_submit_failures_total")
        assert failures <= 2 * math.log2(1 + away / 0.25) + 2, (failures, away)  # 250 ms each: ~4 a second
    finally:
        for node in reversed(nodes):
            node.stop()


def test_two_volunteers_on_one_identity_are_detected_and_named(tmp_path: Path) -> None:
    """Issue 39 item 2: a copy of node.key run from another data dir (a cloned disk, a second container on a copied
    volume). The trainer acknowledges, on gossip, batches signed with the key; a node that hears acknowledgements
    for batches it never made says so in its status (and `intellect-node status` exits non-zero), naming the key
    file to deal with."""
    logs = tmp_path / "logs"
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess("trainer", ["bootstrap", "--data-dir", str(tmp_path / "t")], logs)
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        first = NodeProcess("inference-a", join_argv("inference", ready, tmp_path / "a"), logs)
        nodes.append(first)
        first.wait_ready(timeout=120)
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "node.key").write_bytes((tmp_path / "a" / "node.key").read_bytes())
        twin = NodeProcess("inference-b", join_argv("inference", ready, tmp_path / "b"), logs)
        nodes.append(twin)
        twin.wait_ready(timeout=120)

        def named() -> bool:
            return any(_state(tmp_path / d)[0] != 0 for d in ("a", "b"))

        asyncio.run(until(named, "a volunteer to say another node uses its identity", timeout=180, every=2.0))
        said = [_state(tmp_path / d) for d in ("a", "b")]
        assert any(code != 0 and "another node uses this node's identity" in text for code, text in said), said
        assert any("node.key" in text for _, text in said)
    finally:
        for node in reversed(nodes):
            node.stop()
