"""The policy model and its tokenizer, built from the run spec.

``tiny-llama``: a Llama built from the spec's config, with a character-level tokenizer whose vocabulary is the
spec's ``vocab`` (specials first: ``<pad>``, ``<bos>``, ``<eos>``). ``hf``: a Hugging Face causal LM by folder,
hub id or ``smollm2`` (node/policy/hf.py), loaded in the spec's compute dtype. Trainer and workers build the same
architecture; the weights they use come from the signed checkpoint.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from intellect_protocol.messages import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward's argument for a key-value cache: transformers 5.2x renamed ``past_key_values`` to ``cache``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out: Any) -> Any:
    """The key-value cache a forward returned (``cache``, or ``past_key_values`` before transformers 5.2x)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def recomputes_activations(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs under gradient (activation) checkpointing, which turns its cache off in training."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the second before transformers 5.2x
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def build_tokenizer(spec: ModelSpec) -> Any:
    if spec.kind == "hf":
        from intellect_node.policy.hf import load_tokenizer

        return load_tokenizer(spec.name)
    vocab = {token: i for i, token in enumerate(spec.vocab)}
    if len(vocab) != len(spec.vocab):
        raise ValueError("the model vocabulary repeats a token")
    for special in ("<pad>", "<bos>", "<eos>"):
        if special not in vocab:
            raise ValueError(f"the model vocabulary lacks {special}")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def resolve_device(name: str = "auto") -> torch.device:
    """``--device``: ``auto`` (the first CUDA device where one is present, else the CPU), ``cpu``, ``cuda[:N]``."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,2})?", name):
        raise ValueError(f"--device {name}: expected auto, cpu, cuda or cuda:N (N counts from 0)")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
            raise ValueError(
                f"--device {name}: no CUDA device ({why}); use --device cpu, or install a CUDA build "
                "of torch and check that `nvidia-smi` lists the GPU"
            )
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
            )
    return torch.device(name)


@functools.cache
def bf16_is_fast(device_type: str) -> bool:
    """Whether this machine multiplies bf16 matrices natively on ``device_type``: a GPU with bf16 (Ampere or
    newer), a CPU with AVX-512 or AMX (oneDNN's bf16 kernels). Elsewhere, a CPU with only AVX2 among them, torch
    falls back to a reference loop: bf16 autocast measured 15x slower than fp32 for a 1024 x 576 x 1536 product
    and its backward (2-core AVX2 machine, torch 2.13)."""
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN
        return False


def build_model(spec: ModelSpec, tokenizer: Any, dtype: torch.dtype | None = None) -> Any:
    """The policy in ``dtype`` (default: the spec's compute dtype). ``tiny-llama`` is freshly initialized
    (seeded by ``spec.init_seed``, so every node builds the same version 0); ``hf`` holds the pretrained weights."""
    dtype = dtype or DTYPES[spec.compute_dtype]
    if spec.kind == "hf":
        from intellect_node.policy.hf import load_causal_lm

        return load_causal_lm(spec.name, dtype=dtype)[0].requires_grad_(True)
    config = LlamaConfig(
        vocab_size=len(spec.vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        model = LlamaForCausalLM(config)
    return torch.nn.Module.to(model, dtype).eval()


def stored_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Keep ``model``'s weights in ``dtype`` (the run's published dtype) and compute in their present one: each
    module's own weights are cast up just before its forward and the copy dropped after it. For weights that come
    in ``dtype`` (every published version) the forward is the same, bit for bit, as the model's in its compute
    dtype, in half the memory (the trainer's judging copy of SmolLM2: 504 MB -> 252 MB), for one cast of each
    weight per forward: cheap for a validator's one forward over whole rollouts, not for token-by-token decoding.
    Not for training (no gradients reach the stored weights); one forward at a time."""
    compute = next(model.parameters()).dtype
    if compute == dtype:
        return model
    for module in model.modules():
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if not own:
            continue
        for name in own:
            param = getattr(module, name)
            param.data = param.data.to(dtype)
        module.register_forward_pre_hook(_cast_up(own, compute))
        module.register_forward_hook(_cast_back(own), always_call=True)  # an error in forward too
    model.requires_grad_(False)
    return model


def _cast_up(names: list[str], compute: torch.dtype) -> Any:
    def hook(module: torch.nn.Module, args: Any) -> None:
        module._stored_weights = [getattr(module, n).data for n in names]  # type: ignore[assignment]
        for name in names:
            param = getattr(module, name)
            param.data = param.data.to(compute)

    return hook


def _cast_back(names: list[str]) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        for name, stored in zip(names, module._stored_weights, strict=True):  # type: ignore[arg-type]
            getattr(module, name).data = stored
        module._stored_weights = []  # type: ignore[assignment]

    return hook


def state_dict_for_export(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors (cast to ``dtype`` if given), tied weights stored once (safetensors refuses shared
    storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen[ptr] = name
        out[name] = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous().clone()
    return out


def load_weights(model: torch.nn.Module, tensors: dict[str, Any]) -> None:
    """Swap in new weights in place; every parameter must be present with its shape."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing={missing[:5]} unexpected={unexpected[:5]}")


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt as every node must produce them: the text as a user turn of the tokenizer's chat
    template, ending with the assistant's turn opened (instruct models); BOS then the text otherwise."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return [int(tokenizer.bos_token_id)] + list(tokenizer.encode(text, add_special_tokens=False))
