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

