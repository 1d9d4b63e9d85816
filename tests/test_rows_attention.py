"""mtplx/rows_attention.py's host side (the kernel itself runs only on CUDA: benchmarks/attn_check
checks its bits there): how a launch splits a KV head's queries into blocks, and that the chunk
sizes it may pick fit a block's static shared memory."""

from __future__ import annotations

import re

import pytest

from mtplx import rows_attention as ra


@pytest.mark.parametrize("D", ra.HEAD_DIMS)
@pytest.mark.parametrize("B, Hk", [(1, 1), (1, 3), (8, 3), (32, 3), (32, 8), (128, 8), (3, 2)])
@pytest.mark.parametrize("queries", [1, 2, 3, 4, 8, 12, 24, 32, 64])
def test_split_covers_every_query_once_within_the_chunk_limit(B, Hk, queries, D):
    per, blocks = ra.split(B, Hk, queries, D)
    assert 1 <= per <= ra.CHUNK_MOST[D]
    assert (blocks - 1) * per < queries <= blocks * per  # every query in one block, no empty block
    if B * Hk * queries <= ra.SPREAD_BLOCKS:  # a block per query fills the GPU in ~two waves: no chunks
        assert per == 1
    else:
        assert per == min(ra.CHUNK[D], queries)


def test_split_shapes_of_the_measured_cases():
    """The fastest chunk of each cell where the H200's table (session 6, window 2) is clear."""
    # SmolLM2-135M (9 heads over 3, D 64): a width-32 depth-3 verify, 12 queries a KV head in 6 blocks
    # of 2 (53.1 us; a block per query 58.8); its plain step and one stream: a block per query
    assert ra.split(32, 3, 3 * 4, 64) == (2, 6)
    assert ra.split(32, 3, 3, 64) == (1, 3)
    assert ra.split(1, 3, 3 * 4, 64) == (1, 12)
    assert ra.split(1, 3, 3, 64) == (1, 3)
    # Qwen3-8B (32 over 8, D 128): a width-32 verify, 16 queries a KV head in 4 blocks of 4 (170 us; 265)
    assert ra.split(32, 8, 4 * 4, 128) == (4, 4)
    assert ra.split(32, 8, 4, 128) == (4, 1)


def test_chunks_stay_within_the_register_limit():
    assert all(ra.CHUNK[D] <= ra.CHUNK_MOST[D] for D in ra.HEAD_DIMS)


def test_the_largest_chunks_fit_static_shared_memory():
    """The kernel's __shared__ arrays at each head dim's CHUNK_MOST stay under a block's 48 KB."""
    sizes = {"QB": None, "D": None, "BN": 32, "BD": 32}
    decls = re.findall(r"__shared__ (U|int) \w+((?:\[[^\]]+\])+);", ra._SOURCE)
    assert len(decls) == 5, decls
    for D in ra.HEAD_DIMS:
        sizes.update(QB=ra.CHUNK_MOST[D], D=D)
        total = 0
        for _, dims in decls:
            n = 1
            for dim in re.findall(r"\[([^\]]+)\]", dims):
                n *= eval(dim, {}, sizes)
            total += 4 * n
        assert total <= 48 * 1024, (D, total)


@pytest.mark.parametrize("boolean", [True, False])
def test_unfused_attention_is_mlx_attention(boolean):
    """`unfused` (FUSED_PREFILL off) against MLX's own attention: grouped query heads (9 over 3, as
    SmolLM2), rows of different lengths under a [B, 1, L, S] mask (boolean, or added), a capacity
    longer than any row."""
    import mlx.core as mx

    B, Hq, Hk, L, S, D = 3, 9, 3, 12, 32, 64
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) for i, s in
               enumerate([(B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, D)]))
    lengths = mx.array([12, 20, 5])  # keys a row holds before its L queries
    mask = mx.arange(S)[None, None, :] <= (lengths[:, None] + mx.arange(L)[None])[:, :, None]  # [B, L, S]
    mask = mask[:, None]
    if not boolean:
        mask = mx.where(mask, 0.0, -1e9)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
    got = ra.unfused(q, k, v, D ** -0.5, mask)
    assert got.shape == want.shape and mx.allclose(got, want, atol=1e-5).item()


def test_prefill_attention_goes_unfused_only_where_fused_prefill_is_off(monkeypatch):
    """A prefill's attention (more queries than rows_attention takes, an array mask) is MLX's own
    (cuDNN's on CUDA) unless FUSED_PREFILL is off; short queries and string masks always are."""
    import mlx.core as mx

    calls = []
    monkeypatch.setattr(ra, "_original", lambda q, k, v, cache, scale, mask, sinks=None: calls.append("mlx") or q)
    monkeypatch.setattr(ra, "unfused", lambda q, k, v, scale, mask: calls.append("unfused") or q)
    q, k = mx.zeros((1, 3, ra.MAX_QUERIES + 1, 64)), mx.zeros((1, 3, 32, 64))
    mask = mx.ones((1, 1, q.shape[2], 32), dtype=mx.bool_)
    ra.attention(q, k, k, None, 0.125, mask)
    monkeypatch.setattr(ra, "FUSED_PREFILL", False)
    ra.attention(q, k, k, None, 0.125, mask)
    ra.attention(q, k, k, None, 0.125, "causal")
    ra.attention(q[:, :, :2], k, k, None, 0.125, mask[:, :, :2])
    assert calls == ["mlx", "unfused", "mlx", "mlx"]
