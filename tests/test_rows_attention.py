"""mtplx/kernels/rows_attention.py's host side (the kernel itself runs only on CUDA, where its bits are
checked): how a launch splits a KV head's queries into blocks, that the chunk sizes it may pick fit a
block's static shared memory, and the layouts around the strided kernel through an engine."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from mtplx.kernels import fusion
from mtplx.kernels import rows_attention as ra


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
    """The fastest chunk of each cell where the H200's table is clear."""
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



# -- the strided kernel's host side: layouts, run through an engine with an MLX stand-in for the kernel --------
def test_the_strided_source_rewrites_every_index_once():
    """Each of the row-contiguous kernel's indexings of q, k, v and out is replaced in the strided source."""
    assert ra._STRIDED_SOURCE != ra._SOURCE
    for old, new in ra._REPLACE:
        assert ra._SOURCE.count(old) == 1 and old not in ra._STRIDED_SOURCE and new in ra._STRIDED_SOURCE
    for name in ("q", "k", "v"):
        assert f"{name}_strides[" in ra._STRIDED_SOURCE and f"{name}_strides[" not in ra._SOURCE


class _StandIn:
    """The kernel's contract in MLX ops (the CPU has no CUDA kernel): query i of row b attends to keys
    0..lengths[b] + i; the result in the layout the call asks for ([B, H, L, D], or [B, L, H, D] for the
    strided kernel). Records (strided, L) for each call."""

    def __init__(self, calls, strided):
        self.calls, self.strided = calls, strided

    def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        q, k, v, lengths, scale = inputs
        B, Hq, L, D = q.shape
        Hk, cap = k.shape[1], k.shape[2]
        k, v = (mx.repeat(a, Hq // Hk, axis=1) for a in (k, v))
        scores = (q.astype(mx.float32) @ k.astype(mx.float32).swapaxes(-1, -2)) * scale[0]
        limit = lengths[:, None, None, None] + mx.arange(L)[None, None, :, None]
        scores = mx.where(mx.arange(cap)[None, None, None, :] <= limit, scores, -mx.inf)
        out = (mx.softmax(scores, axis=-1) @ v.astype(mx.float32)).astype(output_dtypes[0])
        if self.strided:
            assert tuple(output_shapes[0]) == (B, L, Hq, D)
            out = out.transpose(0, 2, 1, 3)
        else:
            assert tuple(output_shapes[0]) == (B, Hq, L, D)
        self.calls.append((self.strided, L))
        return [mx.contiguous(out)]


@pytest.fixture
def stand_in(monkeypatch):
    calls = []
    monkeypatch.setattr(ra, "_KERNELS", {strided: _StandIn(calls, strided) for strided in (False, True)})
    monkeypatch.setattr(ra, "usable", lambda q, k, v: q.shape[2] <= ra.MAX_QUERIES)
    monkeypatch.setattr(ra, "cuda_ready", lambda: True)
    monkeypatch.setattr(fusion, "stacking_pays", lambda: True)  # the engine's paths as on CUDA
    yield calls
    ra.uninstall()


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_the_strided_layout_decodes_as_plain_through_the_engine(tiny_model, stand_in, tmp_path, width):
    """Greedy MTP text through rows_attention's path equals plain decoding; a verify of several queries
    takes the strided kernel, a one-query step the row-contiguous one (the kernel replaced by its contract
    in MLX ops: the layouts and views around it are what this checks)."""
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.models.loading import load
    from mtplx.request import Request, SamplingParams
    from tiny_models import reference_tokens, untrained_head

    bundle = load(tiny_model("llama"))
    head = untrained_head(bundle, tmp_path / "head")
    rng = np.random.default_rng(5)
    rows = [(rng.integers(3, 400, int(n)).tolist(), int(m)) for n, m in zip([5, 19, 8, 33], [9, 6, 11, 7])]
    eos = set(bundle.tokenizer.eos_token_ids)
    refs = [reference_tokens(bundle.model, p, m, eos) for p, m in rows]
    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, compiled_verify="on", mtp_head=str(head))
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    assert eng.decode_paths["rows_attention"] > 0
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    assert [list(r.tokens) for r in sorted(eng.generate(reqs), key=lambda r: r.key)] == refs
    assert {s for s, L in stand_in if L > 1} == {True} and {s for s, L in stand_in if L == 1} <= {False}, stand_in
