"""Tiny random checkpoints of common mlx-lm architectures, for the coverage test.

Each checkpoint is what `mlx_lm.convert` writes for that architecture (the MLX layout:
`config.json` with the family's real `model_type` and fields, `model.safetensors` with the
parameter names of mlx-lm's own model class) plus the shared tiny tokenizer of
`tiny_models.build_tokenizer`, so `mlx_lm.load(path)` loads it like a converted hub model.
Weights are float32 from a seeded numpy RNG (the same arch and seed give the same bytes),
scaled so greedy text varies and next-token distributions are not flat.

    from arch_fixtures import ARCHITECTURES, make_arch_model
    model, tok = mlx_lm.load(str(make_arch_model(tmp / "lfm2", "lfm2")))

Every config is small (hidden 64, 2-6 layers, vocab 512): the whole set builds and loads in a
few seconds on a CPU. Layer stacks mix each family's layer kinds (sliding-window and global
attention, conv/SSM and attention layers) so every cache kind the family uses is exercised.
`qwen3_next` comes from `tiny_models`, the native-MTP families (qwen3_5, qwen3_5_moe, mimo,
glm4_moe, deepseek_v32) from `mtp_fixtures`, both in the Hugging Face layout.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Dict

import numpy as np

VOCAB = 512
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False)


def _cfg(model_type: str, **fields) -> dict:
    return {"model_type": model_type, **_BASE, "num_hidden_layers": 2, **fields}


# The configs. Sliding windows are short (8-16 tokens) so prompts and completions cross them.
ARCH_CONFIGS: Dict[str, dict] = {
    "llama": _cfg("llama"),
    "mistral": _cfg("mistral"),
    "qwen2": _cfg("qwen2"),
    "qwen3": _cfg("qwen3", head_dim=16, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen3_moe": _cfg("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], moe_intermediate_size=32, rope_theta=10000.0, norm_topk_prob=True),
    "phi3": _cfg("phi3"),
    "granite": _cfg("granite", logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=4.0,
                    residual_multiplier=0.5, attention_bias=False, mlp_bias=False, rope_theta=10000.0),
    "olmo2": _cfg("olmo2"),
    "starcoder2": _cfg("starcoder2", norm_epsilon=1e-5),
    "cohere": _cfg("cohere", layer_norm_eps=1e-5, logit_scale=0.5, use_qk_norm=False),
    "deepseek_v2": _cfg("deepseek_v2", num_hidden_layers=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        topk_method="greedy", num_key_value_heads=4,
                        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                                      "mscale": 1.0, "mscale_all_dim": 0.0}),
    "glm4": _cfg("glm4", attention_bias=True, head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0),
    "lfm2": _cfg("lfm2", num_hidden_layers=4, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64,
                 block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 block_ff_dim=128, layer_types=["conv", "full_attention", "conv", "conv"], tie_word_embeddings=True),
    "nemotron_h": _cfg("nemotron_h", hybrid_override_pattern=["M", "*", "M", "-"], attention_bias=False,
                       mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                       conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                       use_conv_bias=True, head_dim=16, time_step_limit=[0.0, float("inf")]),
    "gemma3_text": _cfg("gemma3_text", num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=8, sliding_window_pattern=3, rope_local_base_freq=10000.0),
    "gpt_oss": _cfg("gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"], rope_theta=10000.0),
    "falcon_h1": _cfg("falcon_h1", head_dim=16, mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16,
                      mamba_n_groups=1, mamba_n_heads=4, mamba_expand=1, mamba_chunk_size=16,
                      tie_word_embeddings=False, rope_theta=10000.0, embedding_multiplier=1.0,
                      lm_head_multiplier=1.0, mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5),
    "gemma2": _cfg("gemma2", head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "internlm3": _cfg("internlm3", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "mamba2": {"model_type": "mamba2", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
               "num_heads": 8, "head_dim": 16, "state_size": 16, "num_hidden_layers": 2, "layer_norm_epsilon": 1e-5,
               "conv_kernel": 4, "n_groups": 2, "use_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": False, "time_step_limit": [0.0, float("inf")], "time_step_rank": 8},
    "lfm2_moe": _cfg("lfm2_moe", num_hidden_layers=4, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5, conv_bias=False,
                     conv_L_cache=3, layer_types=["conv", "full_attention", "conv", "conv"], rope_theta=10000.0),
    "granitemoehybrid": _cfg("granitemoehybrid", num_hidden_layers=3, attention_bias=False, embedding_multiplier=4.0,
                             attention_multiplier=0.25, logits_scaling=2.0, residual_multiplier=0.5,
                             layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False,
                             mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True,
                             time_step_limit=[0.0, float("inf")]),
    "jamba": _cfg("jamba", num_hidden_layers=4, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2, num_experts=4,
                  num_experts_per_tok=2, tie_word_embeddings=False),
    "recurrent_gemma": {"model_type": "recurrent_gemma", "attention_bias": False, "conv1d_width": 4, "hidden_size": 64,
                        "intermediate_size": 128, "logits_soft_cap": 30.0, "num_attention_heads": 4,
                        "num_hidden_layers": 3, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                        "attention_window_size": 8, "vocab_size": VOCAB,
                        "block_types": ["recurrent", "recurrent", "attention"]},
}

# Architectures mlx-lm runs that the engine does not (yet): refused at start-up, never run.
UNSUPPORTED_CONFIGS: Dict[str, dict] = {
    # time and channel mixing share one ArraysCache, so neither alone can capture it
    "rwkv7": {"model_type": "rwkv7", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "norm_eps": 1e-5,
              "head_dim": 16, "num_hidden_layers": 2, "a_low_rank_dim": 8, "v_low_rank_dim": 8,
              "gate_low_rank_dim": 8, "decay_low_rank_dim": 8, "tie_word_embeddings": False},
    # its layer writes only into caches of mlx-lm's own class: with ours it would freeze its state
    "mamba": {"model_type": "mamba", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
              "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
              "use_conv_bias": True, "time_step_rank": 8, "tie_word_embeddings": True},
}

# Tied-embedding families whose token embedding would otherwise dominate the residual stream
# (greedy text then repeats one token): stronger layers.
ARCH_GAIN = {"qwen3": 2.5, "gemma3_text": 0.6, "gemma2": 1.0}

# Written in their Hugging Face layout by the engine's own fixtures: tiny_models (qwen3_next)
# and mtp_fixtures (the native-MTP families; their heads are ignored by `none` / `ngram`).
TINY_MODELS_ARCHS = ("qwen3_next",)
MTP_FIXTURE_ARCHS = ("qwen3_5", "qwen3_5_moe", "mimo", "glm4_moe", "deepseek_v32")

ARCHITECTURES = tuple(ARCH_CONFIGS) + TINY_MODELS_ARCHS + MTP_FIXTURE_ARCHS


def _model_class(config: dict):
    from mlx_lm.utils import MODEL_REMAPPING

    module = importlib.import_module("mlx_lm.models." + MODEL_REMAPPING.get(config["model_type"], config["model_type"]))
    return module.Model, module.ModelArgs


def _random_weights(model, seed: int, gain: float = 1.5) -> Dict[str, "np.ndarray"]:
    """Matrices drawn N(0, (gain / sqrt(fan_in))^2); vectors (norms, biases, SSM decay) keep the
    class's own init plus a little noise, so norms stay near their conventions."""
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    out = {}
    for name, p in tree_flatten(model.parameters()):
        base = np.array(p, dtype=np.float32)
        if base.ndim >= 2:
            fan_in = int(np.prod(base.shape[1:])) if "conv" in name else base.shape[-1]
            out[name] = (rng.standard_normal(base.shape) * gain / np.sqrt(fan_in)).astype(np.float32)
        else:
            out[name] = (base + 0.05 * rng.standard_normal(base.shape)).astype(np.float32)
    return out


def make_arch_model(out_dir, arch: str, seed: int = 0, gain: float = None) -> Path:
    """Write a tiny random `arch` checkpoint to `out_dir` (loadable by `mlx_lm.load`); returns the path."""
    import mlx.core as mx
    from tiny_models import build_tokenizer, make_tiny_model

    out = Path(out_dir)
    if arch in TINY_MODELS_ARCHS:
        return make_tiny_model(out, arch, seed=seed)
    if arch in MTP_FIXTURE_ARCHS:
        from mtp_fixtures import make_mtp_model

        return make_mtp_model(out, arch, seed=seed)
    config = dict(ARCH_CONFIGS.get(arch) or UNSUPPORTED_CONFIGS[arch])
    model_cls, args_cls = _model_class(config)
    model = model_cls(args_cls.from_dict(config))
    weights = _random_weights(model, seed, ARCH_GAIN.get(arch, 1.5) if gain is None else gain)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()},
                        metadata={"format": "mlx"})
    config.update(eos_token_id=0, bos_token_id=None, pad_token_id=0)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(out, vocab_size=VOCAB)
    return out
