"""Prompt lookup inside MTP drafting (`speculative.mtp_lookup`, drafting/mtp.py: LookupFallback).

- Each round a row drafts its context's continuation where its suffix was seen before (and is
  followed by the round's depth of tokens), else the head's drafts; both kinds of round really
  happen in these tests (counted), mixed within one batch.
- Greedy output stays identical to plain decoding, compiled and eager.
- Sampled output stays on the target distribution: the lookup rows' q is the point mass on their
  drafts (test_engine_sampling's checks, as test_mtp_draft runs them for the head alone); giving
  those rows the head's q instead fails those very checks.
- The setting is checked, and a sampled job's fingerprint follows it (its text depends on it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.drafting.mtp import LookupFallback
from mtplx.drafting.ngram import NgramDrafter
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import SamplingParams
from test_engine_sampling import P_REJECT, exactness_tests, failed, least, sample_rows
from test_mtp_draft import _run, _sidecar
from tiny_models import reference_tokens


def _repetitive_prompts(rng):
    """Prompts with repeated spans (lookup finds continuations) and random ones (it does not)."""
    out = []
    for n in (6, 30, 12, 50, 9):
        span = rng.integers(5, 200, max(3, n // 3)).tolist()
        out.append((span * 4)[:n] + rng.integers(5, 200, 4).tolist())
    return out + [rng.integers(5, 200, 20).tolist()]


@pytest.mark.parametrize("compiled", ["on", "off"])
def test_lookup_fallback_keeps_greedy_output_identical(tiny_model, tmp_path, compiled):
    bundle = load(tiny_model("llama"))
    prompts = _repetitive_prompts(np.random.default_rng(7))
    head = _sidecar(bundle, tmp_path / "head")
    spec = SpeculativeConfig(method="mtp", mtp_head=head, depth=3, adaptive_depth=False, compiled_verify=compiled,
                             mtp_lookup=2)
    results, eng = _run(bundle, spec, prompts, [SamplingParams(max_tokens=40)], max_batch=4)
    lookup = eng.drafter.lookup
    assert isinstance(lookup, LookupFallback) and lookup.min_match == 2
    print(f"\nrow-rounds drafted: {lookup.counts}")
    assert lookup.counts["lookup"] >= 5 and lookup.counts["head"] >= 5
    for p, r in zip(prompts, results):
        assert r.tokens == reference_tokens(bundle.model, p, 40, eng.eos)


@pytest.mark.parametrize("width", [1, 4])
def test_the_lookup_tally_counts_the_same_added_up_mid_call(tiny_model, tmp_path, monkeypatch, width):
    """Greedy, widths 1 and 4: plain decoding's text, and the row-rounds drafted by lookup counted the
    same whether the tally is added up every few rounds or when the call ends."""
    bundle = load(tiny_model("llama"))
    prompts = _repetitive_prompts(np.random.default_rng(11))
    head = _sidecar(bundle, tmp_path / "head")
    spec = SpeculativeConfig(method="mtp", mtp_head=head, depth=3, adaptive_depth=False, mtp_lookup=2)
    got = {}
    for every in (3, LookupFallback.FOLD_EVERY):
        monkeypatch.setattr(LookupFallback, "FOLD_EVERY", every)
        results, eng = _run(bundle, spec, prompts, [SamplingParams(max_tokens=30)], max_batch=width)
        got[every] = ([r.tokens for r in results], eng.drafter.lookup.counts, [r.stats.accepted_tokens for r in results])
    first, second = got.values()
    print(f"\nrow-rounds drafted: {first[1]}")
    assert first == second
    assert first[1]["lookup"] >= 5 and first[1]["head"] >= 5
    for p, toks in zip(prompts, first[0]):
        assert toks == reference_tokens(bundle.model, p, 30, eng.eos)


def _history(rows, lk, extra=3):
    """The rows' histories as MtpDrafter keeps them for `lk` (LookupFallback.context), and their lengths."""
    hist = np.zeros((len(rows), max(map(len, rows)) + extra), dtype=np.int32)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    return mx.concatenate([lk.context(mx.array(h)) for h in hist]), mx.array([len(r) for r in rows], dtype=mx.int32)


def test_lookup_needs_a_match_and_a_long_enough_continuation():
    lk = LookupFallback(ngram_size=3, min_match=2)
    rows = [[1, 2, 3, 4, 9, 1, 2, 3],  # suffix (1, 2, 3) seen: 4 9 1 follow
            [5, 6, 7, 8, 5],  # only (5,) seen before: too short a match
            [1, 2, 3, 4, 1, 2, 3]]  # (1, 2, 3) seen, but only 4 1 2 3 follow...
    hist, lengths = _history(rows, lk)
    use, drafts = lk.drafts(hist, lengths, 3)
    assert np.array(use).tolist() == [True, False, True]
    assert np.array(drafts[0]).tolist() == [4, 9, 1] and np.array(drafts[2]).tolist() == [4, 1, 2]
    use, drafts = lk.drafts(hist, lengths, 5)  # ...which is shorter than a depth of 5
    assert np.array(use).tolist() == [True, False, False] and np.array(drafts[0]).tolist() == [4, 9, 1, 2, 3]


@pytest.mark.parametrize("n,min_match", [(3, 2), (3, 1), (4, 3), (1, 1)])
def test_device_lookup_finds_what_the_host_lookup_finds(n, min_match):
    """On random short-alphabet histories (many repeats, matches at the history's very start), the
    device match is NgramDrafter.match's: the longest suffix seen before, its latest earlier place, and
    whether K tokens follow there."""
    rng = np.random.default_rng(n * 10 + min_match)
    rows = [rng.integers(0, 4, int(rng.integers(1, 40))).tolist() for _ in range(64)]
    rows += [[0, 1, 2, 0, 1], [1, 1], [2], [0, 1, 0, 1, 0, 1]]
    host = NgramDrafter(n)
    lk = LookupFallback(n, min_match)
    assert lk.lead == lk.n
    hist, lengths = _history(rows, lk)
    for K in (1, 3, 5):
        use, drafts = lk.drafts(hist, lengths, K)
        use, drafts = np.array(use), np.array(drafts)
        for i, r in enumerate(rows):
            size, cont = host.match(r, host.prefill_row(r[:-1], None, r[-1])[1], K)
            want = size >= min_match and len(cont) >= K
            assert use[i] == want, (r, K)
            if want:
                assert drafts[i].tolist() == cont, (r, K)


def test_the_lookup_hands_the_device_few_kernels():
    """A round's lookup (history append, match, mix) inside a compiled program: 11 kernels on MLX's CPU
    graph (two of them the adds of the lengths this test makes), whatever the suffix length (one
    gather of the suffix, one fused comparison over the history, one reduction, one gather of the
    drafts; the history kept behind a pad of its own, so no pad per round)."""
    from graphkit import VIEWS, graph_primitives

    def kernels(arrays):
        return sum(v for k, v in graph_primitives(list(arrays)).items() if k not in VIEWS)

    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 5, 300).tolist(), rng.integers(0, 5, 120).tolist()]
    lk = LookupFallback(3, 2)
    hist, lengths = _history(rows, lk, extra=200)
    committed, head = mx.array([[1, 2, 3, 4]] * 2, dtype=mx.int32), mx.zeros((2, 3), mx.int32)
    mx.eval(hist, lengths, committed, head)

    def rnd(hist, lengths, committed, head):  # as the head's program calls it: its lengths, a token short
        hist = lk.append(hist, lengths - 1, committed, extra=1)
        use, looked = lk.drafts(hist, lengths + 3, 3, extra=1)
        return (hist, use) + lk.mix(use, looked, head, None)[:1]

    out = mx.compile(rnd)(hist, lengths, committed, head)
    assert kernels(out) <= 11, kernels(out)


class _HeadQForLookupRows(LookupFallback):
    """The bug the point masses prevent: lookup rows keep the head's q for drafts it did not draw."""

    @staticmethod
    def mix(use, looked, drafts, q):
        return mx.where(use[:, None], looked, drafts.astype(mx.int32)), q


def _sampled_checks(bundle, head, compiled, wrong=False):
    # depth 2: a row looks up only where the round's depth of tokens follows its match, more often at 2 than at 3
    spec = SpeculativeConfig(method="mtp", mtp_head=head, depth=2, adaptive_depth=False, compiled_verify=compiled,
                             mtp_lookup=1)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=128))
    if wrong:
        eng.drafter.lookup = _HeadQForLookupRows(spec.ngram_size, spec.mtp_lookup)
    samples = sample_rows(bundle, spec, 7 * 10**6, engine=eng)
    tests = exactness_tests(bundle.model, samples)
    least(tests, f"{'head q on lookup rows' if wrong else 'lookup'} (compiled {compiled})")
    return tests, eng.drafter.lookup.counts


@pytest.mark.parametrize("compiled", ["on", "off"])
def test_sampled_output_with_lookup_fallback_follows_the_target(tiny_model, tmp_path, compiled):
    bundle = load(tiny_model("small_vocab"))
    head = _sidecar(bundle, tmp_path / "head", seed=4)
    tests, counts = _sampled_checks(bundle, head, compiled)
    print(f"row-rounds drafted: {counts}")
    # PROMPT repeats itself: a row whose first token is one of its own looks up, the others use the head
    assert counts["lookup"] >= 200 and counts["head"] >= 200, counts
    assert not failed(tests), failed(tests)


def test_head_q_on_lookup_rows_fails_the_same_test(tiny_model, tmp_path):
    bundle = load(tiny_model("small_vocab"))
    head = _sidecar(bundle, tmp_path / "head", seed=4)
    tests, _ = _sampled_checks(bundle, head, "on", wrong=True)
    assert min(t[3] for t in tests) < P_REJECT, failed(tests)


def test_mtp_lookup_setting_is_checked_and_fingerprinted(tmp_path):
    from test_config import _parts

    from pipelines.job.fingerprint import diff_fingerprint_parts

    assert SpeculativeConfig(method="mtp", mtp_lookup=2).mtp_lookup == 2
    with pytest.raises(ValueError, match="speculative.mtp_lookup"):
        SpeculativeConfig(method="mtp", mtp_lookup=-1)
    sampled = dict(generation__temperature=0.7, speculative__method="mtp")
    base = _parts(tmp_path, **sampled)
    assert diff_fingerprint_parts(base, _parts(tmp_path, **sampled, speculative__mtp_lookup=3)) == []  # the default
    changed = _parts(tmp_path, **sampled, speculative__mtp_lookup=0)
    assert diff_fingerprint_parts(base, changed) == ["speculative.mtp_lookup", "speculative.ngram_size"]
    greedy = _parts(tmp_path, speculative__method="mtp")
    assert diff_fingerprint_parts(greedy, _parts(tmp_path, speculative__method="mtp", speculative__mtp_lookup=2)) == []
