"""An MLX copy of a safetensors checkpoint that keeps its MTP head (mlx-lm's convert drops it).

The trunk is written as mlx-lm writes it, so `mlx_lm.load` reads it and never sees the head. The head
is written built beside it (`mtplx_head.safetensors`, `mtplx_head.json`: its modules and quantization,
the trunk's rules or bfloat16) for `mtp.load_head`; config.json records the source (`mtplx_convert`)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from .loading import load, tensor_index
from .mtp import HEAD_META, HEAD_WEIGHTS, build_head
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.jinja",
                   "chat_template.json", "generation_config.json", "added_tokens.json")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _quant_rules(model, group_size: int):
    """(class_predicate, per-path overrides it chose): the trunk's rules, its own quant_predicate too."""
    rule = getattr(model, "quant_predicate", None)
    overrides = {}

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        choice = rule(path, module) if rule is not None else True
        if isinstance(choice, dict):
            overrides[path] = choice
        return choice

    return predicate, overrides


def save_head(head, out_dir: Path, trunk_model, quantize: Optional[int], group_size: int, keep_bf16: bool) -> dict:
    quant = None
    if keep_bf16:
        head.set_dtype(mx.bfloat16)
    elif quantize:
        predicate, overrides = _quant_rules(trunk_model, group_size)
        nn.quantize(head, group_size, quantize, class_predicate=predicate)
        quant = {"group_size": group_size, "bits": quantize, "overrides": overrides}
    modules = [{"layers": len(m.layers), "own_head": "head" in m, "hidden_first": bool(m.hidden_first),
                "zero_first": bool(m.zero_first)} for m in getattr(head, "depths", [head])]
    meta = {"format": 1, "modules": modules, "stack": hasattr(head, "depths"), "quantization": quant,
            "dtype": "bfloat16" if keep_bf16 else None}
    mx.save_safetensors(str(out_dir / HEAD_WEIGHTS), dict(tree_flatten(head.parameters())))
    (out_dir / HEAD_META).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return meta


def convert_hf(src, out_dir, quantize: Optional[int] = None, group_size: int = 64, keep_head_bf16: bool = False,
               dtype: Optional[str] = None) -> Path:
    from mlx_lm.utils import quantize_model, save_config, save_model
    src, out = Path(src), Path(out_dir)
    if quantize not in (None, 4, 8):
        raise ValueError(f"--quantize takes 4 or 8 (bits), not {quantize!r}")
    if not (src / "config.json").exists() or not any(src.glob("*.safetensors")):
        raise ValueError(f"{src} is not a safetensors checkpoint (config.json and *.safetensors)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} is not empty; give a new one")
    bundle = load(src)
    model, config = bundle.model, dict(bundle.config)
    head = build_head(bundle, bundle.mtp_weights) if bundle.mtp_weights else None
    if dtype is not None:
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(DTYPES[dtype]) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
        if head is not None and not keep_head_bf16:
            head.set_dtype(DTYPES[dtype])
    if quantize:
        model, config = quantize_model(model, config, group_size, quantize)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    files = sorted({f for f, _ in tensor_index(src).values()})
    record = {"source": str(src.resolve()),
              "source_config_sha256": hashlib.sha256((src / "config.json").read_bytes()).hexdigest(),
              "source_files": {f: (src / f).stat().st_size for f in files}, "model_type": bundle.model_type,
              "quantize": quantize, "group_size": group_size if quantize else None, "dtype": dtype, "head": None}
    if head is not None:
        meta = save_head(head, out, model, quantize, group_size, keep_head_bf16)
        record["head"] = "bfloat16" if keep_head_bf16 else (f"{quantize}-bit" if quantize else "float")
        record["head_modules"] = len(meta["modules"])
    config["mtplx_convert"] = record
    save_config(config, out / "config.json", keep_vision_config=False)
    for f in sorted(src.iterdir()):
        if f.is_file() and any(f.match(g) for g in TOKENIZER_FILES):
            shutil.copy(f, out / f.name)
    return out
