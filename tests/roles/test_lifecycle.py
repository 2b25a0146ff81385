"""Processes as an operator sees them (issue 13 items 5, 8, 9): a node's DHT process and go-libp2p daemon die
with it however it dies, never hold its ports, every role exits within seconds on SIGTERM (to it alone or to its
process group), and a restarted node keeps its libp2p identity and port, so the join line it printed stays valid."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import psutil

from intellect_node.launch import NodeProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running (zombies count as gone) after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_a_trainer_killed_alone_takes_its_dht_along_and_restarts_on_the_same_ports_and_identity(
    tmp_path: Path,
) -> None:
    http_port, p2p_port = _free_port(), _free_port()
    boot = ["bootstrap", "--data-dir", str(tmp_path / "t"), "--http-port", str(http_port), "--p2p-port",
            str(p2p_port), "--max-steps", "0"]  # fmt: skip
    nodes: list[NodeProcess] = []
    try:
        first = NodeProcess("trainer", boot, tmp_path / "logs")
        nodes.append(first)
        ready = first.wait_ready(timeout=120)
        children = _descendants(first.proc.pid)
        assert children, "the trainer runs its DHT in a child process (and p2pd below it)"
        first.proc.send_signal(signal.SIGKILL)  # to it alone: no chance to clean anything up
        first.proc.wait(timeout=10)
        left = _wait_gone(children, timeout=10)
        assert not left, [p.cmdline()[:3] for p in left]

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
        trainer = NodeProcess("trainer", ["bootstrap", "--data-dir", str(tmp_path / "t"), "--max-steps", "0"],
                              tmp_path / "logs")  # fmt: skip
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        relay = NodeProcess(
            "relay",
            ["join", "--role", "relay", "--peers", ready["p2p_maddrs"][0], "--run-id", ready["run_id"],
             "--data-dir", str(tmp_path / "r")],
            tmp_path / "logs",
        )  # fmt: skip
        nodes.append(relay)
        relay_ready = relay.wait_ready(timeout=120)
        family = [psutil.Process(relay.proc.pid), *_descendants(relay.proc.pid)]
        assert len(family) >= 2
        relay.proc.send_signal(signal.SIGTERM)  # to it alone
        relay.proc.wait(timeout=20)
        assert not _wait_gone(family, timeout=10)

        # it rejoins with the same data dir as the same libp2p peer
        again = NodeProcess(
            "relay-2",
            ["join", "--role", "relay", "--peers", ready["p2p_maddrs"][0], "--run-id", ready["run_id"],
             "--data-dir", str(tmp_path / "r")],
            tmp_path / "logs",
        )  # fmt: skip
        nodes.append(again)
        again_ready = again.wait_ready(timeout=120)
        peer = relay_ready["p2p_maddrs"][0].rsplit("/p2p/", 1)[1]
        assert again_ready["p2p_maddrs"][0].endswith(f"/p2p/{peer}")
    finally:
        for node in reversed(nodes):
            node.stop()
