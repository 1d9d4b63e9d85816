"""RowKVCache's shared-length path: when every row has one length (always at width 1) an eager
forward does what mlx-lm's KVCache does (slice write, exact keys, no mask for one token), so its
logits are mlx-lm's bit for bit; rows of different lengths keep per-row writes under a mask."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.cache import BatchCache, RowKVCache
from mtplx.models.loading import load


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return load(tiny_model("qwen3", dtype="bfloat16")).model


def _steps(model, cache_layers, commit, prompt, n):
    out, tok = [], mx.array([prompt], dtype=mx.int32)
    for _ in range(n):
        logits = model(tok, cache=cache_layers)[:, -1]
        commit(tok.shape[1])
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
        tok = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
    return out


def test_one_row_forward_is_mlx_lm_kvcache_bit_for_bit(qwen3):
    from mlx_lm.models.cache import make_prompt_cache

    prompt = list(range(3, 40))
    ref = _steps(qwen3, make_prompt_cache(qwen3), lambda n: None, prompt, 12)
    cache = BatchCache.for_model(qwen3, 1)
    got = _steps(qwen3, cache.layers, lambda n: cache.commit(np.array([n])), prompt, 12)
    for step, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(a, b), f"step {step}: max diff {np.abs(a - b).max()}"


def test_shared_lengths_attend_exactly_and_unequal_lengths_mask():
    rows = BatchCache(["kv"], [5, 5]).rows
    layer = RowKVCache(rows)
    k = mx.ones((2, 2, 1, 4))
    assert layer.make_mask(1) is None and layer.offset == 5
    assert layer.make_mask(3).shape == (2, 1, 3, 256)  # several tokens: the bucket, masked (stable shapes)
    keys, _ = layer.update_and_fetch(k, k)
    assert keys.shape[2] == 6  # the 5 committed entries and the new one, not the capacity bucket
    rows.set([5, 3])
    assert layer.offset.tolist() == [5, 3]
    mask = layer.make_mask(1)
    assert mask.shape == (2, 1, 1, layer.keys.shape[2]) and mask[1, 0, 0].sum().item() == 4
    keys, _ = layer.update_and_fetch(k, k)
    assert keys.shape[2] == layer.keys.shape[2]
