"""Prefill spans: `_iter_prefill_chunk_spans`, `_split_spans_at`, `_prefill_chunk_size`.

Properties (hypothesis): the spans tile [0, n) exactly, in order, with no empty span; every
mandatory edge strictly inside (0, n) is a span boundary; edges outside (0, n) or already on a
chunk boundary change nothing; with chunking off there is one span, split only at the edges.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplx.generation import _iter_prefill_chunk_spans, _prefill_chunk_size, _split_spans_at

sizes = st.integers(min_value=0, max_value=5000)
chunks = st.one_of(st.none(), st.integers(min_value=-3, max_value=700))
edge_lists = st.lists(st.integers(min_value=-50, max_value=5100), max_size=8)


def _spans(n, chunk, edges=()):
    return list(_iter_prefill_chunk_spans(n, chunk, tuple(edges)))


def _boundaries(spans):
    return {s for s, _ in spans} | {e for _, e in spans}


def _check_tiling(spans, n):
    if n <= 0:
        assert spans == []
        return
    assert spans[0][0] == 0 and spans[-1][1] == n
    for (s, e), (s2, _) in zip(spans, spans[1:]):
        assert e == s2, f"gap or overlap between spans: {spans}"
    assert all(s < e for s, e in spans), f"empty span in {spans}"
    assert all(isinstance(s, int) and isinstance(e, int) for s, e in spans)


@settings(max_examples=300, deadline=None)
@given(n=sizes, chunk=chunks, edges=edge_lists)
def test_spans_tile_the_prompt_and_split_at_every_inner_edge(n, chunk, edges):
    spans = _spans(n, chunk, edges)
    _check_tiling(spans, n)
    bounds = _boundaries(spans)
    for e in edges:
        if 0 < e < n:
            assert e in bounds, f"edge {e} is not a boundary of {spans}"
    # Boundaries are exactly the chunk grid plus the inner edges: nothing else is cut.
    on = chunk is not None and chunk > 0
    grid = set(range(0, n, chunk)) | {n} if on else {0, n}
    if n > 0:
        assert bounds == grid | {e for e in edges if 0 < e < n}
    if on:
        assert all(e - s <= chunk for s, e in spans)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), chunk=chunks, edges=edge_lists, outside=edge_lists)
def test_edges_outside_or_on_a_boundary_change_nothing(n, chunk, edges, outside):
    base = _spans(n, chunk, edges)
    useless = [e for e in outside if e <= 0 or e >= n] + sorted(_boundaries(base))
    assert _spans(n, chunk, list(edges) + useless) == base
    # duplicates and order of edges do not matter
    assert _spans(n, chunk, list(reversed(edges)) * 2) == base


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), off=st.sampled_from([0, None, -1]), edges=edge_lists)
def test_chunking_off_gives_one_span_split_only_at_edges(n, off, edges):
    spans = _spans(n, off, edges)
    inner = sorted({e for e in edges if 0 < e < n})
    cuts = [0] + inner + [n]
    assert spans == list(zip(cuts, cuts[1:]))
    assert _spans(n, off) == [(0, n)]


@settings(max_examples=200, deadline=None)
@given(
    spans=st.lists(st.integers(1, 300), min_size=1, max_size=10).map(
        lambda ls: [(sum(ls[:i]), sum(ls[: i + 1])) for i in range(len(ls))]
    ),
    edges=edge_lists,
)
def test_split_spans_at(spans, edges):
    out = _split_spans_at(spans, edges)
    n = spans[-1][1]
    _check_tiling(out, n)
    assert _boundaries(out) == _boundaries(spans) | {e for e in edges if 0 < e < n}


def test_seed_example():
    spans = _spans(3000, 512, (1024,))
    assert spans == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048), (2048, 2560), (2560, 3000)]
    # an edge off the chunk grid cuts the chunk that holds it
    assert _spans(3000, 512, (1000,)) == [
        (0, 512), (512, 1000), (1000, 1024), (1024, 1536), (1536, 2048), (2048, 2560), (2560, 3000)
    ]
    assert _spans(0, 512, (10,)) == []
    assert _spans(5, 512, (0, 5, 9)) == [(0, 5)]


def test_prefill_chunk_size_honours_env(monkeypatch):
    monkeypatch.delenv("MTPLX_PREFILL_CHUNK_SIZE", raising=False)
    cfg = {"hidden_size": 64, "intermediate_size": 128}
    default = _prefill_chunk_size(cfg, 1 << 30)
    assert 128 <= default <= 2048 and default % 128 == 0
    assert _prefill_chunk_size() > 0  # no config: a fixed default
    # the heuristic grows with the memory budget, within its clamp
    assert _prefill_chunk_size(cfg, 1 << 20) <= _prefill_chunk_size(cfg, 1 << 34)
    monkeypatch.setenv("MTPLX_PREFILL_CHUNK_SIZE", "300")
    assert _prefill_chunk_size(cfg, 1 << 30) == 300
    assert _prefill_chunk_size() == 300
    monkeypatch.setenv("MTPLX_PREFILL_CHUNK_SIZE", "0")
    assert _prefill_chunk_size(cfg, 1 << 30) == 0  # chunking off
    monkeypatch.setenv("MTPLX_PREFILL_CHUNK_SIZE", "lots")
    with pytest.raises(ValueError, match="MTPLX_PREFILL_CHUNK_SIZE"):
        _prefill_chunk_size(cfg, 1 << 30)


def test_engine_prefills_in_env_sized_chunks_with_the_same_output(monkeypatch, tiny_model):
    """The engine reads MTPLX_PREFILL_CHUNK_SIZE (over schedule.prefill_chunk); the chunked
    prefill (split at the stable-prefix edge too) gives the same greedy text as one span."""
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.models.loading import load
    from mtplx.request import Request, SamplingParams

    bundle = load(tiny_model("qwen3_next"))
    prompt = bundle.tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    for a in argv:\n        print(a)\n")
    n = len(prompt)
    assert n > 20

    def run(edge=0):
        eng = Engine(bundle, SpeculativeConfig(method="ngram", depth=2, adaptive_depth=False, compiled_verify="off"),
                     ScheduleConfig(max_batch=1, prefill_chunk=4096))
        res = list(eng.generate([Request("a", prompt, SamplingParams(max_tokens=6), stable_prefix_len=edge)]))
        return eng, res[0]

    monkeypatch.delenv("MTPLX_PREFILL_CHUNK_SIZE", raising=False)
    eng, whole = run()
    assert eng.prefill_chunk == 4096 and whole.stats.prefill_chunks == 1
    monkeypatch.setenv("MTPLX_PREFILL_CHUNK_SIZE", "7")
    eng, chunked = run()
    assert eng.prefill_chunk == 7
    assert chunked.stats.prefill_chunks == -(-n // 7)
    assert chunked.tokens == whole.tokens
    edge = 10  # off the 7-grid: one more span
    eng, split = run(edge)
    assert split.stats.prefill_chunks == len(_spans(n, 7, (edge,))) == -(-n // 7) + 1
    assert split.tokens == whole.tokens


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=4000), max_size=64), st.sampled_from([0.0, 0.25, 1.0]))
def test_length_groups_cover_every_row_once_and_bound_the_padding(lengths, waste):
    from mtplx.prefill import length_groups

    groups = length_groups(lengths, waste)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)  # shortest first, within and across groups
    for g in groups:
        padded, real = len(g) * max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert len(g) == 1 or padded <= (1 + waste) * real + 1e-9


def test_rows_of_very_different_lengths_prefill_in_length_groups_with_the_same_output(tiny_model):
    """Many short prompts and one long one: grouped by length, the long one does not pad the rest
    (prefilled slots stay near the real tokens), and every row's text is unchanged."""
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.models.loading import load
    from mtplx.request import Request, SamplingParams

    bundle = load(tiny_model("llama"))
    prompts = [list(range(3, 3 + n)) for n in (5, 6, 6, 7, 8, 9, 60)]
    slots = []

    def run(max_batch):
        eng = Engine(bundle, SpeculativeConfig(method="none", compiled_verify="off"), ScheduleConfig(max_batch=max_batch))
        group = eng.prefiller.group

        def counting(rows, keys):  # the padded slots each batched prefill spends
            slots.append(len(rows) * max(len(r.req.prompt_tokens) for r in rows))
            return group(rows, keys)

        eng.prefiller.group = counting
        reqs = [Request(i, p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts)]
        return {r.key: r.tokens for r in eng.generate(reqs)}

    alone = run(1)
    slots.clear()
    together = run(len(prompts))
    assert together == alone
    assert sum(slots) <= 1.25 * sum(map(len, prompts)) < len(prompts) * 60


def test_rows_sharing_a_prefix_are_copied_per_group_not_per_row(tiny_model, monkeypatch):
    """Sixteen rows behind one shared prefix: restoring the prefix, and placing the rows in the
    batch cache, are one gather per layer and prefill group (`put_rows`), not copies row by row
    (`write_row` runs only to store the prefix once); the text equals plain one-row-at-a-time runs."""
    from mtplx import cache as cache_mod
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.models.loading import load
    from mtplx.request import Request, SamplingParams

    bundle = load(tiny_model("llama"))
    layers = len(bundle.model.layers)
    shared = list(range(3, 43))
    prompts = [shared + [50 + i] * (1 + i % 3) for i in range(16)]

    def engine(max_batch):
        return Engine(bundle, SpeculativeConfig(method="none", compiled_verify="off"), ScheduleConfig(max_batch=max_batch))

    def run(eng):
        reqs = [Request(i, p, SamplingParams(max_tokens=4), stable_prefix_len=len(shared)) for i, p in enumerate(prompts)]
        return {r.key: r.tokens for r in eng.generate(reqs)}

    alone, eng = run(engine(1)), engine(16)  # (the engine made before the count: its model probe places rows too)
    calls = {"write_row": 0, "put_rows": 0}
    for name in calls:
        real = getattr(cache_mod.RowKVCache, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(cache_mod.RowKVCache, name, counted)
    assert run(eng) == alone
    assert calls["write_row"] <= layers  # the prefix, stored once
    # leader alone, then the other rows as a few length groups: each group restores its prefix once,
    # and the placement gathers once per group cache
    assert calls["put_rows"] <= layers * 8 < 16 * layers
