"""The sharded engine (node/policy/fsdp.py) against the single-process one: two real CPU processes on gloo,
under torchrun.

The test process runs ``PolicyEngine`` on the same spec, model and batches that a torchrun job (this file run as a
script) feeds to ``ShardedEngine``, and compares the exported weights and the step statistics. A second check kills
rank 0 and requires the follower to exit on its own instead of waiting forever.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from intellect_kernels.grpo import group_advantages
from intellect_node.config import RunConfig
from intellect_node.policy.engine import Group, Packed, PolicyEngine, pack_sequences
from intellect_node.policy.model import build_model, build_tokenizer
from intellect_protocol.messages import RunSpec

pytestmark = pytest.mark.integration

LRS = (1e-3, 5e-4)
# Float rounding differs between the ranks' partial sums and one pass (about 1e-7 relative); Adam normalizes
# each gradient element, so the weights may differ by a small fraction of lr (1e-3) per step (measured: at most
# 6e-7 after two rollout steps). 2e-5 leaves room for other CPUs' kernels and stays far below the weights'
# movement (about lr per element per optimizer step), which is checked too.
ATOL = 2e-5


def make_spec() -> RunSpec:
    run = RunConfig()
    train = run.train.model_copy(
        update=dict(optimizer_steps=2, kl_coef=0.05, entropy_coef=0.01, max_grad_norm=0.5, weight_decay=0.01)
    )
    return RunSpec(
        run_id="0" * 32,
        created=0.0,
        seed=0,
        model=run.model,
        task=run.task,
        sampling=run.sampling,
        train=train,
        verify=run.verify,
    )


def make_batches(spec: RunSpec, pad_id: int) -> list[Packed]:
    """Fixed rows with padding and a different completion length per row. Batch 0: 6 rows (minibatches of 3:
    1 row on rank 0, 2 on rank 1). Batch 1: 3 rows (a 1-row minibatch: rank 0 has no row at all)."""
    gen = torch.Generator().manual_seed(1234)
    vocab = len(spec.model.vocab)
    batches = []
    for groups, size in ((2, 3), (1, 3)):
        made = []
        for g in range(groups):
            prompt = [1] + torch.randint(3, vocab, (3 + g,), generator=gen).tolist()
            completions = [torch.randint(3, vocab, (2 + 3 * i + g,), generator=gen).tolist() for i in range(size)]
            logprobs = [(-2.5 + 0.5 * torch.randn(len(c), generator=gen)).tolist() for c in completions]
            rewards = torch.rand(size, generator=gen).tolist()
            made.append(Group("n", 0, prompt, completions, logprobs, rewards))
        ids, attn, mask, logp_old = pack_sequences(made, pad_id)
        adv = group_advantages(torch.tensor([g.rewards for g in made])).flatten()
        batches.append(Packed(ids, attn, mask, logp_old, adv))
    return batches


def worker(out: Path) -> None:
    """Rank 0 drives like the trainer: step, step, export; then a resume from the state after the first step."""
    from intellect_node.policy import fsdp

    placement = fsdp.init(timeout_s=60)
    torch.set_num_threads(1)
    try:
        if placement.rank != 0:
            fsdp.follow_rank0()
            return
        spec = RunSpec.model_validate_json((out / "spec.json").read_text())
        tok = build_tokenizer(spec.model)
        engine = fsdp.sharded_engine(spec, tok)
        batches = make_batches(spec, int(tok.pad_token_id))
        stats = [engine.step(batches[0], LRS[0])]
        first = engine.export_state()
        torch.save(engine.state(), out / "state1.pt")
        stats.append(engine.step(batches[1], LRS[1]))
        second = engine.export_state()
        engine.load_state(torch.load(out / "state1.pt", weights_only=True))
        resumed_stats = engine.step(batches[1], LRS[1])
        resumed = engine.export_state()
        engine.close()
        torch.save(
            {"first": first, "second": second, "resumed": resumed, "stats": stats, "resumed_stats": resumed_stats},
            out / "result.pt",
        )
    finally:
        fsdp.shutdown()


def _launch(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # timed out or interrupted: the whole group (torchrun and its workers) goes
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode, out)


def test_sharded_engine_matches_single_process(tmp_path: Path) -> None:
    spec = make_spec()
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    started = time.monotonic()
    done = _launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            str(tmp_path),
        ],
        {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},  # gloo on CPU, like the reference
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-5000:]
    print(f"torchrun job: {time.monotonic() - started:.1f} s")
    got = torch.load(tmp_path / "result.pt", weights_only=True)

    tok = build_tokenizer(spec.model)
    engine = PolicyEngine(
        spec, build_model(spec.model, tok, torch.float32), build_model(spec.model, tok, torch.float32)
    )
    batches = make_batches(spec, int(tok.pad_token_id))
    start = {k: v.clone() for k, v in engine.export_state().items()}
    for i, name in enumerate(("first", "second")):
        stats = engine.step(batches[i], LRS[i])
        want = engine.export_state()
        assert list(got[name]) == list(want), "the sharded export must have the local one's names, tied once"
        moved = max(float((want[k] - start[k]).abs().max()) for k in want)
        assert moved > 10 * ATOL, "the step did not move the weights: the comparison would prove nothing"
        for k in want:
            assert got[name][k].dtype == want[k].dtype
            diff = float((got[name][k] - want[k]).abs().max())
            assert diff <= ATOL, (name, k, diff)
        for k in ("loss", "entropy", "kl", "clipped_fraction", "grad_norm", "tokens", "logp_old_gap", "lr"):
            assert got["stats"][i][k] == pytest.approx(stats[k], rel=1e-4, abs=1e-6), (name, k)
        assert stats["grad_norm"] > spec.train.max_grad_norm, "clipping must be active for the test to check it"

    # Resuming from the state saved after step 1 repeats step 2 exactly (same ranks, same order of operations).
    for k in got["second"]:
        assert torch.equal(got["resumed"][k], got["second"][k]), k
    assert got["resumed_stats"] == got["stats"][1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DRIVER = """
import os, sys, torch
from intellect_node.policy import fsdp
sys.path.insert(0, os.environ["TEST_DIR"])
from test_fsdp import make_spec
from intellect_node.policy.model import build_tokenizer
fsdp.init(timeout_s=60)
spec = make_spec()
engine = fsdp.sharded_engine(spec, build_tokenizer(spec.model))
print("ENGINE READY", flush=True)
sys.stdin.readline()
os._exit(3)  # dies without stopping the follower
"""


def test_follower_exits_when_rank0_dies() -> None:
    """Without torchrun's agent (which would kill the follower itself) the follower must notice on its own."""
    port = _free_port()
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "TEST_DIR": str(Path(__file__).parent),
    }
    follower_code = "from intellect_node.policy import fsdp\nfsdp.init(timeout_s=60)\nfsdp.follow_rank0()\n"
    procs = []
    try:
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER],
            env={**base, "RANK": "0", "LOCAL_RANK": "0"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(driver)
        follower = subprocess.Popen(
            [sys.executable, "-c", follower_code],
            env={**base, "RANK": "1", "LOCAL_RANK": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(follower)
        assert driver.stdout is not None and driver.stdin is not None
        assert driver.stdout.readline().strip() == "ENGINE READY"  # the follower has built its shard too
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(timeout=30) == 3
        started = time.monotonic()
        out, _ = follower.communicate(timeout=30)
        assert follower.returncode != 0, out[-3000:]
        assert time.monotonic() - started < 20, "the follower waited for the collective timeout"
        assert "RankLost: rank 0 stopped answering" in out, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
