"""mtplx/small_ops.py: a round's small index arrays as fewer kernels (constant ranges, a few columns joined
by one fused select) give the ops' values, the engine's text is plain decoding's at widths 1-4 (MTP, and
the draft model's chain), and a round hands the device fewer ranges and concatenations than with the plain
MLX ops (CPU counts of the primitives each round evaluates)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx import small_ops
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens, untrained_head


def test_the_constant_ops_give_the_ops_values():
    a = mx.array([3, 1, 4], dtype=mx.int32)
    b = mx.array([7, 0, 2], dtype=mx.uint32)
    rest = mx.array([[5, 6], [8, 9], [1, 2]], dtype=mx.int32)
    r = small_ops.arange(5)
    assert r.dtype == mx.int32 and r.tolist() == list(range(5))
    assert small_ops.arange(5) is r  # made once
    assert small_ops.arange(1).tolist() == [0] and small_ops.arange(2).tolist() == [0, 1]
    got = small_ops.joined([a, b], rest)
    ref = mx.concatenate([a[:, None], b[:, None], rest], axis=1)
    assert got.dtype == ref.dtype and got.tolist() == ref.tolist()
    s = small_ops.columns([a, a + 1, a + 2])
    assert s.dtype == mx.int32 and s.tolist() == mx.stack([a, a + 1, a + 2], axis=1).tolist()


def _as_plain_ops(monkeypatch):
    """small_ops' functions as the MLX ops they stand for: the peer of the kernel counts."""
    monkeypatch.setattr(small_ops, "arange", lambda n: mx.arange(n, dtype=mx.int32))
    monkeypatch.setattr(small_ops, "columns", lambda cols: mx.stack(cols, axis=1))
    monkeypatch.setattr(small_ops, "joined", lambda first, rest: mx.concatenate([c[:, None] for c in first] + [rest], axis=1))


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = tiny_model("llama")
    bundle = load(path)
    head = untrained_head(bundle, tmp_path_factory.mktemp("head"))
    rng = np.random.default_rng(9)
    rows = [(rng.integers(3, 400, int(n)).tolist(), int(m)) for n, m in zip([4, 15, 7, 36, 10], [9, 5, 12, 7, 6])]
    eos = set(bundle.tokenizer.eos_token_ids)
    return bundle, str(head), str(path), rows, [reference_tokens(bundle.model, p, m, eos) for p, m in rows]


def _run(setup, method, width, count=False):
    from graphkit import GraphCounter

    bundle, head, path, rows, _ = setup
    spec = SpeculativeConfig(method=method, depth=3, adaptive_depth=False, compiled_verify="on",
                             mtp_head=head if method == "mtp" else None, draft_model=path if method == "draft" else None)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    out = {r.key: list(r.tokens) for r in eng.generate(reqs)}
    if not count:
        return out, None
    r0 = eng.counters.rounds
    with GraphCounter() as g:
        list(eng.generate(reqs))
    rounds = eng.counters.rounds - r0
    return out, {k: g.primitives[k] / rounds for k in ("Arange", "Concatenate", "Gather")}


@pytest.mark.parametrize("method,width", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp", 4), ("draft", 1), ("draft", 3)])
def test_rounds_decode_as_plain_with_fewer_kernels(setup, monkeypatch, method, width):
    refs = setup[4]
    count = method == "mtp" and width == 1
    out, fewer = _run(setup, method, width, count=count)
    assert [out[i] for i in range(len(refs))] == refs, (method, width)
    if count:  # one stream, depth 3: the verify's, the commit's and 3 draft steps' write positions, the commit's
        # tokens, the acceptance's limit: ranges; verify_in, the read, the commit's tokens, the drafts: concatenations
        _as_plain_ops(monkeypatch)
        out, plain = _run(setup, method, width, count=True)
        assert [out[i] for i in range(len(refs))] == refs
        assert fewer["Arange"] <= plain["Arange"] - 5, (fewer, plain)
        assert fewer["Concatenate"] <= plain["Concatenate"] - 3, (fewer, plain)


def test_one_rows_lengths_are_padded_by_one_gather(monkeypatch):
    """kernels.device.padded (a row's lengths kept out of MLX's managed pool, forced here as on CUDA): one
    gather by a constant index, not a fill and a concatenation; the first elements are the array."""
    from graphkit import graph_primitives
    from mtplx.kernels import device

    monkeypatch.setattr(device, "pads", lambda: True)
    a = mx.array([37], dtype=mx.int32) + 0  # (lazy: its graph is what a program would hold)
    p = device.padded(a)
    assert p.nbytes > device.SMALL_POOL_BYTES and p[0].item() == 37
    kinds = set(graph_primitives([device.padded(a)]))
    assert "Gather" in kinds and not kinds & {"Concatenate", "Full"}, kinds


def test_greedy_acceptance_keeps_the_drafts_up_to_the_first_mismatch():
    """accept_greedy compares and gathers argmax's own indices and casts only the next token (on CUDA no
    cast kernel of the [B, K+1] picks): the counts and tokens of the first mismatch, int32."""
    from mtplx.sampling import accept_greedy

    logits = mx.random.normal((3, 4, 50), key=mx.random.key(5))
    best = mx.argmax(logits, axis=-1)
    drafts = mx.where(mx.array([[1, 1, 1], [1, 0, 1], [0, 1, 1]], dtype=mx.bool_), best[:, :3], 49).astype(mx.int32)
    n, nxt = accept_greedy(logits, drafts)
    assert n.dtype == nxt.dtype == mx.int32
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [best[b, k].item() for b, k in enumerate([3, 1, 0])]


def test_kept_counts_the_leading_accepted_drafts():
    """sampling._kept: the first rejection's index as one reduction equals the cumulative product's sum."""
    from mtplx.sampling import _kept

    ok = mx.array(np.random.default_rng(2).random((64, 5)) < 0.7)
    n = _kept(ok)
    assert n.dtype == mx.int32
    ref = np.cumprod(np.array(ok).astype(np.int32), axis=1).sum(axis=1)
    assert n.tolist() == ref.tolist() and min(ref) == 0 and max(ref) == 5
