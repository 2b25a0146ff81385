"""What the contribution ledger costs (protocol/ledger.py, node/roles/trainer_ledger.py), on this machine.

    python benchmarks/ledger.py [--dir PATH] [--chain 10000]

- one step's entry at 1,000 and 100,000 batches: building it (columns and Merkle root), sealing it (msgpack and
  an Ed25519 signature), appending it to the ledger file with its fsync (what the trainer does before it publishes
  a version), its size, and checking it as a volunteer does (signature, link, root);
- one batch's inclusion proof at each size: its bytes and the time to check it against the root;
- a whole chain of ``--chain`` steps of 8 batches each (a small swarm's steps), checked from the run id alone;
- the audit (node/roles/audit.py): a real tiny run (a trainer, an inference node and an auditor node, processes on
  loopback, 3 steps), the auditor's replays over the network while the run goes on (node/roles/auditor_node.py),
  the newest step replayed from the trainer's data dir with 1 and 2 threads (time, largest weight difference), and
  four dishonest trainers played by publishing what each would have made from the same checkpoint (other data, a
  batch skipped, 3x the learning rate) or by committing optimizer moments the step did not make: whether each is
  caught.

Prints tables, then ``ledger entries=... verify_s=... proof_bytes=... step_100k_ms=... step_100k_bytes=...
replay_s=... replay_max_abs_diff=... network_audits=H/N caught=K/K`` (H of the auditor node's N replays honest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from intellect_node.launch import NodeProcess, join_argv
from intellect_node.p2p.keys import load_or_create
from intellect_node.policy.engine import Group
from intellect_node.roles.audit import AuditResult, replay, step_inputs, step_weights
from intellect_node.roles.trainer_ledger import LedgerLog
from intellect_node.weights.files import sha256_file, write_checkpoint
from intellect_protocol.envelope import seal
from intellect_protocol.identity import Identity
from intellect_protocol.ledger import (
    BatchCredit,
    entry_of,
    genesis,
    inclusion_proof,
    leaf_hash,
    start,
    verify_chain,
    verify_entry,
    verify_inclusion,
)
from intellect_protocol.messages import RunSpec

TRAIN = hashlib.sha256(b"train settings").hexdigest()


def credits(n: int, version: int, producers: list[str]) -> list[BatchCredit]:
    return [
        BatchCredit(
            producers[i % len(producers)], hashlib.sha256(f"{version}/{i}".encode()).hexdigest(), version - 1, 32, 1024
        )
        for i in range(n)
    ]


def one_step(root: Path, run: Identity, n: int) -> dict[str, float]:
    producers = [os.urandom(16).hex() for _ in range(min(n, 1000))]
    refusals = {p: {"unassigned_task": 1} for p in producers[:100]}
    batch = credits(n, 1, producers)
    t0 = time.perf_counter()
    entry = entry_of(run.node_id, 0, 1, 0, genesis(run.node_id), time.time(), TRAIN, batch, refusals)
    t1 = time.perf_counter()
    sealed = seal(run, entry)
    t2 = time.perf_counter()
    log = LedgerLog(root / f"step-{n}", run.node_id)
    log.append(sealed, entry)  # as the trainer does: its link to the chain checked, then written and fsynced
    t3 = time.perf_counter()
    verify_entry(sealed, run.node_id, start(run.node_id))
    t4 = time.perf_counter()
    leaves = [leaf_hash(c) for c in batch]
    proof = inclusion_proof(leaves, n // 2)
    t5 = time.perf_counter()
    assert verify_inclusion(leaves[n // 2], n // 2, n, proof, bytes.fromhex(entry.root))
    t6 = time.perf_counter()
    return {
        "build_ms": (t1 - t0) * 1000,
        "seal_ms": (t2 - t1) * 1000,
        "append_ms": (t3 - t2) * 1000,
        "check_ms": (t4 - t3) * 1000,
        "bytes": len(sealed),
        "proof_bytes": 32 * len(proof),
        "proof_check_us": (t6 - t5) * 1e6,
    }


def chain(run: Identity, steps: int) -> tuple[float, float, int]:
    """Seconds to make ``steps`` entries of 8 batches, seconds to check them all, and their bytes."""
    producers = [os.urandom(16).hex() for _ in range(8)]
    made, prev = [], genesis(run.node_id)
    t0 = time.perf_counter()
    for v in range(1, steps + 1):
        sealed = seal(run, entry_of(run.node_id, 0, v, v - 1, prev, time.time(), TRAIN, credits(8, v, producers)))
        made.append(sealed)
        prev = hashlib.sha256(sealed).hexdigest()
    t1 = time.perf_counter()
    head = verify_chain(made, run.node_id)
    t2 = time.perf_counter()
    assert head.length == steps
    return t1 - t0, t2 - t1, sum(len(s) for s in made)


AUDIT_STEPS = 3


def tiny_run(root: Path) -> tuple[Path, list[str]]:
    """A trainer's data dir after AUDIT_STEPS steps of the tiny run with one inference node (real processes), and
    the ``AUDIT`` lines of an auditor node that replayed steps over the network meanwhile."""
    nodes: list[NodeProcess] = []
    try:
        trainer = NodeProcess(
            "trainer",
            ["bootstrap", "--data-dir", str(root / "trainer"), "--max-steps", str(AUDIT_STEPS)],
            root / "logs",
        )
        nodes.append(trainer)
        ready = trainer.wait_ready(timeout=120)
        worker = NodeProcess("inference", join_argv("inference", ready, root / "inference"), root / "logs")
        nodes.append(worker)
        argv = join_argv("auditor", ready, root / "auditor", "--audit-every-s", "1")
        auditor = NodeProcess("auditor", argv, root / "logs")
        nodes.append(auditor)
        worker.wait_ready(timeout=120)
        trainer.wait_for_line(f"STEP {AUDIT_STEPS} ", timeout=600)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the last version and its entry are written after its STEP line
            with urllib.request.urlopen(ready["status_url"] + "/status", timeout=10) as resp:
                status = json.load(resp)
            if status["weight_version"] == AUDIT_STEPS and status["ledger"]["length"] == AUDIT_STEPS:
                break
            time.sleep(0.2)
        auditor.wait_for_line(f"AUDIT audit version={AUDIT_STEPS} ", timeout=300)
    finally:
        for node in reversed(nodes):
            node.stop()
    lines = (root / "logs" / "auditor.out").read_text().splitlines()
    return root / "trainer", [line for line in lines if line.startswith("AUDIT ")]


Change = Callable[[RunSpec, list[Group]], tuple[RunSpec, list[Group]]]


def other_data(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
    g, other = groups[0], groups[-1]
    return spec, [
        Group(g.node_id, g.version, g.prompt_ids, other.completions, other.logprobs, other.rewards[::-1]),
        *groups[1:],
    ]


def skipped_batch(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
    return spec, [g for g in groups if g.digest != groups[0].digest]


def hotter(spec: RunSpec, groups: list[Group]) -> tuple[RunSpec, list[Group]]:
    return spec.model_copy(update={"train": spec.train.model_copy(update={"lr": spec.train.lr * 3})}), groups


def dishonest(trainer_dir: Path, to: Path, change: Change) -> AuditResult:
    """The audit of a copy of ``trainer_dir`` whose newest version is what a trainer making ``change`` published."""
    shutil.copytree(trainer_dir, to)
    inputs = step_inputs(to)
    _, tensors = step_weights(inputs, *change(inputs.spec, inputs.groups))
    weights = to / "weights" / inputs.run_id
    entry = inputs.entry
    shutil.rmtree(weights / str(entry.version))
    manifest = write_checkpoint(weights, inputs.run, inputs.run_id, entry.version, tensors, 1 << 30, epoch=entry.epoch)
    ledger = LedgerLog(to / "ledger", inputs.run_id)  # and signs an entry that names those weights
    ledger.drop_unpublished(entry.epoch, entry.version - 1)
    forged = entry.model_copy(update={"weights": manifest.checkpoint_sha256, "prev": ledger.head.hash})
    ledger.append(seal(inputs.run, forged))
    return replay(to)


def made_up_state(trainer_dir: Path, to: Path) -> AuditResult:
    """The audit of a copy of ``trainer_dir`` whose newest checkpoint holds optimizer moments the step did not make
    (to cover a later dishonest step), committed to by a re-signed entry."""
    shutil.copytree(trainer_dir, to)
    run = load_or_create(to / "node.key")
    path = to / "checkpoints" / run.node_id / f"step-{AUDIT_STEPS:08d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    next(iter(state["engine"]["optimizer"]["state"].values()))["exp_avg_sq"].mul_(1.5)
    torch.save(state, path)
    ledger = LedgerLog(to / "ledger", run.node_id)
    last = ledger.entry(len(ledger) - 1)
    ledger.drop_unpublished(last.epoch, last.version - 1)
    ledger.append(seal(run, last.model_copy(update={"state": sha256_file(path), "prev": ledger.head.hash})))
    return replay(to)


def audits(root: Path) -> tuple[list[tuple[str, float, AuditResult]], int, int, list[str]]:
    trainer_dir, network = tiny_run(root)
    rows = []
    for threads in (1, 2):
        t0 = time.perf_counter()
        result = replay(trainer_dir, threads=threads)
        rows.append((f"honest, replayed with {threads} thread(s)", time.perf_counter() - t0, result))
    caught = 0
    forgeries = (("other data", other_data), ("a batch skipped", skipped_batch), ("3x the learning rate", hotter))
    for name, change in forgeries:
        t0 = time.perf_counter()
        result = dishonest(trainer_dir, root / name.replace(" ", "_"), change)
        rows.append((f"dishonest: {name}", time.perf_counter() - t0, result))
        caught += result.verdict == "caught"
    t0 = time.perf_counter()
    result = made_up_state(trainer_dir, root / "made_up_state")
    rows.append(("dishonest: optimizer moments made up", time.perf_counter() - t0, result))
    caught += result.verdict == "caught"
    return rows, caught, len(forgeries) + 1, network


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, help="a folder on the disk to measure (default: a temporary one)")
    p.add_argument("--chain", type=int, default=10_000, help="steps in the chain checked whole (default 10000)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="intellect-ledger-", dir=args.dir))
    run = Identity.generate()
    sizes = (1_000, 100_000)
    steps = {n: one_step(root, run, n) for n in sizes}
    make_s, verify_s, chain_bytes = chain(run, args.chain)
    print(
        "| batches in the step | build ms | seal ms | append + fsync ms | check ms | entry bytes | proof bytes "
        "| proof check us |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in steps.items():
        print(
            f"| {n:,} | {r['build_ms']:.1f} | {r['seal_ms']:.1f} | {r['append_ms']:.1f} | {r['check_ms']:.1f} | "
            f"{r['bytes']:,} | {r['proof_bytes']} | {r['proof_check_us']:.0f} |"
        )
    print(
        f"\nchain of {args.chain:,} steps of 8 batches: made in {make_s:.1f} s, checked from the run id in "
        f"{verify_s:.1f} s ({verify_s / args.chain * 1000:.2f} ms an entry), {chain_bytes / 1e6:.1f} MB"
    )
    rows, caught, forged, network = audits(root / "audit")
    print(
        "\n| audit of the tiny run's newest step | seconds | largest weight difference | the step's largest change "
        "| engine state vs the trainer's next checkpoint | verdict |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for label, seconds, r in rows:
        state = "not compared" if r.state_diff is None else f"{r.state_diff:.3g}"
        verdict = r.verdict + (f" ({r.reason})" if r.reason else "")
        print(f"| {label} | {seconds:.1f} | {r.max_abs_diff:.3g} | {r.update_max:.3g} | {state} | {verdict} |")
    print("\nthe auditor node's replays over the network during the run:")
    for line in network:
        print(f"  {line}")
    honest = [r for label, _, r in rows if label.startswith("honest")]
    replay_s = min(seconds for label, seconds, _ in rows if label.startswith("honest"))
    big = steps[sizes[-1]]
    print(
        f"ledger entries={args.chain} verify_s={verify_s:.2f} proof_bytes={big['proof_bytes']} "
        f"step_100k_ms={big['build_ms'] + big['seal_ms'] + big['append_ms']:.0f} step_100k_bytes={big['bytes']} "
        f"replay_s={replay_s:.1f} replay_max_abs_diff={max(r.max_abs_diff for r in honest):.3g} "
        f"network_audits={sum('verdict=honest' in line for line in network)}/{len(network)} caught={caught}/{forged}"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
