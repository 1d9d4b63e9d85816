"""mtplx/o_norm_kernel.py's plumbing through layer_kernels (the kernel runs only on CUDA: o_norm_kernel.check
compares it with MLX's ops there). Here the kernel is a counting stand-in made of MLX's ops: it is called once
a layer at one-row forwards only, the logits stay the model's bit for bit (eager and compiled), and the engine
gives mlx-lm's text; without `o_norm` nothing changes."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mtplx import layer_kernels as lk
from mtplx import o_norm_kernel as ok
from mtplx.models.loading import load
from tiny_models import greedy_logits, same_logits as _same


def _logits(model, n=5):
    return greedy_logits(model, n)


@pytest.fixture
def counting(monkeypatch):
    calls = Counter()

    def kernel(a, wo, x, w, eps):
        calls[a.size // a.shape[-1]] += 1
        return ok.reference(a, wo, x, w, eps)

    monkeypatch.setattr(lk, "cuda_ready", lambda: True)
    monkeypatch.setattr(ok, "cuda_ready", lambda: True)
    monkeypatch.setattr(lk, "add_rms_norm", lk.add_rms_norm_reference)
    monkeypatch.setattr(lk, "qk_norm_rope", lk.qk_norm_rope_reference)
    monkeypatch.setattr(ok, "o_add_norm", kernel)
    return calls


def test_one_row_steps_take_the_kernel_and_logits_stay(tiny_model, counting):
    model = load(tiny_model("qwen3", dtype="bfloat16")).model
    ref = _logits(model)
    n = len(model.model.layers)
    lk.install(model)
    assert _same(_logits(model), ref) and not counting  # without o_norm: never called
    lk.install(model, o_norm=True)
    got = _logits(model)
    lk.uninstall(model)
    assert _same(got, ref)
    assert dict(counting) == {1: (5 - 1) * n}  # the 27-token prompt: o_proj + add + norm as before


def test_with_mlp_kernel_down_proj_goes_with_the_next_norm(tiny_model, counting, monkeypatch):
    """mlp_kernel's MLP hands its down_proj to the next block's input norm (the last layer's to the final
    norm): two kernels a layer at one row, the logits the model's."""
    from mtplx import mlp_kernel
    from mtplx.fusion import NAMED, fuse_projections, unstack

    model = load(tiny_model("qwen3", dtype="bfloat16")).model
    ref = _logits(model)
    n = len(model.model.layers)
    monkeypatch.setattr(mlp_kernel, "cuda_ready", lambda: True)
    monkeypatch.setattr(mlp_kernel, "swiglu_gemv", mlp_kernel.reference)
    fuse_projections(model, [NAMED["mlp"]])
    assert mlp_kernel.install(model) == n
    lk.install(model, o_norm=True)
    got = _logits(model)
    lk.uninstall(model)
    mlp_kernel.uninstall(model)
    unstack(model)
    assert _same(got, ref)
    assert dict(counting) == {1: (5 - 1) * 2 * n}


def test_without_the_mlp_kernel_its_mlx_ops_hand_down_proj_over(tiny_model, counting):
    """o_norm alone: mlp_kernel's MLP in reference mode (MLX's ops, as fusion.decode_paths installs it) still
    gives o_norm the down_proj input: two fused calls a layer, the logits the model's."""
    from mtplx import mlp_kernel
    from mtplx.fusion import NAMED, fuse_projections, unstack

    model = load(tiny_model("qwen3", dtype="bfloat16")).model
    ref = _logits(model)
    n = len(model.model.layers)
    fuse_projections(model, [NAMED["mlp"]])
    assert mlp_kernel.install(model, reference=True) == n
    lk.install(model, o_norm=True)
    got = _logits(model)
    lk.uninstall(model)
    mlp_kernel.uninstall(model)
    unstack(model)
    assert _same(got, ref) and dict(counting) == {1: (5 - 1) * 2 * n}


def test_usable_refuses_what_the_kernel_does_not_do(monkeypatch):
    import mlx.nn as nn

    monkeypatch.setattr(ok, "cuda_ready", lambda: True)
    o = nn.Linear(128, 4096, bias=False)
    o.update({"weight": o.weight.astype(mx.bfloat16)})
    norm = nn.RMSNorm(4096)
    norm.update({"weight": norm.weight.astype(mx.bfloat16)})
    a, x = mx.zeros((1, 1, 128), mx.bfloat16), mx.zeros((1, 1, 4096), mx.bfloat16)
    assert ok.usable(a, o, x, norm)
    assert not ok.usable(mx.zeros((1, 2, 128), mx.bfloat16), o, mx.zeros((1, 2, 4096), mx.bfloat16), norm)  # 2 rows
    assert not ok.usable(a.astype(mx.float32), o, x, norm)
    biased = nn.Linear(128, 4096)
    assert not ok.usable(a, biased, x, norm)
    monkeypatch.setattr(ok, "cuda_ready", lambda: False)
    assert not ok.usable(a, o, x, norm)


def test_compiled_bank_and_engine(tiny_model, counting, monkeypatch):
    from mtplx import fusion
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.request import Request, SamplingParams

    from tiny_models import reference_tokens

    bundle = load(tiny_model("qwen3", dtype="bfloat16"))
    tok = bundle.tokenizer
    prompt = tok.encode("def add(a, b):\n    return")
    ref = reference_tokens(bundle.model, prompt, 10, set(tok.eos_token_ids))
    monkeypatch.setattr(fusion, "stacking_pays", lambda: True)
    monkeypatch.setattr(Engine, "use_o_norm_kernel", True)
    eng = Engine(bundle, SpeculativeConfig(method="none", compiled_verify="on"), ScheduleConfig(max_batch=1))
    assert eng.decode_paths["o_norm_kernel"] == 1 and eng.decode_paths["layer_kernels"] == len(bundle.model.model.layers)
    (res,) = list(eng.generate([Request(0, list(prompt), SamplingParams(max_tokens=10))]))
    lk.uninstall(bundle.model)
    fusion.unstack(bundle.model)
    assert list(res.tokens) == ref and counting[1] > 0
