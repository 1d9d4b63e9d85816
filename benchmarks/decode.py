"""Plain decoding on random-weight Qwen3 shapes: one stream against mlx-lm's `generate_step`, many
streams against its `batch_generate`, and both against the batch-1 roofline of the device present.

Random weights say nothing about acceptance, so this part measures the machinery alone: 128-token
prompts, `--tokens` new tokens each, greedy, no EOS. Tokens per second cover the whole call (the
short prompt's prefill included) on both sides; each side runs its own model object over the
same weights, `--repeats` times interleaved after one untimed run, and `x mlx-lm` is the median of the
per-repeat ratios. The roofline is the device's memory bandwidth (H100 3.35 TB/s, H200 4.8 TB/s;
anything else: unknown) over the model's weight bytes. With PyTorch and transformers on a CUDA
host, transformers' `generate` on the same weights is a third column (benchmarks/torch_peer.py).

    python -m benchmarks.run --suite gpu --parts decode      # shapes 0.6b,8b in bfloat16
    python -m benchmarks.run --suite cpu --parts decode      # the tiny shape in float32
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mtplx.config import SpeculativeConfig
from mtplx.models.loading import ModelBundle

from . import torch_peer
from .common import (BatchGenerate, Ours, Report, bandwidth, generate_step, interleaved, median, median_ratio,
                     on_gpu, spread)

SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, vocab_size=151936),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, vocab_size=151936),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, vocab_size=8192),
}
PROMPT_TOKENS = 128


class IdTokenizer:
    """Random-weight models have no tokenizer: ids in, ids out, no EOS."""

    eos_token_ids = []
    eos_token_id = None

    def decode(self, ids):
        return ""

    def encode(self, text):
        return [1]


def random_qwen3(shape: str) -> ModelBundle:
    """A Qwen3 model of `shape` with seeded random weights: bfloat16 on a GPU, float32 on a CPU (where
    MLX's matmuls in bfloat16 do not use BLAS)."""
    from mlx_lm.models import qwen3

    dtype = mx.bfloat16 if on_gpu() else mx.float32
    cfg = dict(model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, **SHAPES[shape])
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(**cfg))
    # default inits give huge activations through 28+ layers: scale to a sane range
    model.update(tree_map(lambda p: (p * 0.02).astype(dtype) if p.ndim > 1 else p.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return ModelBundle(model=model, tokenizer=IdTokenizer(), config=cfg, path=Path(f"random-qwen3-{shape}"))


def twin(bundle: ModelBundle):
    """A second model object over the same weight arrays: an engine installs its decode paths into
    the model it runs, and the peers run the model as built."""
    from mlx_lm.models import qwen3

    model = qwen3.Model(qwen3.ModelArgs(**bundle.config))
    model.update(bundle.model.parameters())  # before anything evaluates the new model's own random init
    return model


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def random_prompts(count: int, vocab: int) -> list:
    rng = np.random.default_rng(1)
    return [rng.integers(0, min(vocab, 1000), PROMPT_TOKENS).tolist() for _ in range(count)]


def run(opts, report: Report):
    bw = bandwidth()
    report.note(f"roofline: {f'{bw / 1e12:.2f} TB/s' if bw else 'unknown for this device'}")
    for shape in opts.shapes.split(","):
        bundle = random_qwen3(shape)
        peer_model = twin(bundle)
        roof = bw / weight_bytes(peer_model) if bw else None
        prompts = random_prompts(opts.streams, bundle.config["vocab_size"])
        widths = (1, opts.streams)
        torch = torch_peer.tok_s(bundle, prompts, opts.tokens, widths) if torch_peer.available() else {}
        for streams in widths:
            rows = prompts[:streams]
            peer = "generate_step" if streams == 1 else "batch_generate"
            done = interleaved({f"mlx-lm {peer}": generate_step(peer_model, rows, opts.tokens, []) if streams == 1
                                else BatchGenerate(peer_model, bundle.tokenizer, rows, opts.tokens, streams),
                                "ours": Ours(bundle, SpeculativeConfig(method="none"), streams, rows, opts.tokens)},
                               opts.repeats, report.say)
            theirs, ours = done[f"mlx-lm {peer}"], done["ours"]
            cells = {"shape": shape, "streams": streams, "mlx-lm": peer,
                     "mlx-lm tok/s": median([r["tok/s"] for r in theirs]), "ours tok/s": median([r["tok/s"] for r in ours]),
                     "spread": spread([r["tok/s"] for r in ours]), "x mlx-lm": median_ratio(ours, theirs)}
            if streams in torch:
                cells.update({"torch tok/s": torch[streams], "x torch": cells["ours tok/s"] / torch[streams]})
            if streams == 1:
                cells.update({"roofline tok/s": roof or "unknown",
                              "ours % roofline": 100 * cells["ours tok/s"] / roof if roof else "unknown",
                              "mlx-lm % roofline": 100 * cells["mlx-lm tok/s"] / roof if roof else "unknown"})
            report.row("plain decoding", **cells)
        del bundle, peer_model
        mx.clear_cache()
