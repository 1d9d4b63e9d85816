"""Load a model the way mlx-lm does, but keep the multi-token-prediction weights it throws away.

A model is an mlx-lm directory (config.json + *.safetensors + tokenizer files) or a GGUF file (or
a directory holding one), which is converted once into an mlx-lm directory under the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_config, load_model, load_tokenizer

from .mtp_layouts import is_mtp_key


@dataclass
class ModelBundle:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    path: Path
    mtp_weights: Dict[str, mx.array] = field(default_factory=dict)
    shapes: Dict[str, tuple] = field(default_factory=dict)  # checkpoint tensor shapes, as stored

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


def cache_dir() -> Path:
    """Where converted models and fetched assets live (MTPLX_CACHE overrides)."""
    root = os.environ.get("MTPLX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mtplx"
    )
    return Path(root)


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


def tensor_index(model_path: Path) -> Dict[str, Tuple[str, tuple]]:
    """Every tensor of the checkpoint's *.safetensors files (shards, a head in a file of its own):
    key -> (file name, shape), read from the file headers without loading any weights."""
    index = {}
    for wf in sorted(Path(model_path).glob("*.safetensors")):
        with open(wf, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for k, meta in header.items():
            if k != "__metadata__":
                index[k] = (wf.name, tuple(meta["shape"]))
    return index


def load_mtp_weights(model_path: Path, config: dict, index: Optional[Dict[str, Tuple[str, tuple]]] = None):
    """The checkpoint's raw MTP weights (only the files that hold some are read)."""
    index = tensor_index(model_path) if index is None else index
    files = sorted({f for k, (f, _) in index.items() if is_mtp_key(k, config)})
    weights = {}
    for name in files:
        weights.update({k: v for k, v in mx.load(str(Path(model_path) / name)).items() if is_mtp_key(k, config)})
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
    index = tensor_index(model_path)
    mtp = load_mtp_weights(model_path, config, index)
    return ModelBundle(model=model, tokenizer=tokenizer, config=config, path=model_path, mtp_weights=mtp,
                       shapes={k: shape for k, (_, shape) in index.items()})


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
