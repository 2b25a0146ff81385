"""The README's operator and volunteer sequences, played on loopback through the real CLI (run by hand; the tests
cover each state on its own): ``bash scripts/operator_check.sh`` or ``python scripts/operator_check.py``.

Every scenario checks what a person relies on: that the node says what state it is in (``intellect-node status``
exits 1 and says why when a node is not doing its job), that a refusal ends the node with the reason and the fix,
and that every stop is quick and quiet. One line per scenario, then

    operator scenarios=N ok=N silent_states=0 tracebacks=0 max_stop_s=X

``silent_states``: states a node should have reported and did not (a volunteer whose trainer is gone shown healthy,
an untrusted validator shown judging) or reported wrongly; ``tracebacks``: Python tracebacks in any node's log;
``max_stop_s``: the longest time from a SIGTERM (to a node, or to its process group) to its exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intellect_node.launch import NodeExited, NodeProcess, join_argv

CLI = [sys.executable, "-m", "intellect_node.cli"]


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str
    silent: int = 0
    """States that should have been reported and were not (or were reported wrongly)."""


@dataclass
class Operator:
    work: Path
    nodes: list[NodeProcess] = field(default_factory=list)
    stops: list[float] = field(default_factory=list)

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def start(self, name: str, argv: list[str]) -> NodeProcess:
        node = NodeProcess(name, argv, self.logs)
        self.nodes.append(node)
        return node

    def stop(self, node: NodeProcess, group: bool = False) -> float:
        """SIGTERM to the node (or its whole process group, as `timeout`, systemd or Ctrl-C in a terminal do);
        the seconds until it exited."""
        began = time.monotonic()
        if node.proc.poll() is None:
            if group:
                os.killpg(node.proc.pid, signal.SIGTERM)
            else:
                node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        took = time.monotonic() - began
        self.stops.append(took)
        node.stop()
        return took

    def cli(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "COLUMNS": "1000"}  # `status`: one table row a line, no text wrapped inside a cell
        return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, env=env)

    def state(self, data_dir: Path) -> tuple[int, str]:
        shown = self.cli("status", "--data-dir", str(data_dir), timeout=60)
        return shown.returncode, " ".join((shown.stdout + shown.stderr).split())


def until(done: Callable[[], bool], timeout: float, every: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(every)
    return done()


def status(url: str) -> dict[str, Any]:
    import json

    with urllib.request.urlopen(url + "/status", timeout=10) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def refused(node: NodeProcess, timeout: float = 120) -> tuple[bool, str]:
    """Whether the node ended with a non-zero code before READY, and the last lines of its log."""
    try:
        node.wait_ready(timeout=timeout)
    except NodeExited:
        return node.proc.returncode not in (0, None), node.tail(3)
    except TimeoutError:
        return False, "still running"
    return False, "it started (READY)"


def play(op: Operator) -> list[Outcome]:
    out: list[Outcome] = []
    w = op.work
    boot = ["bootstrap", "--data-dir", str(w / "t"), "--host", "127.0.0.1"]
    boot += ["--p2p-port", str(_free_port()), "--http-port", str(_free_port())]
    v1 = op.cli("id", "--data-dir", str(w / "v1")).stdout.strip()
    boot += ["--validator", v1]

    trainer = op.start("trainer", boot)
    ready = trainer.wait_ready(timeout=180)
    out.append(Outcome("bootstrap prints the join line", "run_id" in ready, f"run {ready['run_id']}"))

    inference = op.start("inference", join_argv("inference", ready, w / "i"))
    relay = op.start("relay", join_argv("relay", ready, w / "r"))
    validator = op.start("validator", join_argv("validator", ready, w / "v1"))
    for node in (inference, relay, validator):
        node.wait_ready(timeout=180)
    url = ready["status_url"]
    trained = until(lambda: status(url)["step"] >= 2, 240)
    states = {name: op.state(w / d) for name, d in (("inference", "i"), ("relay", "r"), ("validator", "v1"))}
    wrong = [n for n, (code, _) in states.items() if code != 0]
    out.append(
        Outcome(
            "join inference, relay, trusted validator",
            trained and not wrong,
            f"trainer at step {status(url)['step']}; states: "
            + "; ".join(f"{n}: {s.split('state ', 1)[-1][:60]}" for n, (_, s) in states.items()),
            len(wrong),
        )
    )
    v_url = validator.ready["status_url"] if validator.ready else url
    judged = until(lambda: status(v_url).get("judged", 0) > 0, 240)
    out.append(Outcome("the trusted validator judges", judged, f"judged {status(v_url).get('judged')}"))

    stranger = op.start("validator-untrusted", join_argv("validator", ready, w / "v2"))
    stranger.wait_ready(timeout=180)
    said = until(lambda: op.state(w / "v2")[0] == 1, 300, every=3.0)
    text = op.state(w / "v2")[1]
    out.append(
        Outcome(
            "an untrusted validator says it is not asked",
            said and "--validator" in text,
            text[text.find("NOT WORKING") :][:110] if said else "it stayed silent",
            0 if said else 1,
        )
    )
    op.stop(stranger)

    twin = op.start("inference-twin", join_argv("inference", ready, w / "i"))
    ok, tail = refused(twin, timeout=60)
    last = tail.splitlines()[-1][:110] if tail else ""
    out.append(Outcome("two nodes on one data dir", ok and "in use by process" in tail, last))

    # the trainer stops (SIGTERM) and comes back with the same command: volunteers say they wait, then carry on
    took = op.stop(trainer)
    gone = until(lambda: op.state(w / "i")[0] == 1 and op.state(w / "r")[0] == 1, 90, every=3.0)
    early = op.start("relay-early", join_argv("relay", ready, w / "r2", "--join-timeout", "0"))
    # it must wait for the trainer, not give up after one try: its second try, and it still runs
    tried = until(lambda: "none of --peers answered (try 2)" in early.log_path.read_text(errors="replace"), 120, 0.5)
    waiting = tried and early.proc.poll() is None
    accepted = status(inference.ready["status_url"])["batches_accepted"] if inference.ready else 0
    trainer = op.start("trainer-restarted", boot)
    trainer.wait_ready(timeout=180)
    early_ready = True
    try:
        early.wait_ready(timeout=240)
    except (NodeExited, TimeoutError):
        early_ready = False
    again = until(lambda: status(inference.ready["status_url"])["batches_accepted"] > accepted, 240)
    back = until(lambda: op.state(w / "i")[0] == 0, 120, every=3.0)
    out.append(
        Outcome(
            "trainer restart: volunteers wait, then carry on",
            gone and waiting and early_ready and again and back,
            f"stop {took:.1f} s; volunteers said the trainer was gone: {gone}; a relay started meanwhile waited: "
            f"{waiting}, joined: {early_ready}; batches accepted again: {again}",
            int(not gone) + int(not back),
        )
    )

    # kill -9: nothing cleaned up, the same command resumes
    step = status(trainer.ready["status_url"] if trainer.ready else url)["step"]
    trainer.proc.send_signal(signal.SIGKILL)
    trainer.proc.wait(timeout=30)
    trainer.stop()
    accepted = status(inference.ready["status_url"])["batches_accepted"] if inference.ready else 0
    trainer = op.start("trainer-after-kill", boot)
    resumed = trainer.wait_ready(timeout=180)
    again = until(lambda: status(inference.ready["status_url"])["batches_accepted"] > accepted, 240)
    out.append(
        Outcome(
            "trainer kill -9: the same command resumes",
            again and status(resumed["status_url"])["step"] >= min(step, 1),
            f"killed at step {step}; resumed at step {status(resumed['status_url'])['step']}; batches accepted "
            f"again: {again}",
        )
    )

    out += invites(op)

    # every node at once, as Ctrl-C in a terminal or `systemctl stop` does: each ends within seconds
    slowest = 0.0
    for node in [n for n in op.nodes if n.proc.poll() is None]:
        slowest = max(slowest, op.stop(node, group=True))
    out.append(Outcome("SIGTERM to each node's process group", slowest < 10, f"slowest stop {slowest:.1f} s"))
    return out


def invites(op: Operator) -> list[Outcome]:
    """An invite-only run: a good invite joins, the same one again, a made-up one and an expired one are refused
    at join with the reason and what to do; an invite that is expired when minted is refused by `invite`."""
    w = op.work / "invite-run"
    boot = ["bootstrap", "--data-dir", str(w / "t"), "--host", "127.0.0.1", "--set", "admission.policy=invite"]
    trainer = op.start("invite-trainer", boot)
    ready = trainer.wait_ready(timeout=180)
    mint = op.cli("invite", "--data-dir", str(w / "t"), "--uses", "1").stdout.split()
    token = mint[mint.index("--invite") + 1]
    good = op.start("invited", join_argv("relay", ready, w / "a", "--invite", token))
    joined = True
    try:
        good.wait_ready(timeout=180)
    except (NodeExited, TimeoutError):
        joined = False
    out = [Outcome("a good invite joins", joined, good.tail(1)[:110] if not joined else "READY")]
    cases = {
        "an invite used up": token,
        "a made-up invite": token[:-6] + ("A" if token[-6] != "A" else "B") + token[-5:],
    }
    short = op.cli("invite", "--data-dir", str(w / "t"), "--days", "0.00002").stdout.split()  # 1.7 s
    time.sleep(3)  # the invite's own expiry (1.7 s after minting) is what this waits for
    cases["an expired invite"] = short[short.index("--invite") + 1]
    for i, (what, invite) in enumerate(cases.items()):
        node = op.start(f"invited-{i}", join_argv("relay", ready, w / f"b{i}", "--invite", invite))
        ok, tail = refused(node)
        last = tail.splitlines()[-1][:110] if tail else ""
        out.append(Outcome(f"{what} is refused at join", ok and "refused this node" in tail, last))
    zero = op.cli("invite", "--data-dir", str(w / "t"), "--days", "0")
    out.append(Outcome("`invite --days 0` is refused", zero.returncode != 0, zero.stderr.strip()[:110]))
    op.stop(good)
    op.stop(trainer)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) afterwards")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="operator-check-"))
    op = Operator(work)
    outcomes: list[Outcome] = []
    try:
        outcomes = play(op)
    finally:
        for node in op.nodes:
            node.stop()
    tracebacks = sum(p.read_text(errors="replace").count("Traceback") for p in op.logs.glob("*.log"))
    for o in outcomes:
        print(f"{'ok  ' if o.ok else 'FAIL'} {o.name}: {o.detail}")
    print(f"logs: {op.logs}" if args.keep or not all(o.ok for o in outcomes) or tracebacks else "")
    print(
        f"operator scenarios={len(outcomes)} ok={sum(o.ok for o in outcomes)} "
        f"silent_states={sum(o.silent for o in outcomes)} tracebacks={tracebacks} "
        f"max_stop_s={max(op.stops, default=0.0):.1f}"
    )
    if not (args.keep or not all(o.ok for o in outcomes) or tracebacks):
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
