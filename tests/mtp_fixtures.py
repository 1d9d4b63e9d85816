"""Tiny random checkpoints of the families that ship native MTP heads, in their real HF layouts.

Plain module (no pytest import), like `tiny_models`::

    from mtp_fixtures import make_mtp_model
    path = make_mtp_model(tmp / "q35", "qwen3_5")      # loads with mlx_lm.load and mtplx.loading.load

Families and the layout each is written in (the key names the public transformers / vLLM /
SGLang loaders read):

* ``qwen3_5``      - `Qwen3_5ForConditionalGeneration`: config with a `text_config`, weights under
                     `model.language_model.*`, `lm_head.weight` at the top, a (dropped) vision
                     tower `model.visual.*`, hybrid Gated DeltaNet layers with one projection per
                     part (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), conv1d as
                     [C, 1, K], zero-centred RMSNorm weights (stored as offsets from 1), and the
                     head at `mtp.*` (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`,
                     `layers.{i}` full-attention layers, `norm`: zero-centred too).
* ``qwen3_5_moe``  - the same with MoE layers, experts fused (`experts.gate_up_proj` [E, 2I, D],
                     `experts.down_proj` [E, D, I]) in the trunk and in the head's layers.
* ``mimo``         - `MiMoForCausalLM`: a Qwen2-like trunk (q/k/v biases) and the head at
                     `model.mtp_layers.{i}` (`token_layernorm`, `hidden_layernorm`, `input_proj`
                     over [hidden, embedding], the block's own keys, `final_layernorm`).
* ``glm4_moe``     - GLM-4.5: NextN layer at `model.layers.{N + i}` (`enorm`, `hnorm`, `eh_proj`,
                     a MoE block, `shared_head.norm`, `shared_head.head`, `embed_tokens`).
* ``deepseek_v32`` - DeepSeek-V3.2: the DeepSeek-V3 layout plus the sparse-attention indexer
                     (`self_attn.indexer.*`), NextN layer at `model.layers.{N + i}`.

Options: ``mtp_layers`` (how many MTP layers: `mtp_num_hidden_layers` / `num_nextn_predict_layers`),
``tie`` (tied embeddings), ``shards`` (split into `model-0000i-of-0000n.safetensors` with a
`model.safetensors.index.json`), ``head_file`` (write the MTP weights to a file of their own,
listed in the index), ``with_mtp=False`` (the trunk alone), ``mtp_experts_one_by_one`` (qwen3_5_moe:
the head's experts stored per expert, `experts.{e}.gate_proj`, instead of fused).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from tiny_models import (
    SPECIAL_TOKENS,
    _build_small_vocab_tokenizer,
    _deepseek_block,
    _deepseek_is_moe,
    _Init,
    _qwen3_next_full_attn,
    _swiglu_mlp,
    build_tokenizer,
)

_QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attn_output_gate": True,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "hidden_act": "silu",
    "eos_token_id": 0,
}
_QWEN3_5_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1}

CONFIGS: Dict[str, dict] = {
    "qwen3_5": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                "text_config": _QWEN3_5_TEXT, "vision_config": {"hidden_size": 8, "depth": 1}},
    "qwen3_5_moe": {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                    "text_config": {**_QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text", **_QWEN3_5_MOE},
                    "vision_config": {"hidden_size": 8, "depth": 1}},
    "mimo": {
        "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 640000.0, "max_position_embeddings": 4096, "hidden_act": "silu",
    },
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
        "num_hidden_layers": 2, "first_k_dense_replace": 1, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "rope_scaling": None, "max_position_embeddings": 4096, "hidden_act": "silu",
    },
    "deepseek_v32": {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 64,
        "num_hidden_layers": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 2048,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "hidden_act": "silu",
    },
}
FAMILIES = tuple(CONFIGS)


def text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


# ---- embeddings and head (as tiny_models: varied greedy text, special tokens rarely emitted) ----


def _embed_and_head(init: _Init, D: int, V: int, tie: bool, prefix: str, head_key: str, offset: bool, w):
    if tie:
        e = init.normal((V, D), 1.0)
        e *= 0.2 / np.linalg.norm(e, axis=1, keepdims=True)
        w[f"{prefix}embed_tokens.weight"] = e.astype(np.float32)
        gain = 12.5 * init.norm(D)
        w[f"{prefix}norm.weight"] = (gain - 1.0 if offset else gain).astype(np.float32)
        w[f"{prefix}embed_tokens.weight"][: len(SPECIAL_TOKENS)] *= 0.1
    else:
        w[f"{prefix}embed_tokens.weight"] = init.normal((V, D), 1.0)
        w[head_key] = init.normal((V, D), 2.5 / np.sqrt(D))
        w[f"{prefix}norm.weight"] = init.norm(D, offset=offset)
        w[head_key][: len(SPECIAL_TOKENS)] *= 0.1


# ---- Qwen3.5 ----


def _qwen3_5_linear_attn(init: _Init, p: str, c: dict, w):
    D, nk, nv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    key_dim, value_dim = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    conv_dim, K = 2 * key_dim + value_dim, c["linear_conv_kernel_dim"]
    w[f"{p}.in_proj_qkv.weight"] = init.linear(conv_dim, D)
    w[f"{p}.in_proj_z.weight"] = init.linear(value_dim, D)
    w[f"{p}.in_proj_b.weight"] = init.linear(nv, D)
    w[f"{p}.in_proj_a.weight"] = init.linear(nv, D)
    w[f"{p}.conv1d.weight"] = init.normal((conv_dim, 1, K), 1.0 / np.sqrt(K))  # HF: [C, 1, K]
    w[f"{p}.A_log"] = np.log(init.rng.uniform(0.05, 0.6, size=(nv,))).astype(np.float32)
    w[f"{p}.dt_bias"] = init.normal((nv,), 0.5)
    w[f"{p}.norm.weight"] = init.norm(c["linear_value_head_dim"])  # gated norm: a plain weight
    w[f"{p}.out_proj.weight"] = init.linear(D, value_dim, gain=2.0)


def _qwen3_5_mlp(init: _Init, p: str, c: dict, w, fused: bool = True):
    D = c["hidden_size"]
    if not c.get("num_experts"):
        _swiglu_mlp(init, p, D, c["intermediate_size"], w)
        return
    E, inter = c["num_experts"], c["moe_intermediate_size"]
    w[f"{p}.gate.weight"] = init.linear(E, D)
    experts = [{} for _ in range(E)]
    for e in range(E):
        _swiglu_mlp(init, "x", D, inter, experts[e])
    if fused:
        w[f"{p}.experts.gate_up_proj"] = np.stack(
            [np.concatenate([x["x.gate_proj.weight"], x["x.up_proj.weight"]]) for x in experts])  # [E, 2I, D]
        w[f"{p}.experts.down_proj"] = np.stack([x["x.down_proj.weight"] for x in experts])  # [E, D, I]
    else:
        for e, x in enumerate(experts):
            for n in ("gate_proj", "up_proj", "down_proj"):
                w[f"{p}.experts.{e}.{n}.weight"] = x[f"x.{n}.weight"]
    _swiglu_mlp(init, f"{p}.shared_expert", D, c["shared_expert_intermediate_size"], w)
    w[f"{p}.shared_expert_gate.weight"] = init.linear(1, D)


def _qwen3_5_layer(init: _Init, p: str, c: dict, linear: bool, w, fused: bool = True):
    if linear:
        _qwen3_5_linear_attn(init, f"{p}.linear_attn", c, w)
    else:
        _qwen3_next_full_attn(init, f"{p}.self_attn", c, w)  # gated q_proj, zero-centred q/k norms
    _qwen3_5_mlp(init, f"{p}.mlp", c, w, fused)
    w[f"{p}.input_layernorm.weight"] = init.norm(c["hidden_size"], offset=True)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(c["hidden_size"], offset=True)


def _qwen3_5_weights(cfg: dict, init: _Init, with_mtp: bool):
    c, w = text_config(cfg), {}
    D = c["hidden_size"]
    _embed_and_head(init, D, c["vocab_size"], c["tie_word_embeddings"], "model.language_model.", "lm_head.weight", True, w)
    for i in range(c["num_hidden_layers"]):
        _qwen3_5_layer(init, f"model.language_model.layers.{i}", c, (i + 1) % c["full_attention_interval"] != 0, w)
    w["model.visual.patch_embed.proj.weight"] = init.normal((8, 3), 0.1)  # mlx-lm drops the vision tower
    if with_mtp:
        w["mtp.pre_fc_norm_embedding.weight"] = init.norm(D, offset=True)
        w["mtp.pre_fc_norm_hidden.weight"] = init.norm(D, offset=True)
        w["mtp.fc.weight"] = init.linear(D, 2 * D)
        for j in range(c["mtp_num_hidden_layers"]):
            _qwen3_5_layer(init, f"mtp.layers.{j}", c, False, w, fused=not cfg.get("_mtp_experts_one_by_one"))
        w["mtp.norm.weight"] = init.norm(D, offset=True)
    return w


# ---- MiMo ----


def _mimo_block(init: _Init, p: str, c: dict, w):
    D, H, KV = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = D // H
    for name, rows in (("q_proj", H * hd), ("k_proj", KV * hd), ("v_proj", KV * hd)):
        w[f"{p}.self_attn.{name}.weight"] = init.linear(rows, D)
        w[f"{p}.self_attn.{name}.bias"] = init.normal((rows,), 0.1)
    w[f"{p}.self_attn.o_proj.weight"] = init.linear(D, H * hd)
    _swiglu_mlp(init, f"{p}.mlp", D, c["intermediate_size"], w)
    w[f"{p}.input_layernorm.weight"] = init.norm(D)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(D)


def _mimo_weights(cfg: dict, init: _Init, with_mtp: bool):
    w, D = {}, cfg["hidden_size"]
    _embed_and_head(init, D, cfg["vocab_size"], cfg["tie_word_embeddings"], "model.", "lm_head.weight", False, w)
    for i in range(cfg["num_hidden_layers"]):
        _mimo_block(init, f"model.layers.{i}", cfg, w)
    for j in range(cfg["num_nextn_predict_layers"] if with_mtp else 0):
        p = f"model.mtp_layers.{j}"
        w[f"{p}.token_layernorm.weight"] = init.norm(D)
        w[f"{p}.hidden_layernorm.weight"] = init.norm(D)
        w[f"{p}.input_proj.weight"] = init.linear(D, 2 * D)  # over [hidden, embedding]
        _mimo_block(init, p, cfg, w)
        w[f"{p}.final_layernorm.weight"] = init.norm(D)
    return w


# ---- GLM-4.5 and DeepSeek-V3.2 (NextN) ----


def _glm4_moe_block(init: _Init, p: str, c: dict, moe: bool, w):
    D, H, KV, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    for name, rows in (("q_proj", H * hd), ("k_proj", KV * hd), ("v_proj", KV * hd)):
        w[f"{p}.self_attn.{name}.weight"] = init.linear(rows, D)
        w[f"{p}.self_attn.{name}.bias"] = init.normal((rows,), 0.1)
    w[f"{p}.self_attn.o_proj.weight"] = init.linear(D, H * hd)
    w[f"{p}.self_attn.q_norm.weight"] = init.norm(hd)
    w[f"{p}.self_attn.k_norm.weight"] = init.norm(hd)
    if moe:
        E = c["n_routed_experts"]
        w[f"{p}.mlp.gate.weight"] = init.linear(E, D)
        w[f"{p}.mlp.gate.e_score_correction_bias"] = init.normal((E,), 0.1)
        for e in range(E):
            _swiglu_mlp(init, f"{p}.mlp.experts.{e}", D, c["moe_intermediate_size"], w)
        _swiglu_mlp(init, f"{p}.mlp.shared_experts", D, c["moe_intermediate_size"] * c["n_shared_experts"], w)
    else:
        _swiglu_mlp(init, f"{p}.mlp", D, c["intermediate_size"], w)
    w[f"{p}.input_layernorm.weight"] = init.norm(D)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(D)


def _deepseek_v32_block(init: _Init, p: str, c: dict, moe: bool, w):
    _deepseek_block(init, p, c, moe, w)
    a, D = f"{p}.self_attn.indexer", c["hidden_size"]
    w[f"{a}.wq_b.weight"] = init.linear(c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"])
    w[f"{a}.wk.weight"] = init.linear(c["index_head_dim"], D)
    w[f"{a}.k_norm.weight"] = init.norm(c["index_head_dim"])
    w[f"{a}.k_norm.bias"] = init.normal((c["index_head_dim"],), 0.05)
    w[f"{a}.weights_proj.weight"] = init.linear(c["index_n_heads"], D)


def _nextn_weights(cfg: dict, init: _Init, with_mtp: bool, block, is_moe):
    w, D, N = {}, cfg["hidden_size"], cfg["num_hidden_layers"]
    _embed_and_head(init, D, cfg["vocab_size"], cfg["tie_word_embeddings"], "model.", "lm_head.weight", False, w)
    for i in range(N):
        block(init, f"model.layers.{i}", cfg, is_moe(i), w)
    head = "model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"
    for j in range(cfg["num_nextn_predict_layers"] if with_mtp else 0):
        p = f"model.layers.{N + j}"
        w[f"{p}.enorm.weight"] = init.norm(D)
        w[f"{p}.hnorm.weight"] = init.norm(D)
        w[f"{p}.eh_proj.weight"] = init.linear(D, 2 * D)
        block(init, p, cfg, True, w)
        w[f"{p}.shared_head.norm.weight"] = init.norm(D)
        w[f"{p}.shared_head.head.weight"] = w[head].copy()  # the checkpoints carry copies
        w[f"{p}.embed_tokens.weight"] = w["model.embed_tokens.weight"].copy()
    return w


def _glm4_moe_weights(cfg, init, with_mtp):
    return _nextn_weights(cfg, init, with_mtp, _glm4_moe_block, lambda i: i >= cfg["first_k_dense_replace"])


def _deepseek_v32_weights(cfg, init, with_mtp):
    return _nextn_weights(cfg, init, with_mtp, _deepseek_v32_block, lambda i: _deepseek_is_moe(cfg, i))


_WEIGHTS = {"qwen3_5": _qwen3_5_weights, "qwen3_5_moe": _qwen3_5_weights, "mimo": _mimo_weights,
            "glm4_moe": _glm4_moe_weights, "deepseek_v32": _deepseek_v32_weights}


# ---- writing ----


def is_mtp_key(key: str, cfg: dict) -> bool:
    """The fixture's own notion (independent of mtplx): which keys belong to the MTP head."""
    n = text_config(cfg)["num_hidden_layers"]
    parts = key.split(".")
    return (key.startswith("mtp.") or key.startswith("model.mtp_layers.")
            or (key.startswith("model.layers.") and int(parts[2]) >= n))


def _write(out: Path, cfg: dict, weights: Dict[str, np.ndarray], dtype: str, shards: int, head_file: Optional[str]):
    import mlx.core as mx

    mx_dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    arrays = {k: (mx.array(v) if k.endswith("e_score_correction_bias") else mx.array(v).astype(mx_dtype))
              for k, v in sorted(weights.items())}
    files: Dict[str, Dict[str, object]] = {}
    trunk = [k for k in arrays if not (head_file and is_mtp_key(k, cfg))]
    if head_file:
        files[head_file] = {k: arrays[k] for k in arrays if is_mtp_key(k, cfg)}
    if shards == 1 and not head_file:
        files["model.safetensors"] = arrays
    else:
        # MTP keys land in the last shard, as in the published checkpoints
        for s, part in enumerate(np.array_split(np.array(trunk, dtype=object), shards)):
            files[f"model-{s + 1:05d}-of-{shards:05d}.safetensors"] = {k: arrays[k] for k in part}
    for name, part in files.items():
        mx.save_safetensors(str(out / name), part, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(int(a.nbytes) for a in arrays.values())},
                 "weight_map": {k: name for name, part in files.items() for k in part}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def make_mtp_model(out_dir, family: str, *, seed: int = 0, vocab_size: int = 512, with_mtp: bool = True,
                   mtp_layers: int = 1, tie: bool = False, shards: int = 1, head_file: Optional[str] = None,
                   dtype: str = "float32", small_vocab: bool = False, mtp_experts_one_by_one: bool = False) -> Path:
    """Write a tiny random `family` checkpoint (config.json, safetensors, tokenizer files).

    `small_vocab`: a char-level tokenizer over `vocab_size` ids with no eos (for exact
    sampling-distribution tests, as `tiny_models.make_small_vocab_model`).
    """
    if family not in CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if tie and family in ("glm4_moe", "deepseek_v32"):
        raise ValueError(f"mlx-lm's {family} has no tied-embedding variant")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(CONFIGS[family])
    c = text_config(cfg)
    c["vocab_size"] = vocab_size
    c["tie_word_embeddings"] = cfg["tie_word_embeddings"] = tie
    c["torch_dtype"] = dtype
    if family.startswith("qwen3_5"):
        c["mtp_num_hidden_layers"] = mtp_layers if with_mtp else 0
    else:
        c["num_nextn_predict_layers"] = mtp_layers if with_mtp else 0
    if mtp_experts_one_by_one:
        cfg["_mtp_experts_one_by_one"] = True
    weights = _WEIGHTS[family](cfg, _Init(seed), with_mtp)
    cfg.pop("_mtp_experts_one_by_one", None)
    if small_vocab:
        _build_small_vocab_tokenizer(out, vocab_size, None)
        c["eos_token_id"] = cfg["eos_token_id"] = None
    else:
        build_tokenizer(out, vocab_size=vocab_size)
        c["eos_token_id"] = cfg["eos_token_id"] = 0
    _write(out, cfg, weights, dtype, shards, head_file)
    return out
