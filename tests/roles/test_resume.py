"""Integration: a trainer killed mid-run (SIGKILL, its DHT and p2pd too) restarts from its checkpoint with the same
key; the inference node keeps running and catches up; no step is trained twice, no version number is reused, and
the contribution ledger has one entry per version across both lives (and across a new epoch)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from intellect_node.launch import NodeProcess, join_argv
from intellect_node.p2p.http import EncodedList
from intellect_node.roles.trainer_checkpoint import HISTORY, CheckpointDir, next_epoch
from intellect_node.roles.trainer_ledger import parse_framed
from intellect_node.weights.files import MANIFEST_NAME, verify_manifest
from intellect_protocol.envelope import open_signed
from intellect_protocol.ledger import LedgerEntry, verify_chain
from tests.helpers.wait import until

STEPS = 9
KILL_AT = 4


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/status", timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)
        return data


def _ledger(url: str, run_id: str, done: Callable[[list[LedgerEntry]], bool]) -> list[LedgerEntry]:
    """The trainer's contribution ledger, checked with the run id alone, once ``done`` says it holds what the test
    waits for (the last version's entry is written after the step's STEP line)."""
    entries: list[LedgerEntry] = []

    def fetched() -> bool:
        with urllib.request.urlopen(url + "/ledger/entries", timeout=10) as resp:
            sealed = parse_framed(resp.read())
        verify_chain(sealed, run_id)
        entries[:] = [open_signed(s, LedgerEntry).message for s in sealed]
        return done(entries)

    asyncio.run(until(fetched, "the ledger entries", timeout=60, every=0.5))
    return entries


def _manifests(root: Path) -> dict[int, str]:
    return {
        int(p.parent.name): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.glob("*/manifest.msgpack")
        if p.parent.name.isdigit()
    }


def _trainer_and_worker(
    boot: list[str], tmp_path: Path, nodes: list[NodeProcess]
) -> tuple[NodeProcess, dict[str, Any], NodeProcess, dict[str, Any]]:
    """A trainer started with ``boot`` and an inference node joined with the line it printed (both in ``nodes``,
    for the caller to stop)."""
    first = NodeProcess("trainer", boot, tmp_path / "logs")
    nodes.append(first)
    ready = first.wait_ready(timeout=120)
    worker = NodeProcess("inference", join_argv("inference", ready, tmp_path / "inference"), tmp_path / "logs")
    nodes.append(worker)
    return first, ready, worker, worker.wait_ready(timeout=120)


@pytest.mark.integration
def test_a_killed_trainer_resumes_and_the_swarm_catches_up(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    data = tmp_path / "trainer"
    boot = ["bootstrap", "--data-dir", str(data), "--max-steps", str(STEPS)]
    nodes: list[NodeProcess] = []
    try:
        first, ready, worker, worker_ready = _trainer_and_worker(boot, tmp_path, nodes)
        first.wait_for_line(f"STEP {KILL_AT} ", timeout=300)
        os.killpg(first.proc.pid, signal.SIGKILL)  # no chance to save anything on the way out
        first.proc.wait(timeout=30)
        weights = data / "weights" / ready["run_id"]
        before = _manifests(weights)
        assert before, "the first trainer published nothing"

        second = NodeProcess("trainer-2", boot, logs)  # the same command, the same key: it resumes
        nodes.append(second)
        ready2 = second.wait_ready(timeout=120)
        assert ready2["run_id"] == ready["run_id"]
        second.wait_for_line(f"STEP {STEPS} ", timeout=300)
        status = _status(ready2["status_url"])
        resumed = status["resumed"]
        # it resumes from the last durable checkpoint: the killed step's, or the one before if the kill came while
        # it was being written; no version had been published beyond it (a checkpoint precedes its publication)
        assert resumed is not None and resumed["from_step"] >= KILL_AT - 1, resumed
        assert max(before) <= resumed["from_step"], (sorted(before), resumed)
        # every step exactly once, across both lives of the trainer
        assert [h["step"] for h in status["history"]] == list(range(1, STEPS + 1))
        # a version number that went out before the crash still names the same signed weights
        after = _manifests(weights)
        for version in set(before) & set(after):
            assert before[version] == after[version], f"version {version} was republished with other weights"
        # the inference node never stopped; it moved on to versions the resumed trainer trained
        versions = _status(worker_ready["status_url"])["versions_loaded"]
        assert versions == sorted(set(versions)), versions
        assert max(versions) > resumed["from_step"], versions
        assert status["accepted_groups_by_node"].get(worker_ready["node_id"], 0) > 0
        # issue 39 item 4: one ledger entry per version across both lives, none lost or written twice
        entries = _ledger(ready2["status_url"], ready["run_id"], lambda got: len(got) >= STEPS)
        assert [(e.version, e.parent) for e in entries] == [(v, v - 1) for v in range(1, STEPS + 1)]
        assert all(set(e.producers) == {worker_ready["node_id"]} for e in entries)
    finally:
        for node in reversed(nodes):
            node.stop()


def test_the_spool_returns_every_whole_record_and_ignores_a_torn_tail(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    ckpt.start_spool(3)
    ckpt.append(b"a" * 10)
    ckpt.start_spool(5)
    ckpt.append(b"b" * 20)
    ckpt.append(b"c" * 30)
    ckpt.close()
    with open(tmp_path / "spool-00000005.bin", "ab") as f:
        f.write(b"\x00\x00\x01\x00partial")  # a record cut by a crash
    assert list(ckpt.spooled_since(3)) == [b"a" * 10, b"b" * 20, b"c" * 30]
    assert list(ckpt.spooled_since(4)) == [b"b" * 20, b"c" * 30]
    ckpt.start_spool(5)  # a restart at the same step: the torn tail goes, so what is appended now stays readable
    ckpt.append(b"d" * 5)
    assert list(ckpt.spooled_since(5)) == [b"b" * 20, b"c" * 30, b"d" * 5]
    ckpt.write(4, {"step": 4})
    ckpt.write(5, {"step": 5})
    ckpt.write(6, {"step": 6})
    assert ckpt.steps() == [5, 6]
    latest = ckpt.latest()
    assert latest is not None and latest["step"] == 6
    assert not (tmp_path / "spool-00000003.bin").exists()  # covered by the kept checkpoints


def test_each_steps_stats_are_written_once_and_a_resume_gets_exactly_the_checkpoints_steps(tmp_path: Path) -> None:
    """The step history used to be pickled whole into every checkpoint (one per step by default): that cost grew
    with the run and slowed the trainer by a fifth in 15 minutes. Now each step's line is appended once, durable
    before the checkpoint that counts it; lines of a checkpoint that never landed are cut off on resume."""
    history = EncodedList()
    ckpt = CheckpointDir(tmp_path)
    (tmp_path / HISTORY).write_text('{"step": 99}\n')  # left by another run in this directory
    for step in (1, 2, 3):
        history.append({"step": step, "loss": 0.5 / step})
        ckpt.write(step, {"step": step, "history": history, "history_len": len(history)})
    assert (tmp_path / HISTORY).read_text().count("\n") == 3  # one line per step, the stranger's gone
    history.append({"step": 4, "loss": 0.1})
    ckpt._write_history(history, 4)  # a crash after the history line, before checkpoint 4 landed

    again = CheckpointDir(tmp_path)
    latest = again.latest()
    assert latest is not None and latest["step"] == 3
    assert latest["history"] == [{"step": s, "loss": 0.5 / s} for s in (1, 2, 3)]
    resumed = EncodedList(latest["history"])
    resumed.append({"step": 4, "loss": 0.2})  # step 4 trained again after the resume
    again.write(4, {"step": 4, "history": resumed, "history_len": len(resumed)})
    final = CheckpointDir(tmp_path).latest()
    assert final is not None and [h["step"] for h in final["history"]] == [1, 2, 3, 4]
    assert final["history"][-1]["loss"] == 0.2


def test_a_new_epoch_is_larger_than_the_last_even_when_the_clock_is_behind(tmp_path: Path) -> None:
    path = tmp_path / "epochs" / "run"
    first = next_epoch(path)
    path.write_text(str(first + 10**12))  # a clock set back by ~11 days since
    assert next_epoch(path) == first + 10**12 + 1


@pytest.mark.integration
def test_a_run_started_over_gets_a_new_epoch_and_the_swarm_follows_it(tmp_path: Path) -> None:
    """Issue 13 item 1: ``--fresh`` numbers versions from 0 again. Before epochs, the inference node kept its old
    copy of version N (trusted by number), generated on it, and died on a pruned folder; now it sees the new epoch,
    drops the old versions and its batches are trained on again."""
    logs = tmp_path / "logs"
    data = tmp_path / "trainer"
    boot = ["bootstrap", "--data-dir", str(data), "--max-steps", "3", "--p2p-port", "0"]
    nodes: list[NodeProcess] = []
    try:
        first, ready, worker, worker_ready = _trainer_and_worker(boot, tmp_path, nodes)
        first.wait_for_line("STEP 3 ", timeout=300)
        old_epoch = _status(ready["status_url"])["epoch"]
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)

        # the same key, started over; it rejoins the DHT through the worker, which still runs
        again = [*boot, "--fresh", "--peers", worker_ready["p2p_maddrs"][0]]
        second = NodeProcess("trainer-2", again, logs)
        nodes.append(second)
        ready2 = second.wait_ready(timeout=120)
        second.wait_for_line("STEP 3 ", timeout=300)
        status = _status(ready2["status_url"])
        assert status["epoch"] > old_epoch
        assert status["accepted_groups_by_node"].get(worker_ready["node_id"], 0) > 0, status
        assert worker.proc.poll() is None, worker.tail()
        mine = _status(worker_ready["status_url"])
        assert mine["epoch"] == status["epoch"]
        # only the new epoch's weights are left on the worker: an old version N can never pass for the new one
        root = tmp_path / "inference" / "weights" / ready["run_id"]
        held = [p for p in root.iterdir() if p.name.isdigit()]
        assert held
        for folder in held:
            manifest = verify_manifest((folder / MANIFEST_NAME).read_bytes(), ready["run_id"], int(folder.name))
            assert manifest.epoch == status["epoch"]
        # the ledger goes on through the new epoch, whose versions count from 1 again
        entries = _ledger(
            ready2["status_url"],
            ready["run_id"],
            lambda got: bool(got) and got[-1].epoch > old_epoch and got[-1].version >= 3,
        )
        new = [e.version for e in entries if e.epoch == status["epoch"]]
        old = [e.version for e in entries if e.epoch == old_epoch]
        assert new == [1, 2, 3] and old == list(range(1, len(old) + 1)) and len(old) >= 2, (old, new)
    finally:
        for node in reversed(nodes):
            node.stop()
