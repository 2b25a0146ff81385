"""The policy sharded over several processes with FSDP2 (``torch.distributed.fsdp.fully_shard``), driven by rank 0.

Run: ``torchrun --nproc-per-node N -m intellect_node.cli bootstrap ...`` (node/cli.py). Rank 0 runs the whole
trainer (network, DHT, validation, publishing) with ``sharded_engine`` as its engine factory; every other rank
runs ``follow_rank0``: it receives the run spec, builds the same sharded engine and executes what rank 0 says.
Backend: NCCL with one GPU per ``LOCAL_RANK`` when CUDA is available, gloo on CPU otherwise.

Invariants:
- Collectives run in the same order on every rank: each public call on rank 0 first broadcasts a command (a
  JSON header, then plain tensors; never pickle) and the followers run the same method. Calls on rank 0 hold
  one lock, so the trainer's worker thread and the heartbeat thread never interleave commands.
- A step equals ``PolicyEngine``'s single-process step up to float rounding (tests/policy/test_fsdp.py checks it):
  every rank gets the whole batch, takes a contiguous slice of each minibatch's rows and scales its
  token-averaged loss by ``world * its tokens / the minibatch's tokens``; FSDP averages gradients over the
  ranks, so the result is the token average over the whole minibatch. The gradient norm is clipped over all
  shards, so every rank takes (or skips) the same optimizer step.
- ``export_state`` and ``state`` gather full tensors to rank 0's CPU (other ranks return ``{}``);
  ``load_state`` takes the state on rank 0 and broadcasts it. Tied weights are published once, as in
  ``PolicyEngine``.
- A follower never waits forever: rank 0 pings every ``HEARTBEAT_S`` while idle, and every collective times
  out after ``COLLECTIVE_TIMEOUT_S``; a rank 0 that exits closes its connections and the followers stop at once.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import threading
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from intellect_node.policy.engine import Packed, PolicyEngine
from intellect_node.policy.model import DTYPES, build_model, build_tokenizer
from intellect_protocol.messages import RunSpec

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 600.0
"""A rank waiting longer than this in one collective gives up (a peer died without closing its connection)."""
HEARTBEAT_S = 30.0
"""Rank 0 pings the followers this often while the trainer waits for rollouts, well inside the timeout."""
PACKED_FIELDS = ("ids", "attention", "mask", "logp_old", "advantages")
STAT_KEYS = ("loss", "entropy", "kl", "clipped_fraction")
"""Token-averaged statistics: combined over ranks weighted by each rank's tokens."""


class RankLost(RuntimeError):
    """Rank 0 went away between commands without stopping this rank."""


class Placement(NamedTuple):
    rank: int
    world_size: int
    local_rank: int


def distributed_env() -> Placement | None:
    """This process's place in a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK); None outside one or with one process."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return Placement(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))


def device() -> torch.device:
    """This rank's device: the GPU numbered LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init(timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Placement:
    """Join torchrun's process group: NCCL on GPUs, gloo on CPUs."""
    placement = distributed_env()
    if placement is None:
        raise RuntimeError(
            "not started by torchrun with several processes: run `torchrun --nproc-per-node N -m "
            "intellect_node.cli bootstrap ...` (N >= 2), or drop torchrun for one process"
        )
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    logger.info(
        "joined the process group rank=%d world=%d backend=%s device=%s",
        placement.rank,
        placement.world_size,
        backend,
        dev,
    )
    return placement


def shutdown() -> None:
    """Leave the process group once every rank is done with it (a dead peer is skipped)."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except RuntimeError as e:
        logger.info("a rank left before the final barrier: %s", e)
    gc.collect()  # sharded modules hold the group through their device mesh: free them first
    dist.destroy_process_group()


def _shard(model: torch.nn.Module) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, head: tied weights stay one
    parameter in the root's group)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers` list to shard; only decoder-only causal "
            "LMs laid out like Llama are supported"
        )
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def _aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names that share storage with an earlier name (tied weights), skipped on export exactly as
    ``state_dict_for_export`` skips them."""
    seen: set[int] = set()
    out = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            out.add(name)
        seen.add(tensor.data_ptr())
    return out


class ShardedEngine(PolicyEngine):
    """``PolicyEngine`` over FSDP2 shards. On rank 0 the trainer calls it like the local engine; other ranks
    call ``serve_forever`` and mirror each call."""

    share_prompts = False  # a rank whose rows share no prompt would run one forward where another runs two

    def __init__(self, spec: RunSpec, model: torch.nn.Module, reference: torch.nn.Module | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("call intellect_node.policy.fsdp.init() before building a ShardedEngine")
        if spec.train.lora_rank:
            raise ValueError(
                "train.lora_rank is for a trainer in one process; a sharded one (torchrun) trains every "
                "weight: set train.lora_rank = 0"
            )
        if spec.train.optimizer_state_dtype != "float32":
            raise ValueError(
                'train.optimizer_state_dtype = "bfloat16" is for a trainer in one process; a sharded one '
                '(torchrun) keeps AdamW\'s moments in fp32: set it to "float32"'
            )
        self.device = device()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model = model.float().to(self.device)
        self._tied = _aliases(model)
        _shard(model)
        if reference is not None:
            reference = reference.float().to(self.device)
            _shard(reference)
        super().__init__(spec, model, reference)  # AdamW over the sharded (DTensor) parameters
        self._lock = threading.Lock()
        self._stopped = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if self.rank == 0:
            self._heartbeat = threading.Thread(target=self._ping_forever, name="fsdp-heartbeat", daemon=True)
            self._heartbeat.start()

    # ---- commands: rank 0 sends, followers receive ---------------------------------------------------

    def _header(self, header: dict[str, Any] | None = None) -> dict[str, Any]:
        """Rank 0 broadcasts ``header``; every rank returns it."""
        if self.rank == 0:
            data = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8, device=self.device)
            size = torch.tensor([data.numel()], dtype=torch.long, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.long, device=self.device)
        dist.broadcast(size, src=0)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=0)
        return dict(json.loads(bytes(data.cpu().tolist())))

    def _batch(self, header: dict[str, Any], batch: Packed | None = None) -> Packed:
        tensors = []
        for name, (shape, dtype) in zip(PACKED_FIELDS, header["tensors"], strict=True):
            if batch is not None:
                t = getattr(batch, name).to(self.device, getattr(torch, dtype)).contiguous()
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            dist.broadcast(t, src=0)
            tensors.append(t)
        return Packed(*tensors)

    def _ping_forever(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                if self._stopped:
                    return
                try:
                    self._header({"op": "ping"})
                except RuntimeError as e:  # a follower died; the trainer's next call fails with the cause
                    logger.error("a follower rank stopped answering: %s", e)
                    return

    def serve_forever(self) -> None:
        """Followers: mirror rank 0's calls until it says stop. Raises if rank 0 vanishes or times out."""
        while True:
            try:
                header = self._header()
            except RuntimeError as e:
                raise RankLost(
                    f"rank 0 stopped answering (it exited or crashed: see its log); this rank exits. Cause: {e}"
                ) from e
            op = header["op"]
            if op == "step":
                PolicyEngine.step(self, self._batch(header), float(header["lr"]))
            elif op == "export":
                self._export()
            elif op == "state":
                self._state()
            elif op == "load":
                self._load({}, int(header["skipped"]))
            elif op == "stop":
                return
            elif op != "ping":
                raise RuntimeError(f"unknown command {op!r} from rank 0: ranks run different intellect-node versions")

    # ---- the engine interface (rank 0) ---------------------------------------------------------------

    def step(self, batch: Packed, lr: float) -> dict[str, float]:
        shapes = [
            [list(getattr(batch, n).shape), str(getattr(batch, n).dtype).removeprefix("torch.")] for n in PACKED_FIELDS
        ]
        with self._lock:
            header = self._header({"op": "step", "lr": lr, "tensors": shapes})
            return PolicyEngine.step(self, self._batch(header, batch), lr)

    def export_state(self) -> dict[str, torch.Tensor]:
        with self._lock:
            self._header({"op": "export"})
            return self._export()

    def state(self) -> dict[str, Any]:
        with self._lock:
            self._header({"op": "state"})
            return self._state()

    def load_state(self, state: dict[str, Any]) -> None:
        skipped = int(state.get("skipped", 0))
        with self._lock:
            self._header({"op": "load", "skipped": skipped})
            self._load(state, skipped)

    def close(self) -> None:
        """Rank 0: tell the followers to return from ``serve_forever``. A follower already gone is logged."""
        self._stop.set()
        with self._lock:
            if self.rank != 0 or self._stopped:
                return
            self._stopped = True
            try:
                self._header({"op": "stop"})
            except RuntimeError as e:
                logger.warning("could not stop the follower ranks (already gone?): %s", e)

    # ---- what every rank runs ------------------------------------------------------------------------

    def _minibatch(self, b: Packed, own_old: bool = False) -> dict[str, float]:
        t = self.spec.train
        rows = b.ids.shape[0]
        lo, hi = rows * self.rank // self.world, rows * (self.rank + 1) // self.world
        if hi > lo:
            mine = b.rows(slice(lo, hi))
        else:  # fewer rows than ranks: a masked-out row keeps this rank in FSDP's collectives, adding nothing
            one = b.rows(slice(0, 1))
            mine = Packed(one.ids, one.attention, torch.zeros_like(one.mask), one.logp_old, one.advantages)
        local_tokens = float(mine.mask.sum())
        total_tokens = float(b.mask.sum())  # every rank holds the whole minibatch: no collective needed
        loss, stats, gap = self._loss(mine, own_old)
        weight = local_tokens / max(total_tokens, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        (loss * (weight * self.world)).backward()  # FSDP divides the summed gradients by the world size
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
        full_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(full_norm):
            self.optimizer.step()
        else:
            self.skipped += 1
            logger.error("skipped an optimizer step: gradient norm is %s", float(full_norm))
        parts = torch.tensor(
            [getattr(stats, k) * weight for k in STAT_KEYS] + [gap], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(parts)  # the gap is a sum over each rank's own rows
        return {
            **{k: float(v) for k, v in zip((*STAT_KEYS, "logp_old_gap_sum"), parts.tolist(), strict=True)},
            "grad_norm": float(full_norm),
            "tokens": total_tokens,
        }

    def _export(self) -> dict[str, torch.Tensor]:
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        dtype = DTYPES[self.spec.model.dtype]
        out = {}
        for name, value in full.items():
            if name not in self._tied:
                assert isinstance(value, torch.Tensor), f"{name} gathered as {type(value).__name__}"
                out[name] = value.to(dtype).contiguous()
        return out

    def _state(self) -> dict[str, Any]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        if self.rank != 0:
            return {}
        return {"model": model, "optimizer": optimizer, "skipped": self.skipped}

    def _load(self, state: dict[str, Any], skipped: int) -> None:
        # Model and optimizer separately: set_state_dict treats a follower's empty model dict as "optimizer
        # only" and skips the model's broadcast, which leaves rank 0 waiting for the followers.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, state.get("model", {}), options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state.get("optimizer", {}), options=options)
        self.skipped = skipped


def _build(spec: RunSpec, tokenizer: Any) -> ShardedEngine:
    reference = build_model(spec.model, tokenizer, torch.float32) if spec.train.kl_coef > 0 else None
    return ShardedEngine(spec, build_model(spec.model, tokenizer, torch.float32), reference)


def sharded_engine(spec: RunSpec, tokenizer: Any) -> ShardedEngine:
    """Rank 0's engine factory for the Trainer: sends the run spec to the followers, then builds its shard."""
    if dist.get_rank() != 0:
        raise RuntimeError("sharded_engine runs on rank 0; other ranks call follow_rank0()")
    payload = torch.tensor(list(spec.model_dump_json().encode()), dtype=torch.uint8, device=device())
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.long, device=device()), src=0)
    dist.broadcast(payload, src=0)
    return _build(spec, tokenizer)


def follow_rank0() -> None:
    """Ranks > 0: receive the run spec from rank 0, build this rank's shard, mirror rank 0 until it stops.

    Ctrl-C is left to rank 0, which stops the followers in order; a rank 0 that dies ends this with an error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    size = torch.zeros(1, dtype=torch.long, device=device())
    try:
        dist.broadcast(size, src=0)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device())
        dist.broadcast(payload, src=0)
    except RuntimeError as e:
        raise RankLost(f"rank 0 stopped before sending the run spec (see its log); this rank exits. Cause: {e}") from e
    spec = RunSpec.model_validate_json(bytes(payload.cpu().tolist()))
    engine = _build(spec, build_tokenizer(spec.model))
    logger.info("following rank 0 run_id=%s rank=%d", spec.run_id, engine.rank)
    engine.serve_forever()
    logger.info("rank 0 stopped the run; this rank exits")
