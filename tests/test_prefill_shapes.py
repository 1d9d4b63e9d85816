"""Prefill forwards at few query lengths: on a GPU a batched prefill pads its queries to a bucket.

MLX on CUDA builds an attention plan per exact query shape in every process, so a job whose
prompts have many lengths paid one per prefill forward (every refill of a row is one). With
`prefill.pads_queries()` (on a GPU) the trunk's batched prefill and the MTP head's run at
`prefill_width(n)`: padded, never entering a row's cache, so the output is what unpadded prefill
gives, token for token, and the head's state is `prefill_row`'s.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx import prefill as prefill_mod
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.prefill import prefill_width
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens, untrained_head


def test_prefill_width_makes_few_shapes_with_little_padding(monkeypatch):
    monkeypatch.setattr(prefill_mod, "pads_queries", lambda: True)
    widths = [prefill_width(n) for n in range(1, 1025)]
    assert all(w >= n for n, w in zip(range(1, 1025), widths))
    assert len(set(widths)) <= 40  # from 1024 lengths
    assert all(w <= n * 1.125 for n, w in zip(range(257, 1025), widths[256:]))
    assert prefill_width(300, room=310) == 310 and prefill_width(300, room=200) == 300  # never past the room, never short
    monkeypatch.setattr(prefill_mod, "pads_queries", lambda: False)
    assert [prefill_width(n) for n in (1, 37, 300)] == [1, 37, 300]


def test_the_default_follows_the_device():
    import mlx.core as mx

    assert prefill_mod.pads_queries() == (mx.default_device().type == mx.DeviceType.gpu)
    assert (prefill_width(37) != 37) == (mx.default_device().type == mx.DeviceType.gpu)


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    bundle = load(tiny_model("llama"))
    head = untrained_head(bundle, tmp_path_factory.mktemp("head"))
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 400, 12).tolist()  # a shared prefix: later rows prefill their suffix only
    rows = [(shared + rng.integers(3, 400, int(n)).tolist(), int(m))
            for n, m in zip([3, 41, 17, 9, 28, 5, 33, 12, 21, 2], [6, 9, 4, 11, 7, 5, 8, 10, 3, 6])]
    eos = set(bundle.tokenizer.eos_token_ids)
    return bundle, str(head), rows, [reference_tokens(bundle.model, p, m, eos) for p, m in rows]


@pytest.mark.parametrize("method", ["none", "mtp", "mtp-lookup"])
def test_padded_prefill_gives_the_same_tokens_at_few_query_lengths(setup, method, monkeypatch):
    bundle, head, rows, refs = setup
    monkeypatch.setattr(prefill_mod, "pads_queries", lambda: True)
    spec = SpeculativeConfig(method=method.split("-")[0], depth=3, adaptive_depth=False,
                             mtp_head=head if method != "none" else None, mtp_lookup=2 if method == "mtp-lookup" else 0)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=3, order="input"))  # rows join as others leave: refills
    trunk, heads = [], []
    hidden = eng.prefiller.hidden
    eng.prefiller.hidden = lambda tokens, cache: (trunk.append(tokens.shape[1]), hidden(tokens, cache))[1]
    if eng.drafter is not None:
        call = eng.drafter.head.hidden
        eng.drafter.head.hidden = lambda h, toks, layers, **kw: (heads.append(toks.shape[1]), call(h, toks, layers, **kw))[1]
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m), stable_prefix_len=12)
            for i, (p, m) in enumerate(rows)]
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    assert [out[i] for i in range(len(rows))] == refs
    suffixes = {len(p) - 12 for p, _ in rows}
    assert trunk[0] == 12  # the first row leads: its prefix and its suffix are spans of its own (not batched)
    batched = trunk[2:]
    assert set(batched) <= {prefill_width(n) for n in range(1, 64)} and len(set(batched)) < len(suffixes) / 2, trunk
    if eng.drafter is not None:
        prefills = [n for n in heads if n > 8]  # head prefills (its commits read the verify's 4 tokens)
        assert prefills and all(n in {prefill_width(k) for k in range(1, 64)} for n in prefills[1:]), heads


def test_a_padded_head_prefill_is_prefill_rows(setup, monkeypatch):
    bundle, head, rows, _ = setup
    monkeypatch.setattr(prefill_mod, "pads_queries", lambda: True)
    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, mtp_head=head, mtp_lookup=2)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=4, order="input"))
    prompts = [p for p, _ in rows[:4]]
    grown = [eng.scheduler.new_row(Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=4)))[0] for i, p in enumerate(prompts)]
    results, firsts = eng.prefiller.group(grown, [None] * len(grown))
    firsts = np.array(firsts).tolist()
    for b, p in enumerate(prompts):  # each row alone too: the padded width is its own length's bucket
        for got, ref in zip(eng.drafter.prefill_rows([p], [results[b][1]], [firsts[b]]),
                            [eng.drafter.prefill_row(p, results[b][1], firsts[b])]):
            assert int(got[0].lengths[0]) == int(ref[0].lengths[0]) == len(p)
            for a, r in zip(got[0].leaves, ref[0].leaves):
                assert np.allclose(np.array(a.keys[..., : len(p), :]), np.array(r.keys[..., : len(p), :]), atol=1e-5)
            for x, y in zip(got[1], ref[1]):
                assert np.allclose(np.array(x), np.array(y), atol=1e-4)
            assert np.array_equal(np.array(got[2]), np.array(ref[2]))
