"""Arrays of <= 8 bytes that the CUDA kernels read each step are kept out of MLX's managed small-array pool
(kernels.device.SMALL_POOL_BYTES): the kernels' constants are padded, and the device lengths of one row are
read through a view of a padded copy made once per forward. On the CPU nothing is padded (no such pool); here
the CUDA behaviour is forced (`pads`) and the values, the logits and the engine's tokens must not move."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtplx.kernels import device
from mtplx.kernels import layer_kernels as lk
from mtplx.row_lengths import RowLengths
from mtplx.models.loading import load


def test_constants_are_padded_past_the_pool_only_on_cuda(monkeypatch):
    assert device.resident_constant([0.5]).nbytes == 4  # the CPU: as it is
    monkeypatch.setattr(device, "pads", lambda: True)
    c = device.resident_constant([0.5])
    assert c.nbytes > device.SMALL_POOL_BYTES and c[0].item() == 0.5 and c[1:].sum().item() == 0
    i = device.resident_constant([7], mx.int32)
    assert i.nbytes > device.SMALL_POOL_BYTES and i[0].item() == 7
    assert device.resident_constant([1.0, 2.0, 3.0]).size == 3  # 12 bytes: out of the pool already
    assert lk._const(1e-6).nbytes > device.SMALL_POOL_BYTES  # what the add + norm kernel reads as eps


def test_one_row_lengths_are_read_through_a_padded_copy(monkeypatch):
    rows = RowLengths([37])
    assert rows.resident() is rows.device  # the CPU: no copy
    monkeypatch.setattr(device, "pads", lambda: True)
    rows = RowLengths([37])
    view = rows.resident()
    assert view is not rows.device and view.shape == (1,) and view.item() == 37
    assert rows.resident() is view  # once per forward (per device lengths)
    pos = rows.positions(3)
    assert pos.shape == (1, 1, 3, 1) and np.array(pos).ravel().tolist() == [37, 38, 39]
    rows.advance(mx.array([2], dtype=mx.int32), np.array([2]))
    assert rows.resident().item() == 39 and np.array(rows.positions(1)).ravel().tolist() == [39]
    wide = RowLengths([5, 6, 7])  # 12 bytes: read as they are
    assert wide.resident() is wide.device


def test_logits_and_engine_tokens_do_not_move(tiny_model, monkeypatch):
    from tiny_models import reference_tokens

    from mtplx.cache import BatchCache
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine, _Runtime
    from mtplx.graphbank import CompiledVerifyBank
    from mtplx.request import Request, SamplingParams

    bundle = load(tiny_model("qwen3", dtype="bfloat16"))
    model = bundle.model

    def bank_logits():
        cache = BatchCache.for_model(model, 1)
        model(mx.array([list(range(3, 20))], dtype=mx.int32), cache=cache.layers)
        cache.commit(np.array([17]))
        bank = CompiledVerifyBank(_Runtime(model, want_hidden=False), max_verify_len=3, request_max_tokens=64)
        out = []
        for step in range(4):
            L = 1 + 2 * (step % 2)
            logits, _, compiled, _ = bank.verify(mx.array([[5 + step, 7, 9][:L]], dtype=mx.int32), cache)
            assert compiled
            out.append(np.array(logits.astype(mx.float32)))
            cache.commit(np.array([L]))
        return out

    ref = bank_logits()
    tok = bundle.tokenizer
    prompt = tok.encode("def add(a, b):\n    return")
    want = reference_tokens(model, prompt, 10, set(tok.eos_token_ids))
    monkeypatch.setattr(device, "pads", lambda: True)
    got = bank_logits()
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    eng = Engine(bundle, SpeculativeConfig(method="ngram", depth=2, adaptive_depth=False, compiled_verify="on"),
                 ScheduleConfig(max_batch=1))
    (res,) = list(eng.generate([Request(0, list(prompt), SamplingParams(max_tokens=10))]))
    assert list(res.tokens) == want
