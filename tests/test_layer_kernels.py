"""mtplx/kernels/layer_kernels.py's plumbing (the kernels themselves run only on CUDA, where they are
compared with MLX's ops). Here the patched Qwen3 blocks, attentions and final norm run with the unfused
ops (counted) in the kernels' places: the logits are the model's bit for bit, eager and compiled, and the
engine (compiled bank, speculative verifies) gives mlx-lm's text. Also: a forward's KV write positions
are built once, not per layer."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mtplx.kernels import layer_kernels as lk
from mtplx.models.loading import load
from tiny_models import greedy_logits, same_logits as _same


def _logits(model, n=6):
    return greedy_logits(model, n)


@pytest.fixture
def counting(monkeypatch):
    """The kernel calls replaced by the unfused ops, counted (the path install takes on CUDA)."""
    calls = Counter()

    def add_norm(*a):
        calls["add_rms_norm"] += 1
        return lk.add_rms_norm_reference(*a)

    def qk(*a):
        calls["qk_norm_rope"] += 1
        return lk.qk_norm_rope_reference(*a)

    monkeypatch.setattr(lk, "cuda_ready", lambda: True)
    monkeypatch.setattr(lk, "add_rms_norm", add_norm)
    monkeypatch.setattr(lk, "qk_norm_rope", qk)
    return calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_plumbing_keeps_the_logits_and_uninstall_restores(tiny_model, monkeypatch, dtype):
    model = load(tiny_model("qwen3", dtype=dtype)).model
    ref = _logits(model)
    n = len(model.model.layers)
    assert lk.install(model) == 0  # not CUDA: nothing is patched
    monkeypatch.setattr(lk, "cuda_ready", lambda: True)
    monkeypatch.setattr(lk, "add_rms_norm", lk.add_rms_norm_reference)
    monkeypatch.setattr(lk, "qk_norm_rope", lk.qk_norm_rope_reference)
    assert lk.install(model) == n
    assert type(model.model.layers[0]).__name__ == "FusedTransformerBlock"
    assert _same(_logits(model), ref)
    assert lk.uninstall(model) == 2 * n + 1
    assert type(model.model.layers[0]).__name__ == "TransformerBlock"
    assert _same(_logits(model), ref)


def test_kernel_path_calls_each_kernel_once_per_place(tiny_model, counting):
    """Per forward: one q/k kernel a layer, and an add + norm kernel for every norm but the first
    (layer 0's input norm reads the embedding): 2 per layer. Same logits (the stand-ins are the ops)."""
    model = load(tiny_model("qwen3", dtype="bfloat16")).model
    ref = _logits(model, n=4)
    n = len(model.model.layers)
    assert lk.install(model) == n
    got = _logits(model, n=4)
    lk.uninstall(model)
    assert _same(got, ref)
    assert counting == {"qk_norm_rope": 4 * n, "add_rms_norm": 4 * 2 * n}


def test_compiled_forward_keeps_the_logits(tiny_model, counting):
    from mtplx.cache import BatchCache
    from mtplx.generation import _Runtime
    from mtplx.graphbank import CompiledVerifyBank

    model = load(tiny_model("qwen3", dtype="bfloat16")).model

    def run():
        cache = BatchCache.for_model(model, 2)
        model(mx.array([list(range(3, 20))] * 2, dtype=mx.int32), cache=cache.layers)
        cache.commit(np.array([17, 17]))
        bank = CompiledVerifyBank(_Runtime(model, want_hidden=False), max_verify_len=3, request_max_tokens=64)
        out = []
        for step in range(4):
            toks = mx.array([[5 + step, 7, 9], [11, 13 + step, 2]], dtype=mx.int32)
            logits, _, compiled, _ = bank.verify(toks, cache)
            assert compiled
            out.append(np.array(logits.astype(mx.float32)))
            cache.commit(np.array([1 + step % 3, 3]))
        return out

    ref = run()
    lk.install(model)
    got = run()
    lk.uninstall(model)
    assert counting["qk_norm_rope"] > 0 and _same(got, ref)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_engine_with_layer_kernels_is_token_identical(tiny_model, counting, method):
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.request import Request, SamplingParams

    from tiny_models import reference_tokens

    bundle = load(tiny_model("qwen3"))
    tok = bundle.tokenizer
    prompts = [tok.encode(p) for p in ("def add(a, b):\n    return", "the quick brown fox jumps over the lazy dog. the", "import os")]
    refs = [reference_tokens(bundle.model, p, 10, set(tok.eos_token_ids)) for p in prompts]
    eng = Engine(bundle, SpeculativeConfig(method=method, depth=2, adaptive_depth=False, compiled_verify="on"),
                 ScheduleConfig(max_batch=2))
    assert eng.decode_paths["layer_kernels"] == len(bundle.model.model.layers)
    out = {r.key: r.tokens for r in eng.generate([Request(i, list(p), SamplingParams(max_tokens=10)) for i, p in enumerate(prompts)])}
    lk.uninstall(bundle.model)
    assert [out[i] for i in range(len(prompts))] == refs
    assert counting["qk_norm_rope"] > 0


@pytest.mark.parametrize("family", ["qwen3_next", "llama"])
def test_models_it_does_not_claim_keep_their_code(tiny_model, monkeypatch, family):
    monkeypatch.setattr(lk, "cuda_ready", lambda: True)
    model = load(tiny_model(family)).model
    assert lk.install(model) == 0
    assert not any(type(m).__name__.startswith("Fused") for _, m in model.named_modules())


def test_norm_layout_is_mlx_rms_norm_dispatch():
    """rms_norm.cu's choice (threads, chunks, elements per read) for the widths that matter."""
    assert lk._norm_layout(4096, 2) == (128, 4, 8)  # 8B hidden, bf16
    assert lk._norm_layout(1024, 2) == (128, 1, 8)  # 0.6B hidden
    assert lk._norm_layout(576, 2) == (128, 1, 8)  # SmolLM2 hidden: 72 vectors, neither 64 nor 128 divides
    assert lk._norm_layout(128, 2) == (64, 1, 8)  # a head
    assert lk._norm_layout(12288, 2) == (1024, 2, 8)  # past 8192: the 1024-thread kernel
    assert lk._norm_layout(4096, 4) == (128, 8, 4)  # fp32


def test_write_positions_are_built_once_per_forward(tiny_model, monkeypatch):
    """The masked path's KV writes share one positions array per forward (not an arange + add per layer).
    (RoPE is stubbed out: on the CPU its fallback has aranges of its own.)"""
    from graphkit import graph_primitives
    from mtplx.cache import BatchCache, RowKVCache

    model = load(tiny_model("qwen3")).model
    cache = BatchCache.for_model(model, 2)
    model(mx.array([list(range(3, 20))] * 2, dtype=mx.int32), cache=cache.layers)
    cache.commit(np.array([17, 15]))
    cache.eval()
    assert cache.rows.shared is None  # rows of different lengths: the per-row write
    monkeypatch.setattr(mx.fast, "rope", lambda x, *a, **k: x)
    logits = model(mx.array([[4], [5]], dtype=mx.int32), cache=cache.layers)
    arrays = [logits] + [a for c in cache.leaves for a in c.state_arrays()]
    assert len(model.model.layers) >= 2
    # the mask's query and key positions (the write positions take a constant range: no Arange)
    assert graph_primitives(arrays)["Arange"] == 2
    pos = cache.rows.positions(1)
    assert pos is cache.rows.positions(1) and pos.shape == (2, 1, 1, 1)
    assert np.array(pos).ravel().tolist() == [17, 15]
    cache.commit(np.array([1, 1]))
    assert np.array(cache.rows.positions(1)).ravel().tolist() == [18, 16]
    assert isinstance(cache.leaves[0], RowKVCache)
