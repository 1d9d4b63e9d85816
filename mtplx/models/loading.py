"""Load a model the way mlx-lm does, but keep the multi-token-prediction weights it throws away.

A model is an mlx-lm directory (config.json + *.safetensors + tokenizer files) or a GGUF file (or
a directory holding one), which is converted once into an mlx-lm directory under the cache.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_config, load_model, load_tokenizer


@dataclass
class ModelBundle:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    path: Path
    mtp_weights: Dict[str, mx.array] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


def cache_dir() -> Path:
    """Where converted models and fetched assets live (MTPLX_CACHE overrides)."""
    root = os.environ.get("MTPLX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mtplx"
    )
    return Path(root)


def is_mtp_key(key: str, config: dict) -> bool:
    """True for weights of multi-token-prediction modules, in either checkpoint layout.

    Qwen3-Next / Qwen3.5 keep them under `mtp.`; DeepSeek-V3 / GLM-4.5 append NextN layers after
    the trunk (`model.layers.{num_hidden_layers + i}.`).
    """
    if key.startswith("mtp.") or key.startswith("model.mtp."):
        return True
    if key.startswith("model.layers."):
        layer = int(key.split(".")[2])
        return layer >= config.get("num_hidden_layers", 1 << 30)
    return False


def _classes_without_mtp(config: dict):
    model_class, args_class = _get_classes(config)

    class TrunkOnly(model_class):
        def sanitize(self, weights):
            weights = {k: v for k, v in weights.items() if not is_mtp_key(k, config)}
            if hasattr(model_class, "sanitize"):
                weights = model_class.sanitize(self, weights)
            return weights

    TrunkOnly.__name__ = model_class.__name__
    TrunkOnly.__module__ = model_class.__module__
    return TrunkOnly, args_class


def resolve_model_path(path: str | os.PathLike) -> Path:
    """An mlx-lm directory for `path`: itself, or the converted copy of a GGUF file."""
    from .assets import resolve_asset  # known names such as smollm2-135m-instruct

    p = Path(resolve_asset(str(path), kind="model"))
    gguf_file = None
    if p.is_file() and p.suffix == ".gguf":
        gguf_file = p
    elif p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        if found:
            gguf_file = found[0]
    if gguf_file is None:
        if not p.exists():
            raise FileNotFoundError(
                f"model path {str(path)!r} does not exist: give an mlx-lm model directory, "
                "a .gguf file, or a known name (see `mtplx-batch fetch --list`)"
            )
        return p
    from .gguf import convert_gguf, default_dequantize, default_dtype

    # MTPLX_GGUF_MODE: auto (fastest here: CPU -> float, GPU -> keep Q4_0/Q4_1/Q8_0 packed),
    # dequantize, or quantized.
    mode = os.environ.get("MTPLX_GGUF_MODE", "auto").strip().lower()
    if mode not in ("auto", "dequantize", "quantized"):
        raise ValueError(f"MTPLX_GGUF_MODE must be auto, dequantize or quantized, not {mode!r}")
    dequantize = default_dequantize() if mode == "auto" else mode == "dequantize"
    dtype = default_dtype()
    st = gguf_file.stat()
    key = f"{gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    flavour = f"{dtype}" if dequantize else f"q-{dtype}"
    out = cache_dir() / "converted" / f"{gguf_file.stem}-{flavour}-{tag}"
    if not (out / "config.json").exists():
        convert_gguf(gguf_file, out, dequantize=dequantize, dtype=dtype)
    return out


def load_mtp_weights(model_path: Path, config: dict) -> Dict[str, mx.array]:
    weights = {}
    for wf in sorted(glob.glob(str(model_path / "*.safetensors"))):
        for k, v in mx.load(wf).items():
            if is_mtp_key(k, config):
                weights[k] = v
    return weights


def load(path: str | os.PathLike, trust_remote_code: bool = False, lazy: bool = False) -> ModelBundle:
    model_path = resolve_model_path(path)
    model, config = load_model(
        model_path,
        lazy=lazy,
        get_model_classes=_classes_without_mtp,
        trust_remote_code=trust_remote_code,
    )
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
    mtp = load_mtp_weights(model_path, config)
    return ModelBundle(model=model, tokenizer=tokenizer, config=config, path=model_path, mtp_weights=mtp)


def load_tokenizer_only(path: str | os.PathLike) -> TokenizerWrapper:
    """The tokenizer without the weights, for `validate` and ordering before the model loads."""
    model_path = resolve_model_path(path)
    config = load_config(model_path)
    return load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))


DEFAULT_CONTEXT = 32768  # when config.json names no context length


def context_length(config: dict) -> int:
    """The model's context length from its config (also under `text_config`)."""
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions", "max_sequence_length"):
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return DEFAULT_CONTEXT


def model_config(path: str | os.PathLike) -> dict:
    return json.loads((resolve_model_path(path) / "config.json").read_text())
