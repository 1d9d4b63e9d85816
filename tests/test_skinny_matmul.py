"""mtplx/skinny_matmul.py's Python side (the CUDA kernel itself is checked on the GPU by
benchmarks/skinny_check): which inputs go to the kernel, which layers are swapped (plain bf16
Linear layers, stacked siblings and their views, the tied head; not quantized ones), that off
CUDA or switched off nothing changes, and that uninstall restores the model bit for bit.

Off CUDA, `install(model, matmul=...)` takes a stand-in for the kernel: here the kernel's contract
in MLX ops (each row its own fp32 product, rounded once), recording the row counts it was given."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtplx import skinny_matmul as sk
from mtplx.fusion import StackedPart, decode_paths, fuse_projections, unstack
from mtplx.models.loading import load


class Recorder:
    def __init__(self):
        self.rows = []

    def __call__(self, x, w, bias=None):
        k = w.shape[-1]
        self.rows.append(x.size // k)
        rows = x.reshape(-1, k).astype(mx.float32)
        y = mx.concatenate([rows[i:i + 1] @ w.astype(mx.float32).T for i in range(rows.shape[0])], axis=0)
        if bias is not None:
            y = y + bias.astype(mx.float32)
        return y.astype(w.dtype).reshape(*x.shape[:-1], w.shape[0])


@pytest.fixture
def qwen3(tiny_model):
    return load(tiny_model("qwen3", dtype="bfloat16")).model


def _classes(model):
    return [type(m) for _, m in model.named_modules()]


def _logits(model, tokens):
    return np.array(model(mx.array([tokens], dtype=mx.int32)).astype(mx.float32))


def test_fits_only_few_row_bf16_fp16_products_with_k_a_multiple_of_8():
    w = mx.zeros((24, 16), dtype=mx.bfloat16)
    assert sk.fits(mx.zeros((1, 16), dtype=mx.bfloat16), w)
    assert sk.fits(mx.zeros((1, 8, 16), dtype=mx.bfloat16), w)  # a depth-7 verify at width 1
    assert not sk.fits(mx.zeros((1, 9, 16), dtype=mx.bfloat16), w)  # more rows: MLX's matmul
    assert not sk.fits(mx.zeros((2, 16), dtype=mx.float32), w)  # another dtype than the weight
    assert not sk.fits(mx.zeros((2, 16), dtype=mx.float32), w.astype(mx.float32))  # fp32 weights
    assert not sk.fits(mx.zeros((2, 12), dtype=mx.bfloat16), mx.zeros((24, 12), dtype=mx.bfloat16))  # K % 8
    assert sk.fits(mx.zeros((2, 16), dtype=mx.float16), w.astype(mx.float16))


def test_off_cuda_install_swaps_nothing(qwen3):
    if sk.cuda_ready():
        pytest.skip("on CUDA the kernel installs (benchmarks/skinny_check checks it)")
    before = _classes(qwen3)
    assert sk.install(qwen3) == 0 and _classes(qwen3) == before
    assert decode_paths(qwen3, compiled=True, skinny=True)["skinny_matmul"] == 0
    unstack(qwen3)


def test_the_engine_leaves_it_off_unless_switched_on():
    from mtplx.generation import Engine

    assert Engine.use_skinny_matmul is False


def test_installed_layers_send_few_rows_to_the_kernel_and_uninstall_restores(qwen3):
    prompt = list(range(3, 15))  # 12 tokens: more rows than the kernel takes
    ref_prompt, ref_step = _logits(qwen3, prompt), _logits(qwen3, prompt[:4])
    rec = Recorder()
    n_linear = sum(type(m) is nn.Linear for _, m in qwen3.named_modules())
    assert sk.install(qwen3, matmul=rec) == n_linear + 1  # every projection and the (tied) embedding
    assert sk.install(qwen3, matmul=rec) == 0  # already swapped
    assert isinstance(qwen3.model.layers[0].mlp.down_proj, sk.SkinnyLinear)
    assert isinstance(qwen3.model.embed_tokens, sk.SkinnyEmbedding)
    assert np.array_equal(_logits(qwen3, prompt), ref_prompt) and rec.rows == []  # 12 rows: MLX's matmul
    step = _logits(qwen3, prompt[:4])  # 4 rows: a depth-3 verify at width 1
    assert set(rec.rows) == {4} and len(rec.rows) == n_linear + 1  # the tied head too
    np.testing.assert_allclose(step, ref_step, atol=0.05, rtol=0.05)  # close to MLX's, not equal
    assert sk.uninstall(qwen3) == n_linear + 1
    assert all(t in (nn.Linear, nn.Embedding) or not issubclass(t, (nn.Linear, nn.Embedding)) for t in _classes(qwen3))
    assert np.array_equal(_logits(qwen3, prompt[:4]), ref_step)


def test_rows_keep_their_value_whatever_the_row_count(qwen3):
    """The kernel's contract, through the model: a row's logits are the same computed alone or with
    three more rows (here with the stand-in, whose rows are independent by construction; the GPU
    check asserts the same of the kernel)."""
    from mlx_lm.models.cache import make_prompt_cache

    sk.install(qwen3, matmul=Recorder())
    try:
        prompt = mx.array([list(range(3, 19))], dtype=mx.int32)
        caches = [make_prompt_cache(qwen3), make_prompt_cache(qwen3)]
        for c in caches:
            mx.eval(qwen3(prompt, cache=c))
        four = qwen3(mx.array([[7, 8, 9, 10]], dtype=mx.int32), cache=caches[0])
        one = qwen3(mx.array([[7]], dtype=mx.int32), cache=caches[1])
        assert np.array_equal(np.array(four[:, 0].astype(mx.float32)), np.array(one[:, 0].astype(mx.float32)))
    finally:
        sk.uninstall(qwen3)


def test_stacked_siblings_and_their_views_are_swapped(qwen3):
    parts = fuse_projections(qwen3)
    rec = Recorder()
    try:
        n = sk.install(qwen3, matmul=rec)
        attn = qwen3.model.layers[0].self_attn
        st = attn.q_proj._stacked[0]
        assert isinstance(attn.q_proj, StackedPart) and isinstance(st.layer, sk.SkinnyLinear)
        assert all(isinstance(v, sk.SkinnyLinear) for v in st.views)
        layers = len(qwen3.model.layers)
        # per layer: 2 stacked layers + their 5 views + o_proj + down_proj; and the embedding
        assert parts == 5 * layers and n == 9 * layers + 1
        _logits(qwen3, [3, 4, 5])  # 3 rows: each sibling's view
        assert set(rec.rows) == {3}
        unstack(qwen3)  # the views come back as the layers: still swapped
        assert isinstance(qwen3.model.layers[0].mlp.up_proj, sk.SkinnyLinear)
    finally:
        sk.uninstall(qwen3)
    assert type(qwen3.model.layers[0].mlp.up_proj) is nn.Linear


def test_quantized_layers_keep_mlx_kernels(qwen3):
    nn.quantize(qwen3, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear) and "mlp" in p)
    rec = Recorder()
    try:
        n = sk.install(qwen3, matmul=rec)
        assert n == 4 * len(qwen3.model.layers) + 1  # q/k/v/o and the embedding; the mlp is quantized
        assert type(qwen3.model.layers[0].mlp.gate_proj) is nn.QuantizedLinear
    finally:
        sk.uninstall(qwen3)


def test_match_mlx_leaves_one_row_and_biased_products_to_mlx(monkeypatch):
    """MATCH_MLX: the kernel splits K as MLX's gemv does (chunk), so one-row products stay MLX's own
    (as fast there) and 2..8 rows take the kernel; a biased layer keeps MLX (its addmm is not the gemv)."""
    w = mx.zeros((24, 128), dtype=mx.bfloat16)
    one, four = mx.zeros((1, 1, 128), dtype=mx.bfloat16), mx.zeros((1, 4, 128), dtype=mx.bfloat16)
    assert sk.chunk(128) == 8 and sk.fits(one, w)
    monkeypatch.setattr(sk, "MATCH_MLX", True)
    assert [sk.chunk(k) for k in (4096, 896, 576, 1000)] == [4, 4, 2, 1]
    assert not sk.fits(one, w) and sk.fits(four, w) and not sk.fits(four, w, mx.zeros((24,), dtype=mx.bfloat16))
    assert sk.tile(4096, 4, npt=4)[1] == 2 * sk.tile(4096, 4)[1]  # as many bytes in flight with 8-byte chunks
    layer = nn.Linear(128, 24, bias=False)
    layer.set_dtype(mx.bfloat16)
    rec = Recorder()
    holder = nn.Sequential(layer)
    try:
        assert sk.install(holder, matmul=rec) == 1
        layer(one), layer(four)
        assert rec.rows == [4]
    finally:
        sk.uninstall(holder)
