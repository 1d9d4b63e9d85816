"""mtplx/fusion.py: stacked q/k/v and gate/up give the model's own logits bit for bit (one-row
steps take the stacked product, a prompt takes each original layer), and undo restores the model.
mtplx/gemv.py and mtplx/rows_attention.py are CUDA-only: elsewhere nothing is swapped."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtplx import gemv
from mtplx.fusion import StackedPart, fuse_projections
from mtplx.models.loading import load


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return load(tiny_model("qwen3", dtype="bfloat16")).model


def _logits(model, n=8):
    from mlx_lm.models.cache import make_prompt_cache

    cache, out, tok = make_prompt_cache(model), [], mx.array([list(range(3, 30))], dtype=mx.int32)
    for _ in range(n):
        logits = model(tok, cache=cache)[:, -1]
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
        tok = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
    return out


def test_fused_projections_keep_the_logits_and_undo_restores(qwen3):
    from mlx.utils import tree_flatten

    nbytes = lambda: sum(v.nbytes for _, v in tree_flatten(qwen3.parameters()))
    ref, before = _logits(qwen3), nbytes()
    undo = fuse_projections(qwen3)
    assert nbytes() == before  # the stacked weights replace the originals
    layer = qwen3.model.layers[0]
    assert undo.count == 5 * len(qwen3.model.layers)
    assert isinstance(layer.self_attn.k_proj, StackedPart) and isinstance(layer.mlp.up_proj, StackedPart)
    fused = _logits(qwen3)
    undo()
    assert type(layer.self_attn.k_proj) is nn.Linear
    for a, b in zip(fused, ref):
        assert np.array_equal(a, b)


def test_gemv_is_plain_matmul_off_cuda(qwen3):
    if gemv.cuda_ready():
        pytest.skip("on CUDA the kernel runs (benchmarks/decode_anatomy checks it bit for bit)")
    w = qwen3.model.layers[0].mlp.gate_proj.weight
    x = mx.ones((1, 1, w.shape[1]), w.dtype)
    assert not gemv.usable(x, w) and gemv.install_gemv(qwen3) == 0
    assert mx.array_equal(gemv.matvec(x, w), x @ w.T).item()


def test_rows_attention_is_mlx_lm_attention_off_cuda(qwen3):
    from mtplx import rows_attention

    if gemv.cuda_ready():
        pytest.skip("on CUDA the kernel runs (benchmarks/decode_anatomy compares it with MLX's)")
    assert rows_attention.install(qwen3) == 0
    q = mx.ones((1, 2, 1, 64))
    assert not rows_attention.usable(q, q, q)
