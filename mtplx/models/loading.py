"""Load a model as mlx-lm does, keeping the multi-token-prediction weights it throws away.

A model is an mlx-lm directory or a GGUF file (converted once into one under the cache). mlx_lm.utils
imports transformers (seconds), so plain safetensors checkpoints load here with mlx-lm's model classes
alone and the tokenizer with `tokenizers`; anything else goes through mlx-lm's own loaders."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..config import GGUF_MODES
from ..paths import cache_dir  # noqa: F401  (mtplx.models.loading.cache_dir is the public name)
from ..process import prepare_process
from .mtp_layouts import is_mtp_key


@dataclass
class ModelBundle:
    model: nn.Module
    tokenizer: Any  # tokenizer.FastTokenizer, or mlx-lm's TokenizerWrapper
    config: dict
    path: Path
    mtp_weights: Dict[str, mx.array] = field(default_factory=dict)
    shapes: Dict[str, tuple] = field(default_factory=dict)  # checkpoint tensor shapes, as stored
    phases: Dict[str, float] = field(default_factory=dict)  # seconds per startup phase
    gguf_mode: str = "auto"  # how a GGUF source was converted; a draft model loads the same way

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or self.model.model.embed_tokens.weight.shape[0])


def _mlx_lm_tables() -> Dict[str, dict]:
    """mlx-lm's model-type remappings, read from mlx_lm/utils.py without importing it."""
    spec = importlib.util.find_spec("mlx_lm.utils")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    names = ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING")
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id in names}


def _get_classes(config: dict):
    """The mlx-lm Model / ModelArgs classes for a config (mlx_lm.utils._get_classes's rule)."""
    tables = _mlx_lm_tables()
    model_type = config["model_type"]
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    by_arch = tables.get("MODEL_ARCHITECTURE_REMAPPING", {})
    remapped = next((by_arch[(model_type, a)] for a in archs if (model_type, a) in by_arch), None)
    model_type = remapped or tables.get("MODEL_REMAPPING", {}).get(model_type, model_type)
    try:
        arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"Model type {model_type} not supported.") from e
    return arch.Model, arch.ModelArgs


def check_model_type(config: dict) -> None:
    """Refuse, from config.json alone, a model type mlx-lm has no module for."""
    if not isinstance(config.get("model_type"), str):
        raise ValueError("config.json names no model_type")
    _get_classes(config)


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


def _untag_float(obj: dict):
    """transformers writes non-finite floats as {"__float__": "Infinity"}; undo that."""
    tag = obj.get("__float__") if len(obj) == 1 else None
    return float(tag.lower().replace("infinity", "inf")) if tag in ("Infinity", "-Infinity", "NaN") else obj


def load_config(model_path: Path) -> dict:
    """config.json, with generation_config.json's eos_token_id (mlx-lm's rule)."""
    config = json.loads((model_path / "config.json").read_text(encoding="utf-8"), object_hook=_untag_float)
    with contextlib.suppress(FileNotFoundError, ValueError):  # none, or not JSON: config.json's stands
        eos = json.loads((model_path / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
        if eos:
            config["eos_token_id"] = eos
    return config


def _plain_checkpoint(model_path: Path, config: dict) -> bool:
    """Whether `_load_weights` loads this checkpoint exactly as mlx-lm's load_model would."""
    quant = config.get("quantization")
    hf_quant = "quantization_config" in config or "quantization_config" in (config.get("text_config") or {})
    return (config.get("model_file") is None and not config.get("quantize_activations")
            and (quant is not None or not hf_quant) and not (model_path / "hf_quant_config.json").exists()
            and (quant is None or quant.get("mode", "affine") == "affine"))


class _NotPlain(Exception):
    """A checkpoint `_load_weights` leaves to mlx-lm's loader."""


def _load_weights(model_path: Path, config: dict, lazy: bool) -> nn.Module:
    """mlx-lm's model class, its sanitize, affine quantization as config.json or the scales say, the weights."""
    model_class, args_class = _classes_without_mtp(config)
    weights = {k: v for wf in sorted(model_path.glob("model*.safetensors")) for k, v in mx.load(str(wf)).items()}
    if not weights:
        raise FileNotFoundError(f"No safetensors found in {model_path}")
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quant = config.get("quantization")
    if quant is not None:

        def packing(path, module):
            if path in quant:
                return quant[path]
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                return False
            if weights[f"{path}.scales"].dtype == mx.uint8:
                raise _NotPlain(path)  # an mxfp / nvfp packing: mlx-lm infers its mode
            in_dims = module.weight.shape[-1]
            bits = weights[f"{path}.weight"].shape[-1] * 32 // in_dims
            return {"group_size": in_dims // weights[f"{path}.scales"].shape[-1], "bits": bits, "mode": "affine"}

        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], mode="affine",
                    class_predicate=packing)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    return model


_TOKENIZERS: Dict[tuple, Any] = {}  # a run reads the tokenizer before the weights: load it once


def _load_tokenizer(model_path: Path, config: dict):
    from .tokenizer import load_fast_tokenizer
    files = sorted(model_path.glob("tokenizer*")) + sorted(model_path.glob("chat_template*"))
    key = (str(model_path.resolve()), str(config.get("eos_token_id")),
           tuple((f.name, f.stat().st_mtime_ns) for f in files))
    if key not in _TOKENIZERS:
        tok = load_fast_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
        if tok is None:
            from mlx_lm.utils import load_tokenizer
            tok = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


def resolve_model_path(path: str | os.PathLike, gguf_mode: str = "auto") -> Path:
    """An mlx-lm directory for `path`: itself, or the converted copy (one per `gguf_mode`) of a GGUF."""
    if gguf_mode not in GGUF_MODES:
        raise ValueError(f"model.gguf_mode must be one of {', '.join(GGUF_MODES)}, not {gguf_mode!r}")
    from .assets import resolve_asset  # known names such as smollm2-135m-instruct
    p = Path(resolve_asset(str(path), kind="model"))
    if p.is_file() and p.suffix == ".gguf":
        gguf_file = p
    else:  # a directory holding a .gguf and no config.json
        found = sorted(p.glob("*.gguf")) if p.is_dir() and not (p / "config.json").exists() else []
        gguf_file = found[0] if found else None
    if gguf_file is None:
        if not p.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist: give an mlx-lm model directory, "
                                    "a .gguf file, or a known name (see `mtplx-batch fetch --list`)")
        return p
    from .gguf import convert_gguf, default_dequantize, default_dtype, is_current
    dequantize = default_dequantize() if gguf_mode == "auto" else gguf_mode == "dequantize"
    dtype = default_dtype()
    st = gguf_file.stat()
    tag = hashlib.sha256(f"{gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{gguf_file.stem}-{'' if dequantize else 'q-'}{dtype}-{tag}"
    if not (out / "config.json").exists() or not is_current(out):
        convert_gguf(gguf_file, out, dequantize=dequantize, dtype=dtype)
    return out


def tensor_index(model_path: Path) -> Dict[str, Tuple[str, tuple]]:
    """key -> (file, shape) of every tensor in the checkpoint's *.safetensors, from their headers."""
    index = {}
    for wf in sorted(Path(model_path).glob("*.safetensors")):
        with open(wf, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for k, meta in header.items():
            if k != "__metadata__":
                index[k] = (wf.name, tuple(meta["shape"]))
    return index


def load(path: str | os.PathLike, trust_remote_code: bool = False, lazy: bool = False,
         gguf_mode: str = "auto", tokenizer=None) -> ModelBundle:
    """`tokenizer`: one already loaded from this model (`load_tokenizer_only`)."""
    prepare_process()
    t0 = time.perf_counter()
    model_path = resolve_model_path(path, gguf_mode)
    config = load_config(model_path)
    t1 = time.perf_counter()
    tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model_path, config)
    t2 = time.perf_counter()
    model = None
    if _plain_checkpoint(model_path, config):
        with contextlib.suppress(_NotPlain):
            model = _load_weights(model_path, config, lazy)
    if model is None:
        from mlx_lm.utils import load_model
        model, config = load_model(model_path, lazy=lazy, get_model_classes=_classes_without_mtp,
                                   trust_remote_code=trust_remote_code)
    index = tensor_index(model_path)
    files = sorted({f for k, (f, _) in index.items() if is_mtp_key(k, config)})
    mtp = {k: v for name in files for k, v in mx.load(str(model_path / name)).items() if is_mtp_key(k, config)}
    phases = {"config": t1 - t0, "tokenizer": t2 - t1, "weights": time.perf_counter() - t2}
    return ModelBundle(model=model, tokenizer=tokenizer, config=config, path=model_path, mtp_weights=mtp,
                       shapes={k: shape for k, (_, shape) in index.items()}, phases=phases, gguf_mode=gguf_mode)


def load_tokenizer_only(path: str | os.PathLike, gguf_mode: str = "auto"):
    model_path = resolve_model_path(path, gguf_mode)
    return _load_tokenizer(model_path, load_config(model_path))


DEFAULT_CONTEXT = 32768  # when config.json names no context length


def context_length(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions", "max_sequence_length"):
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return DEFAULT_CONTEXT


def model_config(path: str | os.PathLike, gguf_mode: str = "auto") -> dict:
    return json.loads((resolve_model_path(path, gguf_mode) / "config.json").read_text())
