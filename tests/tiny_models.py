"""Tiny random models in the real mlx-lm / Hugging Face checkpoint layouts, for tests.

Plain module (no pytest import) so benchmarks and scripts can use it too::

    from tiny_models import make_tiny_model, make_small_vocab_model, build_tokenizer
    path = make_tiny_model(tmp / "q3n", "qwen3_next")        # config.json + model.safetensors + tokenizer
    model, tokenizer = mlx_lm.load(str(make_tiny_model(tmp / "l", "llama")))

Families (see ``FAMILY_CONFIGS`` for the exact configs):

* ``llama``       - model_type llama, untied lm_head, GQA.
* ``qwen3``       - model_type qwen3, tied embeddings, q/k norms, GQA.
* ``qwen3_next``  - hybrid Gated DeltaNet + gated full attention + MoE, stored in the HF layout
                    (per-expert weights, conv1d as [conv_dim, 1, kernel], RMSNorm weights stored as
                    offsets from 1). ``with_mtp`` adds the ``mtp.*`` module (one full-attention MoE
                    layer). MTP norms are offsets from 1 too, as in the real checkpoint.
* ``deepseek_v3`` - MLA attention, one dense layer then MoE layers (sigmoid router with
                    ``e_score_correction_bias``), ``kv_b_proj`` in the HF layout. ``with_mtp`` adds
                    the NextN layer at ``model.layers.{num_hidden_layers}``.

Weights come from a seeded numpy RNG: the same (family, seed, overrides) gives identical bytes.
Greedy decoding gives varied text (no immediate one-token loop; the tied qwen3 is the most
loop-prone), next-token distributions have top probabilities of roughly 0.1-0.8, and the special
tokens have short head rows so the models practically never emit eos on their own: to test eos
handling use a stop token, or ``make_small_vocab_model(..., eos_token_id=0)``.
The tokenizer is a byte-level BPE trained (once per process) on a fixed list of Python stdlib
source files, with special tokens ``<|endoftext|>`` (eos, id 0), ``<|im_start|>`` (1),
``<|im_end|>`` (2) and a ChatML chat template.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import os
import sysconfig
import threading
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

__all__ = [
    "SPECIAL_TOKENS",
    "EOS_TOKEN",
    "IM_START",
    "IM_END",
    "CHAT_TEMPLATE",
    "FAMILIES",
    "FAMILY_CONFIGS",
    "build_tokenizer",
    "make_tiny_model",
    "make_small_vocab_model",
    "mtp_keys",
    "greedy_tokens",
]

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Fixed training corpus: stdlib files (relative to the stdlib dir) and the module to fall back on
# (via inspect.getsource) where the file is not on disk (e.g. a zipped stdlib).
_CORPUS_FILES: Tuple[Tuple[str, str], ...] = (
    ("textwrap.py", "textwrap"),
    ("string.py", "string"),
    ("heapq.py", "heapq"),
    ("bisect.py", "bisect"),
    ("contextlib.py", "contextlib"),
    ("functools.py", "functools"),
    ("json/__init__.py", "json"),
    ("json/decoder.py", "json.decoder"),
    ("json/encoder.py", "json.encoder"),
    ("fractions.py", "fractions"),
)

# A little plain English and chat text so prose and chat prompts tokenize into sensible pieces.
_EXTRA_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?\n"
    "Question: What is the capital of France?\nAnswer: The capital of France is Paris.\n"
    "You are a helpful assistant. Please answer the question below in one sentence.\n"
    "user\nassistant\nsystem\n"
)


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

_TOKENIZER_CACHE: Dict[int, str] = {}  # vocab_size -> tokenizer.json text
_TOKENIZER_LOCK = threading.Lock()


def _corpus() -> List[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel, module in _CORPUS_FILES:
        f = stdlib / rel
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except OSError:
            texts.append(inspect.getsource(importlib.import_module(module)))
    texts.append(_EXTRA_TEXT * 20)
    return texts


def _train_tokenizer_json(vocab_size: int) -> str:
    with _TOKENIZER_LOCK:
        if vocab_size in _TOKENIZER_CACHE:
            return _TOKENIZER_CACHE[vocab_size]
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"a byte-level BPE needs vocab_size >= {256 + len(SPECIAL_TOKENS)}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        text = tok.to_str(pretty=True)
        _TOKENIZER_CACHE[vocab_size] = text
        return text


def _tokenizer_config(eos_token: Optional[str], chat_template: Optional[str]) -> dict:
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS):
        added[str(i)] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": eos_token,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "errors": "replace",
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    return cfg


def build_tokenizer(out_dir, vocab_size: int = 512) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (byte-level BPE, ChatML template).

    Trained once per process per vocab_size on a fixed list of stdlib sources (well under a
    second); loads with ``transformers.AutoTokenizer`` and ``mlx_lm.utils.load_tokenizer``.
    Special tokens: ``<|endoftext|>`` = 0 (eos and pad), ``<|im_start|>`` = 1, ``<|im_end|>`` = 2.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_train_tokenizer_json(vocab_size), encoding="utf-8")
    cfg = _tokenizer_config(EOS_TOKEN, CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "additional_special_tokens": [IM_START, IM_END]},
            indent=2,
        ),
        encoding="utf-8",
    )
    return out


def _build_small_vocab_tokenizer(out_dir: Path, vocab_size: int, eos_token_id: Optional[int]) -> None:
    """A char-level word tokenizer: token i is one character (``<|endoftext|>`` at eos_token_id)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    chars = [c for c in alphabet]
    vocab: Dict[str, int] = {}
    it = iter(chars)
    for i in range(vocab_size):
        if eos_token_id is not None and i == eos_token_id:
            vocab[EOS_TOKEN] = i
        else:
            try:
                vocab[next(it)] = i
            except StopIteration:
                vocab[f"<t{i}>"] = i
    unk = next(t for t in vocab if t != EOS_TOKEN)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if eos_token_id is not None:
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN if eos_token_id is not None else None,
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------

_COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
    "eos_token_id": 0,
}

FAMILY_CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
    "qwen3_next": {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 4,  # layers 0-2 Gated DeltaNet, layer 3 full attention (as the real 3:1)
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
}

FAMILIES = tuple(FAMILY_CONFIGS)

_MTP_FAMILIES = ("qwen3_next", "deepseek_v3")


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


class _Init:
    """Seeded weight factory. Projections use std gain/sqrt(fan_in) so every layer's output is
    O(1) per component whatever the width; norms are 1 + small noise (or the noise alone where the
    checkpoint stores offsets from 1)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def linear(self, out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal((out_dim, in_dim)) * (gain / np.sqrt(in_dim))).astype(np.float32)

    def normal(self, shape, std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm(self, dim: int, offset: bool = False) -> np.ndarray:
        noise = self.normal((dim,), 0.05)
        return noise if offset else (1.0 + noise).astype(np.float32)


def _swiglu_mlp(init: _Init, prefix: str, hidden: int, inter: int, out: Dict[str, np.ndarray]) -> None:
    out[f"{prefix}.gate_proj.weight"] = init.linear(inter, hidden)
    out[f"{prefix}.up_proj.weight"] = init.linear(inter, hidden)
    out[f"{prefix}.down_proj.weight"] = init.linear(hidden, inter)


def _embed_and_head(init: _Init, cfg: dict, w: Dict[str, np.ndarray]) -> None:
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    # logits = norm(h) . head_row: std 2.5/sqrt(D) per entry gives logits of std ~2.5: spread, not flat.
    if cfg.get("tie_word_embeddings"):
        # Small embedding relative to the layer outputs, else the residual stays close to the
        # input token's own row and greedy decoding repeats that token forever.
        # The final norm's gain (5, as trained models often have) brings the logits back up.
        # Rows of equal norm: with a tied head a long row is a "hub" that wins the argmax from
        # most states, its own included, and greedy decoding gets stuck on it.
        e = init.normal((V, D), 1.0)
        e *= 0.2 / np.linalg.norm(e, axis=1, keepdims=True)
        w["model.embed_tokens.weight"] = e.astype(np.float32)
        w["model.norm.weight"] = (12.5 * init.norm(D)).astype(np.float32)
    else:
        w["model.embed_tokens.weight"] = init.normal((V, D), 1.0)
        w["lm_head.weight"] = init.normal((V, D), 2.5 / np.sqrt(D))
        w["model.norm.weight"] = init.norm(D, offset=cfg["model_type"] == "qwen3_next")
    # Special tokens (eos, <|im_start|>, <|im_end|>) get short output rows, so their logits stay
    # near 0 while the best ordinary token sits around +7: greedy decoding never emits eos and
    # sampling at temperature 1 does about once in 10^4 steps, so rows do not stop at random.
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    w[head][: min(len(SPECIAL_TOKENS), V)] *= 0.1


def _llama_like_weights(cfg: dict, init: _Init) -> Dict[str, np.ndarray]:
    D, H, KV, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w: Dict[str, np.ndarray] = {}
    _embed_and_head(init, cfg, w)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = init.linear(H * hd, D)
        w[f"{p}.self_attn.k_proj.weight"] = init.linear(KV * hd, D)
        w[f"{p}.self_attn.v_proj.weight"] = init.linear(KV * hd, D)
        w[f"{p}.self_attn.o_proj.weight"] = init.linear(D, H * hd)
        if cfg["model_type"] == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = init.norm(hd)
            w[f"{p}.self_attn.k_norm.weight"] = init.norm(hd)
        _swiglu_mlp(init, f"{p}.mlp", D, cfg["intermediate_size"], w)
        w[f"{p}.input_layernorm.weight"] = init.norm(D)
        w[f"{p}.post_attention_layernorm.weight"] = init.norm(D)
    return w


# ---- Qwen3-Next (HF layout) ----


def _qwen3_next_moe(init: _Init, p: str, cfg: dict, w: Dict[str, np.ndarray]) -> None:
    D, E = cfg["hidden_size"], cfg["num_experts"]
    w[f"{p}.gate.weight"] = init.linear(E, D)
    for e in range(E):
        _swiglu_mlp(init, f"{p}.experts.{e}", D, cfg["moe_intermediate_size"], w)
    _swiglu_mlp(init, f"{p}.shared_expert", D, cfg["shared_expert_intermediate_size"], w)
    w[f"{p}.shared_expert_gate.weight"] = init.linear(1, D)


def _qwen3_next_full_attn(init: _Init, p: str, cfg: dict, w: Dict[str, np.ndarray]) -> None:
    D, H, KV, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w[f"{p}.q_proj.weight"] = init.linear(H * hd * 2, D)  # queries and output gate, interleaved per head
    w[f"{p}.k_proj.weight"] = init.linear(KV * hd, D)
    w[f"{p}.v_proj.weight"] = init.linear(KV * hd, D)
    w[f"{p}.o_proj.weight"] = init.linear(D, H * hd, gain=2.0)  # sigmoid gate halves the output
    w[f"{p}.q_norm.weight"] = init.norm(hd, offset=True)
    w[f"{p}.k_norm.weight"] = init.norm(hd, offset=True)


def _qwen3_next_linear_attn(init: _Init, p: str, cfg: dict, w: Dict[str, np.ndarray]) -> None:
    D = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    K = cfg["linear_conv_kernel_dim"]
    w[f"{p}.in_proj_qkvz.weight"] = init.linear(2 * key_dim + 2 * value_dim, D)
    w[f"{p}.in_proj_ba.weight"] = init.linear(2 * nv, D)
    w[f"{p}.conv1d.weight"] = init.normal((conv_dim, 1, K), 1.0 / np.sqrt(K))  # HF: [C, 1, K]
    # Decay g = exp(-exp(A_log) * softplus(a + dt_bias)) mostly in 0.3..0.95, so the recurrent
    # state carries real information across positions (rollback bugs show up in the output).
    w[f"{p}.A_log"] = np.log(init.rng.uniform(0.05, 0.6, size=(nv,))).astype(np.float32)
    w[f"{p}.dt_bias"] = init.normal((nv,), 0.5)
    w[f"{p}.norm.weight"] = init.norm(dv)  # gated RMSNorm: a plain weight, NOT an offset
    w[f"{p}.out_proj.weight"] = init.linear(D, value_dim, gain=2.0)


def _qwen3_next_weights(cfg: dict, init: _Init, with_mtp: bool) -> Dict[str, np.ndarray]:
    D = cfg["hidden_size"]
    w: Dict[str, np.ndarray] = {}
    _embed_and_head(init, cfg, w)
    interval = cfg["full_attention_interval"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        if (i + 1) % interval != 0:
            _qwen3_next_linear_attn(init, f"{p}.linear_attn", cfg, w)
        else:
            _qwen3_next_full_attn(init, f"{p}.self_attn", cfg, w)
        sparse = i not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0
        if sparse:
            _qwen3_next_moe(init, f"{p}.mlp", cfg, w)
        else:
            _swiglu_mlp(init, f"{p}.mlp", D, cfg["intermediate_size"], w)
        w[f"{p}.input_layernorm.weight"] = init.norm(D, offset=True)
        w[f"{p}.post_attention_layernorm.weight"] = init.norm(D, offset=True)
    if with_mtp:
        w["mtp.pre_fc_norm_embedding.weight"] = init.norm(D, offset=True)
        w["mtp.pre_fc_norm_hidden.weight"] = init.norm(D, offset=True)
        w["mtp.fc.weight"] = init.linear(D, 2 * D)
        p = "mtp.layers.0"
        _qwen3_next_full_attn(init, f"{p}.self_attn", cfg, w)
        _qwen3_next_moe(init, f"{p}.mlp", cfg, w)
        w[f"{p}.input_layernorm.weight"] = init.norm(D, offset=True)
        w[f"{p}.post_attention_layernorm.weight"] = init.norm(D, offset=True)
        w["mtp.norm.weight"] = init.norm(D, offset=True)
    return w


# ---- DeepSeek-V3 (HF layout) ----


def _deepseek_block(init: _Init, p: str, cfg: dict, moe: bool, w: Dict[str, np.ndarray]) -> None:
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    a = f"{p}.self_attn"
    if qr is None:
        w[f"{a}.q_proj.weight"] = init.linear(H * (nope + rope), D)
    else:
        w[f"{a}.q_a_proj.weight"] = init.linear(qr, D)
        w[f"{a}.q_a_layernorm.weight"] = init.norm(qr)
        w[f"{a}.q_b_proj.weight"] = init.linear(H * (nope + rope), qr)
    w[f"{a}.kv_a_proj_with_mqa.weight"] = init.linear(kvr + rope, D)
    w[f"{a}.kv_a_layernorm.weight"] = init.norm(kvr)
    w[f"{a}.kv_b_proj.weight"] = init.linear(H * (nope + vd), kvr)  # HF: [H*(nope+v), kv_lora_rank]
    w[f"{a}.o_proj.weight"] = init.linear(D, H * vd)
    m = f"{p}.mlp"
    if moe:
        E = cfg["n_routed_experts"]
        w[f"{m}.gate.weight"] = init.linear(E, D)
        w[f"{m}.gate.e_score_correction_bias"] = init.normal((E,), 0.1)
        for e in range(E):
            _swiglu_mlp(init, f"{m}.experts.{e}", D, cfg["moe_intermediate_size"], w)
        if cfg.get("n_shared_experts"):
            _swiglu_mlp(init, f"{m}.shared_experts", D, cfg["moe_intermediate_size"] * cfg["n_shared_experts"], w)
    else:
        _swiglu_mlp(init, m, D, cfg["intermediate_size"], w)
    w[f"{p}.input_layernorm.weight"] = init.norm(D)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(D)


def _deepseek_is_moe(cfg: dict, i: int) -> bool:
    return (
        cfg.get("n_routed_experts") is not None
        and i >= cfg["first_k_dense_replace"]
        and i % cfg["moe_layer_freq"] == 0
    )


def _deepseek_v3_weights(cfg: dict, init: _Init, with_mtp: bool) -> Dict[str, np.ndarray]:
    D = cfg["hidden_size"]
    w: Dict[str, np.ndarray] = {}
    _embed_and_head(init, cfg, w)
    N = cfg["num_hidden_layers"]
    for i in range(N):
        _deepseek_block(init, f"model.layers.{i}", cfg, _deepseek_is_moe(cfg, i), w)
    for j in range(cfg.get("num_nextn_predict_layers", 0) if with_mtp else 0):
        p = f"model.layers.{N + j}"
        w[f"{p}.enorm.weight"] = init.norm(D)
        w[f"{p}.hnorm.weight"] = init.norm(D)
        w[f"{p}.eh_proj.weight"] = init.linear(D, 2 * D)
        _deepseek_block(init, p, cfg, True, w)
        w[f"{p}.shared_head.norm.weight"] = init.norm(D)
        # As in the real checkpoint the NextN layer carries its own copies of the embedding and head.
        w[f"{p}.shared_head.head.weight"] = w["lm_head.weight"].copy()
        w[f"{p}.embed_tokens.weight"] = w["model.embed_tokens.weight"].copy()
    return w


# --------------------------------------------------------------------------------------------
# public builders
# --------------------------------------------------------------------------------------------


def _save(out: Path, cfg: dict, weights: Dict[str, np.ndarray], dtype: str) -> None:
    import mlx.core as mx

    mx_dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    arrays = {}
    for k in sorted(weights):
        a = mx.array(weights[k])
        # The router correction bias stays float32, as DeepSeek ships it.
        if not k.endswith("e_score_correction_bias"):
            a = a.astype(mx_dtype)
        arrays[k] = a
    mx.save_safetensors(str(out / "model.safetensors"), arrays, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True), encoding="utf-8")


def make_tiny_model(
    out_dir,
    family: str,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    with_mtp: bool = True,
    dtype: str = "float32",
    **config_overrides,
) -> Path:
    """Write a tiny random ``family`` checkpoint (config.json, model.safetensors, tokenizer files).

    ``with_mtp`` only matters for qwen3_next (``mtp.*``) and deepseek_v3 (NextN layer at index
    ``num_hidden_layers``); config then carries ``num_nextn_predict_layers: 1`` (and for
    qwen3_next also ``mtp_num_hidden_layers: 1``). ``config_overrides`` replace config keys
    (e.g. ``num_hidden_layers=8``); ``dtype`` is float32, float16 or bfloat16 (note: on the MLX
    CPU backend the MoE families only run in float32: ``gather_mm`` is float32-only there).
    The trunk weights do not depend on ``with_mtp``: the MTP weights are drawn after them.
    """
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(FAMILY_CONFIGS[family])
    cfg["vocab_size"] = vocab_size
    cfg["torch_dtype"] = dtype
    if with_mtp and family in _MTP_FAMILIES:
        cfg["num_nextn_predict_layers"] = 1
        if family == "qwen3_next":
            cfg["mtp_num_hidden_layers"] = 1
    cfg.update(config_overrides)
    if family == "qwen3_next" and with_mtp and cfg.get("num_nextn_predict_layers", 1) != 1:
        raise ValueError("qwen3_next tiny models have exactly one MTP layer")

    init = _Init(seed)
    if family in ("llama", "qwen3"):
        weights = _llama_like_weights(cfg, init)
    elif family == "qwen3_next":
        weights = _qwen3_next_weights(cfg, init, with_mtp)
    else:
        weights = _deepseek_v3_weights(cfg, init, with_mtp)

    build_tokenizer(out, vocab_size=vocab_size)
    cfg["eos_token_id"] = SPECIAL_TOKENS.index(EOS_TOKEN)
    _save(out, cfg, weights, dtype)
    return out


def make_small_vocab_model(
    out_dir,
    vocab_size: int = 16,
    seed: int = 0,
    *,
    eos_token_id: Optional[int] = None,
    dtype: str = "float32",
    **config_overrides,
) -> Path:
    """A tiny untied llama over ``vocab_size`` token ids, for exact sampling-distribution tests.

    Next-token distributions at temperature 1 are spread (logit std ~1: the top token is
    typically 0.2-0.5). By default there is no eos at all, so sampled rows never stop early;
    pass ``eos_token_id`` to make one id ``<|endoftext|>``. The tokenizer is a trivial char-level
    one (token i is one character) only so that mlx-lm can load the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }
    cfg.update(config_overrides)
    init = _Init(seed)
    D = cfg["hidden_size"]
    w = _llama_like_weights(cfg, init)
    # Replace the head: logit std ~1.0 keeps every token plausible at temperature 1.
    w["lm_head.weight"] = init.normal((cfg["vocab_size"], D), 1.0 / np.sqrt(D))
    _build_small_vocab_tokenizer(out, cfg["vocab_size"], eos_token_id)
    _save(out, cfg, w, dtype)
    return out


def mtp_keys(path) -> List[str]:
    """The checkpoint keys of ``path`` that belong to MTP / NextN modules (sorted)."""
    import mlx.core as mx

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    n = cfg.get("num_hidden_layers", 1 << 30)
    keys = []
    for f in sorted(path.glob("*.safetensors")):
        for k in mx.load(str(f)):
            if k.startswith("mtp.") or (k.startswith("model.layers.") and int(k.split(".")[2]) >= n):
                keys.append(k)
    return sorted(keys)


def greedy_tokens(model, prompt_ids: Iterable[int], max_tokens: int = 30) -> List[int]:
    """Plain greedy decoding with an mlx-lm cache (no eos stop): the token ids produced."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([list(prompt_ids)])
    out: List[int] = []
    for _ in range(max_tokens):
        logits = model(x, cache=cache)[:, -1, :]
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(tok)
        x = mx.array([[tok]])
    return out


def reference_tokens(model, prompt_ids: Iterable[int], max_tokens: int, eos) -> List[int]:
    """mlx-lm's own greedy decoding (`generate_step`), stopping at (and dropping) eos: the reference
    every engine test compares against."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out: List[int] = []
    steps = generate_step(mx.array(list(prompt_ids)), model, max_tokens=max_tokens)
    for (tok, _), _ in zip(steps, range(max_tokens)):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


def greedy_logits(model, n: int) -> List[np.ndarray]:
    """The last-position logits (fp32) of n greedy steps of mlx-lm's own forward over a prompt cache,
    from a fixed 27-token prompt: what tests compare bit for bit when a patch must keep the values."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, out, tok = make_prompt_cache(model), [], mx.array([list(range(3, 30))], dtype=mx.int32)
    for _ in range(n):
        logits = model(tok, cache=cache)[:, -1]
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
        tok = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
    return out


def same_logits(a: List[np.ndarray], b: List[np.ndarray]) -> bool:
    """Two `greedy_logits` runs equal bit for bit."""
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def untrained_head(bundle, out_dir, seed: int = 3) -> Path:
    """An untrained MTP head for `bundle`'s model saved as a sidecar in `out_dir` (the engine tests' drafter:
    its drafts are mostly rejected, so rounds accept a mix of 0..K tokens)."""
    from mtplx.training.train_head import TrainConfig, _init_head, save_sidecar

    save_sidecar(bundle, _init_head(bundle.model, TrainConfig(seed=seed)), out_dir, {})
    return Path(out_dir)
