"""mtplx/mlp_kernel.py's plumbing (the kernel itself runs only on CUDA: mlp_kernel.check compares it with
MLX's ops there, benchmarks/step_overhead runs that). Here the patched MLPs take a counting stand-in for the
kernel: which MLPs are patched (stacked gate/up only), that one-row inputs take it and wider ones do not, the
logits bit for bit eager and through the compiled bank, and the engine's text."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mtplx import mlp_kernel as mk
from mtplx.fusion import NAMED, fuse_projections, unstack
from mtplx.models.loading import load
from tiny_models import greedy_logits, same_logits as _same


def _logits(model, n=5):
    return greedy_logits(model, n)


@pytest.fixture
def counting(monkeypatch):
    """The kernel replaced by MLX's ops (mk.reference), its calls and their row counts recorded."""
    calls = Counter()

    def kernel(x, w):
        calls[x.size // x.shape[-1]] += 1
        return mk.reference(x, w)

    monkeypatch.setattr(mk, "cuda_ready", lambda: True)
    monkeypatch.setattr(mk, "swiglu_gemv", kernel)
    return calls


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_only_stacked_mlps_are_patched_and_logits_stay(tiny_model, counting, family):
    model = load(tiny_model(family, dtype="bfloat16")).model
    ref = _logits(model)
    n = len(model.model.layers)
    assert mk.install(model, modules=mk.MODULES) == 0  # gate/up not stacked: nothing to read the stacked weight from
    fuse_projections(model, [NAMED["mlp"]])
    assert mk.install(model) == (n if family == "qwen3" else 0)  # by default where measured: Qwen3
    assert mk.install(model, modules=mk.MODULES) == n
    assert type(model.model.layers[0].mlp).__name__ == "FusedMLP"
    got = _logits(model)
    assert _same(got, ref)
    # the 27-token prompt's forward is wider than one row: mlx-lm's code; each later one-token step: the kernel
    assert dict(counting) == {1: (5 - 1) * n}
    assert mk.uninstall(model) == n and type(model.model.layers[0].mlp).__name__ == "MLP"
    unstack(model)


def test_off_cuda_nothing_is_patched(tiny_model):
    model = load(tiny_model("qwen3", dtype="bfloat16")).model
    fuse_projections(model, [NAMED["mlp"]])
    assert mk.install(model) == 0
    assert mk.install(model, reference=True) == len(model.model.layers)
    assert _same(_logits(model, 3), (mk.uninstall(model), _logits(model, 3))[1])


def test_float32_and_quantized_keep_mlx_lm_code(tiny_model, counting):
    model = load(tiny_model("qwen3", dtype="float32")).model
    fuse_projections(model, [NAMED["mlp"]])
    assert mk.install(model) == 0  # the kernel is bf16 / fp16 only
    qmodel = load(tiny_model("qwen3", dtype="bfloat16")).model
    import mlx.nn as nn

    nn.quantize(qmodel, group_size=32, bits=4)
    fuse_projections(qmodel, [NAMED["mlp"]])
    assert mk.install(qmodel) == 0


def test_compiled_bank_keeps_the_logits(tiny_model, counting):
    from mtplx.cache import BatchCache
    from mtplx.generation import _Runtime
    from mtplx.graphbank import CompiledVerifyBank

    model = load(tiny_model("qwen3", dtype="bfloat16")).model
    fuse_projections(model, [NAMED["mlp"]])

    def run(width):
        cache = BatchCache.for_model(model, width)
        model(mx.array([list(range(3, 20))] * width, dtype=mx.int32), cache=cache.layers)
        cache.commit(np.array([17] * width))
        bank = CompiledVerifyBank(_Runtime(model, want_hidden=False), max_verify_len=3, request_max_tokens=64)
        out = []
        for step in range(4):
            L = 1 if step % 2 == 0 else 3  # plain steps and verifies of 3 tokens
            toks = mx.array([[5 + step, 7, 9][:L]] * width, dtype=mx.int32)
            logits, _, compiled, _ = bank.verify(toks, cache)
            assert compiled
            out.append(np.array(logits.astype(mx.float32)))
            cache.commit(np.array([L] * width))
        return out

    ref1, ref2 = run(1), run(2)
    mk.install(model)
    got1, got2 = run(1), run(2)
    mk.uninstall(model)
    assert _same(got1, ref1) and _same(got2, ref2)
    assert set(counting) == {1}  # only the one-row, one-token steps (traced once a program)


def test_engine_with_the_mlp_kernel_is_token_identical(tiny_model, counting, monkeypatch):
    from mtplx import fusion
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.request import Request, SamplingParams

    from tiny_models import reference_tokens

    bundle = load(tiny_model("qwen3", dtype="bfloat16"))
    tok = bundle.tokenizer
    prompt = tok.encode("def add(a, b):\n    return")
    ref = reference_tokens(bundle.model, prompt, 10, set(tok.eos_token_ids))
    monkeypatch.setattr(fusion, "stacking_pays", lambda: True)  # the CUDA path: stacked gate/up
    monkeypatch.setattr(Engine, "use_mlp_kernel", True)
    monkeypatch.setattr(Engine, "use_layer_kernels", False)
    eng = Engine(bundle, SpeculativeConfig(method="none", compiled_verify="on"), ScheduleConfig(max_batch=1))
    assert eng.decode_paths["mlp_kernel"] == len(bundle.model.model.layers)
    (res,) = list(eng.generate([Request(0, list(prompt), SamplingParams(max_tokens=10))]))
    mk.uninstall(bundle.model)
    unstack(bundle.model)
    assert list(res.tokens) == ref and counting[1] > 0


def test_reference_is_mlx_lm_mlp():
    """mk.reference over a stacked weight is mlx-lm's MLP arithmetic (separate products, swiglu)."""
    from mlx_lm.models.activations import swiglu

    x = mx.random.normal((1, 1, 64)).astype(mx.bfloat16)
    g, u = (0.1 * mx.random.normal((96, 64))).astype(mx.bfloat16), (0.1 * mx.random.normal((96, 64))).astype(mx.bfloat16)
    want = swiglu(x @ g.T, x @ u.T)
    assert mx.array_equal(mk.reference(x, mx.concatenate([g, u])), want).item()
