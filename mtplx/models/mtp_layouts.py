"""Where each family's checkpoint keeps its MTP head, read into modules (one per draft depth):
Qwen3-Next / Qwen3.5 `mtp.*` (shared norms and fc, layer i drafts depth i); DeepSeek-V3 / GLM-4.5
NextN `model.layers.{N + i}` after the N trunk layers (and sidecars from train-head: block i at N + i);
MiMo `model.mtp_layers.{i}` (fc over [hidden, embedding]). NextN and MiMo zero position 0's embedding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import mlx.core as mx

QWEN_HEAD = {"pre_fc_norm_embedding": "norm_embedding", "pre_fc_norm_hidden": "norm_hidden", "fc": "fc", "norm": "norm"}
NEXTN_HEAD = {"enorm": "norm_embedding", "hnorm": "norm_hidden", "eh_proj": "fc", "shared_head.norm": "norm",
              "shared_head.head": "head"}
MIMO_HEAD = {"token_layernorm": "norm_embedding", "hidden_layernorm": "norm_hidden", "input_proj": "fc",
             "final_layernorm": "norm"}
MIMO_PREFIX = "model.mtp_layers."


@dataclass
class ModuleWeights:
    """One MTP module: head weights by our names, block-relative weights per block."""

    head: Dict[str, mx.array] = field(default_factory=dict)
    blocks: Dict[int, Dict[str, mx.array]] = field(default_factory=dict)
    hidden_first: bool = False  # fc reads [hidden, embedding] (MiMo)
    zero_first: bool = False  # the embedding at position 0 is zeroed (NextN and MiMo training)


def text_config(config: dict) -> dict:
    """The text model's config (Qwen3.5 nests it under `text_config`)."""
    return config.get("text_config") or config


def is_mtp_key(key: str, config: dict) -> bool:
    trunk_layers = text_config(config).get("num_hidden_layers", 1 << 30)
    return key.startswith(("mtp.", "model.mtp.", MIMO_PREFIX)) or (
        key.startswith("model.layers.") and int(key.split(".")[2]) >= trunk_layers)


def _qwen(weights) -> List[ModuleWeights]:
    shared, blocks = {}, {}
    for k, v in weights.items():
        rest = k[len("model.mtp."):] if k.startswith("model.mtp.") else k[len("mtp."):]
        if rest.startswith("layers."):
            _, i, sub = rest.split(".", 2)
            blocks.setdefault(int(i), {})[sub] = v
            continue
        mod, param = rest.split(".", 1)
        if mod not in QWEN_HEAD:
            raise ValueError(f"unknown MTP weight {k!r}")
        shared[f"{QWEN_HEAD[mod]}.{param}"] = v
    return [ModuleWeights(head=dict(shared), blocks={0: blocks[i]}) for i in sorted(blocks)]


def _per_layer(weights, prefix: str, first: int, names, hidden_first: bool, serial_blocks: int = 0):
    modules: Dict[int, ModuleWeights] = {}
    for k, v in weights.items():
        if not k.startswith(prefix):
            continue
        i, rest = k[len(prefix):].split(".", 1)
        depth = int(i) - first
        if serial_blocks > 1 and 0 < depth < serial_blocks:  # a sidecar's blocks 1..
            modules.setdefault(0, ModuleWeights(zero_first=False)).blocks.setdefault(depth, {})[rest] = v
            continue
        module = modules.setdefault(depth, ModuleWeights(hidden_first=hidden_first, zero_first=not serial_blocks))
        src = next((s for s in names if rest.startswith(s + ".")), None)
        if src is not None:
            module.head[f"{names[src]}.{rest[len(src) + 1:]}"] = v
        elif not rest.startswith("embed_tokens."):  # (a copy of the trunk's)
            module.blocks.setdefault(0, {})[rest] = v
    return [modules[d] for d in sorted(modules)]


def split_modules(weights: Dict[str, mx.array], config: dict) -> List[ModuleWeights]:
    if any(k.startswith(("mtp.", "model.mtp.")) for k in weights):
        return _qwen(weights)
    if any(k.startswith(MIMO_PREFIX) for k in weights):
        return _per_layer(weights, MIMO_PREFIX, 0, MIMO_HEAD, hidden_first=True)
    serial = int(config.get("mtp_sidecar_blocks", 0))
    n = config.get("num_hidden_layers") or text_config(config)["num_hidden_layers"]  # a sidecar's is on top
    modules = _per_layer(weights, "model.layers.", int(n), NEXTN_HEAD, hidden_first=False, serial_blocks=serial)
    return modules[:1] if serial else modules


# Qwen3-Next / Qwen3.5 store RMSNorm weights as offsets from 1, which mlx-lm adds back to the trunk's
ZERO_CENTRED_BLOCK_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                            ".k_norm.weight")
ZERO_CENTRED_HEAD_NORMS = ("norm_embedding.weight", "norm_hidden.weight", "norm.weight")
