"""The MTP head's prefill of a length group in one batched forward per chunk (MtpDrafter.prefill_rows).

- Each row's state equals what `MtpDrafter.prefill_row` builds for it alone: head KV over the
  row's length, first-draft logits, head hidden, and (with lookup) its context; over several
  head chunks and rows of different lengths.
- Admitting N rows of one length group syncs the host about once per chunk, not once per row;
  rows with a restored prefix too (they start from the prefix's head snapshot, in the same batch).
- Greedy output at widths 1/4/7 stays plain decoding's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from test_mtp_draft import _sidecar
from tiny_models import reference_tokens


def _engine(bundle, head, max_batch, lookup=0):
    spec = SpeculativeConfig(method="mtp", mtp_head=head, depth=3, adaptive_depth=False, mtp_lookup=lookup)
    return Engine(bundle, spec, ScheduleConfig(max_batch=max_batch, order="input"))


@pytest.mark.parametrize("lookup", [0, 2])
def test_batched_head_prefill_equals_prefill_row(tiny_model, tmp_path, lookup):
    bundle = load(tiny_model("llama"))
    eng = _engine(bundle, _sidecar(bundle, tmp_path / "head"), 4, lookup)
    d = eng.drafter
    d.chunk = 16  # several head chunks; rows end in different ones
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 200, int(n)).tolist() for n in (40, 33, 5, 17, 16)]
    rows = [eng.scheduler.new_row(Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=4)))[0]
            for i, p in enumerate(prompts)]
    results, firsts = eng.prefiller.group(rows, [None] * len(rows))
    # the first tokens as the prefiller hands them over (on the device, not read); prefill_row gets ints
    got = d.prefill_rows(prompts, [r[1] for r in results], firsts)
    for p, res, first, state in zip(prompts, results, np.array(firsts).tolist(), got):
        ref = d.prefill_row(p, res[1], first)
        assert int(state[0].lengths[0]) == int(ref[0].lengths[0]) == len(p)
        for a, b in zip(state[0].leaves, ref[0].leaves):
            assert a.keys.shape == b.keys.shape  # the same capacity bucket
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert np.allclose(np.array(x[..., : len(p), :]), np.array(y[..., : len(p), :]), atol=1e-5)
        for x, y in zip(state[1], ref[1]):
            assert x.shape == y.shape and np.allclose(np.array(x), np.array(y), atol=1e-4)
        assert len(state) == len(ref) == (3 if lookup else 2)
        if lookup:
            assert np.array_equal(np.array(state[2]), np.array(ref[2]))


def test_admitting_a_length_group_evals_once_per_chunk_not_per_row(tiny_model, tmp_path, monkeypatch):
    bundle = load(tiny_model("llama"))
    eng = _engine(bundle, _sidecar(bundle, tmp_path / "head"), 8)
    N = 8
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 200, 12).tolist() for _ in range(N)]  # one length group, one chunk each
    calls = _count_prefill_evals(eng, monkeypatch)
    out = {r.key: r.tokens for r in eng.generate([Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=6))
                                                 for i, p in enumerate(prompts)])}
    assert len(calls) <= 2 < N, calls  # the trunk's chunk and the head's, for all eight rows
    for i, p in enumerate(prompts):
        assert out[i] == reference_tokens(bundle.model, p, 6, eng.eos)


@pytest.mark.parametrize("width", [1, 4, 7])
def test_greedy_output_is_plain_decoding_at_widths(tiny_model, tmp_path, width):
    bundle = load(tiny_model("llama"))
    eng = _engine(bundle, _sidecar(bundle, tmp_path / "head"), width)
    eng.drafter.chunk = 8
    rng = np.random.default_rng(5)
    prompts = [rng.integers(5, 200, int(n)).tolist() for n in (9, 10, 11, 12, 30, 31, 3)]
    out = {r.key: r.tokens for r in eng.generate([Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=16))
                                                 for i, p in enumerate(prompts)])}
    for i, p in enumerate(prompts):
        assert out[i] == reference_tokens(bundle.model, p, 16, eng.eos)


def _prefix_rows(eng, shared, suffixes):
    return [eng.scheduler.new_row(Request(key=i, prompt_tokens=shared + s, params=SamplingParams(max_tokens=6),
                                 stable_prefix_len=len(shared)))[0] for i, s in enumerate(suffixes)]


@pytest.mark.parametrize("lookup", [0, 2])
def test_batched_head_prefill_of_restored_prefix_rows_equals_prefill_row(tiny_model, tmp_path, lookup):
    """Rows whose prefix was restored from the store start from its head snapshot: in one batch
    with rows that have none, each gets the state prefill_row(prefix=...) gives it."""
    bundle = load(tiny_model("llama"))
    eng = _engine(bundle, _sidecar(bundle, tmp_path / "head"), 8, lookup)
    d = eng.drafter
    d.chunk = 8  # suffixes span head chunks
    rng = np.random.default_rng(6)
    shared = rng.integers(5, 200, 20).tolist()
    eng.prefiller.run(_prefix_rows(eng, shared, [[7, 8]]), d)  # the group's first row: stores the prefix
    rows = _prefix_rows(eng, shared, [rng.integers(5, 200, int(n)).tolist() for n in (3, 11, 1, 17)])
    rows.append(eng.scheduler.new_row(Request(key=9, prompt_tokens=rng.integers(5, 200, 14).tolist(),
                                     params=SamplingParams(max_tokens=6)))[0])  # no prefix
    keys = [eng.prefiller.store.key(r.req.prompt_tokens, eng.prefiller.edge(r)) for r in rows]
    results, firsts = eng.prefiller.group(rows, keys)
    assert [res[2] is not None for res in results] == [True] * 4 + [False]
    prefixes = [res[2][1] if res[2] is not None else None for res in results]
    firsts = np.array(firsts).tolist()
    got = d.prefill_rows([r.req.prompt_tokens for r in rows], [r[1] for r in results], firsts, prefixes)
    for row, res, first, prefix, state in zip(rows, results, firsts, prefixes, got):
        p = row.req.prompt_tokens
        ref = d.prefill_row(p, res[1], first, prefix)
        assert int(state[0].lengths[0]) == int(ref[0].lengths[0]) == len(p)
        for a, b in zip(state[0].leaves, ref[0].leaves):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert np.allclose(np.array(x[..., : len(p), :]), np.array(y[..., : len(p), :]), atol=1e-5)
        for x, y in zip(state[1], ref[1]):
            assert x.shape == y.shape and np.allclose(np.array(x), np.array(y), atol=1e-4)
        if lookup:
            assert np.array_equal(np.array(state[2]), np.array(ref[2]))


def test_rows_sharing_a_restored_prefix_prefill_the_head_together(tiny_model, tmp_path, monkeypatch):
    """Admitting N rows that share a stored prefix: the head's prefill of the rows after the
    leader is one batched forward per chunk, not one forward and one eval per row."""
    bundle = load(tiny_model("llama"))
    eng = _engine(bundle, _sidecar(bundle, tmp_path / "head"), 8)
    N = 8
    rng = np.random.default_rng(7)
    shared = rng.integers(5, 200, 24).tolist()
    prompts = [shared + rng.integers(5, 200, 4).tolist() for _ in range(N)]  # one length group after the first row
    forwards = []
    hidden = eng.drafter.head.hidden
    eng.drafter.head.hidden = lambda h, *a, **k: (forwards.append(h.shape[0]), hidden(h, *a, **k))[1]
    reqs = [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=6), stable_prefix_len=len(shared))
            for i, p in enumerate(prompts)]
    calls = _count_prefill_evals(eng, monkeypatch)
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    for i, p in enumerate(prompts):
        assert out[i] == reference_tokens(bundle.model, p, 6, eng.eos)
    assert eng.counters.cached_prompt_tokens == (N - 1) * len(shared)
    assert (N - 1) in forwards, forwards  # the seven rows after the first, in one head forward
    # the first row: its two trunk spans (split at the edge) and its head chunk; the group: one trunk and one head chunk
    assert len(calls) <= 5 < 2 + 1 + 1 + (N - 1), calls


def _count_prefill_evals(eng, monkeypatch) -> list:
    """A list that gets one entry per mx.eval made inside the engine's prefills."""
    calls, run = [], eng.prefiller.run

    def counted(rows, drafter=None, **kw):
        real = mx.eval
        monkeypatch.setattr(mx, "eval", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        try:
            return run(rows, drafter, **kw)
        finally:
            monkeypatch.setattr(mx, "eval", real)

    eng.prefiller.run = counted
    return calls


def test_an_admissions_length_groups_are_read_once(tiny_model, tmp_path, monkeypatch):
    """Rows of three length groups admitted together: every group's trunk and head forwards are
    queued before the first tokens are read, in one read (a read per group would leave the device
    idle while the host queues the next group); the text is plain decoding's."""
    import mtplx.prefill as prefill_mod

    bundle = load(tiny_model("llama"))
    rng = np.random.default_rng(8)
    prompts = [rng.integers(5, 200, int(n)).tolist() for n in (4, 4, 20, 21, 60, 61)]
    assert len(prefill_mod.length_groups([len(p) for p in prompts])) == 3
    reads = []

    class CountingNumpy:  # np inside prefill.py: counts the host reads of device arrays
        def __getattr__(self, name):
            return getattr(np, name)

        def array(self, x, *args, **kwargs):
            if isinstance(x, mx.array):
                reads.append(x.shape)
            return np.array(x, *args, **kwargs)

    monkeypatch.setattr(prefill_mod, "np", CountingNumpy())
    eng = _engine(bundle, _sidecar(bundle, tmp_path / "head"), len(prompts))
    out = {r.key: r.tokens for r in eng.generate([Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=6))
                                                 for i, p in enumerate(prompts)])}
    assert len(reads) == 1, reads
    for i, p in enumerate(prompts):
        assert out[i] == reference_tokens(bundle.model, p, 6, eng.eos)
