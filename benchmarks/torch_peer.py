"""PyTorch + transformers as a peer on the same weights (CUDA only): the decode part's third column.

The MLX model's weights (dequantized where they are packed) are copied into the transformers
model of the same architecture; mlx-lm's llama / qwen2 / qwen3 parameter names are the Hugging
Face ones. Generation is transformers' own `generate`, greedy, dynamic cache, with the attention
transformers picks by default (SDPA, `torch.nn.functional.scaled_dot_product_attention`, where
torch has it; the result rows name it): what a user gets without tuning. Like our engine and the
mlx-lm peers, it runs the whole timed run once untimed first.

    rates = tok_s(bundle, prompts, tokens=128, widths=(1, 32))     # {width: tokens per second}
"""

from __future__ import annotations

import time
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

HF_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings")


def available() -> bool:
    try:
        import torch
        import transformers  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def dense_weights(model: nn.Module) -> Dict[str, np.ndarray]:
    """Every parameter as float32 numpy, quantized layers unpacked to one dense `weight`."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits)
            out[f"{name}.weight"] = w
            if "bias" in module:
                out[f"{name}.bias"] = module.bias
    for name, value in tree_flatten(model.parameters()):
        prefix, leaf = name.rsplit(".", 1)
        if f"{prefix}.weight" in out and leaf in ("weight", "scales", "biases", "bias"):
            continue
        out[name] = value
    return {k: np.array(v.astype(mx.float32)) for k, v in out.items()}


def to_torch(bundle, dtype: str = "bfloat16", device: str = "cuda"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: bundle.config[k] for k in HF_KEYS if bundle.config.get(k) is not None}
    config = AutoConfig.for_model(**cfg)  # attention left to transformers' default (SDPA)
    torch_dtype = getattr(torch, dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(torch_dtype)
    state = {k: torch.from_numpy(v).to(torch_dtype) for k, v in dense_weights(bundle.model).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not line up: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def attention(model) -> str:
    """The attention implementation transformers chose (sdpa, eager, flash_attention_2, ...)."""
    return str(getattr(model.config, "_attn_implementation", "unknown"))


def torch_generate(model, prompts: List[List[int]], max_tokens: int, batch: int, eos: List[int], pad: int = 0):
    """Greedy `generate` over `prompts` in batches of `batch` (left padded). Returns tok/s and ids."""
    import torch

    def run(chunk):
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos or None, pad_token_id=pad, top_p=None, top_k=None, temperature=None)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows

    def run_all():
        texts = []
        for i in range(0, len(prompts), batch):
            texts += run(prompts[i : i + batch])
        return texts

    run_all()  # warm-up: the same whole run, untimed, as our engine and the mlx-lm peers get
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    texts = run_all()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(map(len, texts))
    return {"tok_s": n / dt, "tokens": n, "seconds": dt, "texts": texts}


def tok_s(bundle, prompts: List[List[int]], tokens: int, widths) -> Dict[int, float]:
    """transformers' greedy `generate` at each width (the first `width` prompts, one batch), tokens per
    second; a peer that fails costs its column, not the run."""
    import torch

    try:
        model = to_torch(bundle)
        eos = list(getattr(bundle.tokenizer, "eos_token_ids", None) or [])
        return {w: torch_generate(model, prompts[:w], tokens, w, eos)["tok_s"] for w in widths}
    except Exception as e:  # noqa: BLE001
        print(f"torch peer failed: {e!r}", flush=True)
        return {}
    finally:
        torch.cuda.empty_cache()
