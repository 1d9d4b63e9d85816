"""The draft-model method's proposal (mtplx/drafting/draft_model.py).

- A round of depth K runs the draft model K times (its cache one token behind the target's), as
  mlx-lm's speculative_generate_step does, and, compiled, is one program call.
- The compiled proposal gives the drafts (and q) of the eager one, round after round, through
  partial accepts.
- Rounds without drafts run no draft step: the tokens wait in a backlog that the next drafting
  round (or a full backlog) feeds; greedy output stays plain decoding's, attention-only and
  hybrid drafts, at widths 1 and 3.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.drafting.draft_model import MAX_BACKLOG
from mtplx.drafting.draft_model import DraftModelDrafter
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from mtplx.sampling import SamplerBatch
from tiny_models import reference_tokens


class CountingModel:
    """The draft model, counting its forwards."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.model(*a, **k)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def pair(tiny_model):
    target = load(tiny_model("llama"))
    draft = load(tiny_model("llama", seed=1)).model
    V = target.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 400, int(n)).tolist() for n in (5, 13, 1)]
    return target, draft, V, prompts, rng


def _drafter(model, V, prompts, compiled):
    d = DraftModelDrafter(model, V, compiled=compiled)
    d.reset()
    d.extend([d.prefill_row(p, None, 0) for p in prompts])
    return d


@pytest.mark.parametrize("sampled", [False, True])
def test_compiled_drafts_equal_eager_drafts_round_after_round(pair, sampled):
    _, draft, V, prompts, rng = pair
    W, K = len(prompts), 3
    params = SamplingParams(temperature=1.0, top_k=20) if sampled else SamplingParams()
    sampler = SamplerBatch.from_params([params] * W)
    eager, compiled = _drafter(draft, V, prompts, False), _drafter(draft, V, prompts, True)
    pending = mx.array(rng.integers(3, 400, W).astype(np.int32))
    for n_accept in ([0, 2, 3], [3, 0, 1], [1, 3, 0]):
        u = mx.array(rng.random((W, K)).astype(np.float32))
        d_e, q_e = eager.propose(K, pending, sampler, u)
        d_c, q_c = compiled.propose(K, pending, sampler, u)
        assert np.array_equal(np.array(d_e), np.array(d_c))
        if sampled:
            np.testing.assert_allclose(np.array(q_c), np.array(q_e), atol=1e-5)
        else:
            assert q_e is None and q_c is None  # greedy: no softmax over the vocabulary
        drafts = np.array(d_e)
        nxt = rng.integers(3, 400, W).astype(np.int32)
        verify_in = mx.array(np.concatenate([np.array(pending)[:, None], drafts], axis=1))
        for d in (eager, compiled):
            d.commit(np.array(n_accept), nxt, drafts, np.ones(W, bool), verify_in, None)
        assert np.array_equal(eager.cache.rows.host, compiled.cache.rows.host)
        pending = mx.array(nxt)
    assert compiled.bank.stats["compiled_calls"] == 3 and compiled.bank.stats["eager_calls"] == 0
    assert len(compiled.bank.programs.built) == 1  # one program serves every round of its shape


def test_a_round_of_depth_k_runs_the_draft_model_k_times(pair):
    """And its cache then holds what the target's does, less the last accepted token."""
    _, draft, V, prompts, rng = pair
    counting = CountingModel(draft)
    d = _drafter(counting, V, prompts, compiled=False)
    assert list(d.cache.rows.host) == [len(p) - 1 for p in prompts]
    W, sampler = len(prompts), SamplerBatch.from_params([SamplingParams()] * len(prompts))
    for K in (1, 2, 4):
        before, lengths = counting.calls, d.cache.rows.host.copy()
        pending = mx.array(rng.integers(3, 400, W).astype(np.int32))
        drafts, _ = d.propose(K, pending, sampler, mx.zeros((W, K)))
        assert counting.calls - before == K
        n = np.array([0, K, K // 2])
        verify_in = mx.array(np.concatenate([np.array(pending)[:, None], np.array(drafts)], axis=1))
        d.commit(n, np.zeros(W, np.int32), np.array(drafts), np.ones(W, bool), verify_in, None)
        assert np.array_equal(d.cache.rows.host, lengths + n + 1)


def _rows(prompt_lengths, max_tokens, seed=5):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 400, int(n)).tolist(), int(m)) for n, m in zip(prompt_lengths, max_tokens)]


@pytest.mark.parametrize("draft_arch", ["llama", "qwen3_next"])
@pytest.mark.parametrize("width,compiled", [(1, "on"), (3, "on"), (3, "off")])
def test_rounds_without_drafts_feed_nothing_and_greedy_output_stays_plain(tiny_model, draft_arch, width, compiled):
    """Depth 0 for longer than the backlog holds, then drafting again, then 0 again: the draft model
    runs only in drafting rounds and when the backlog is full, and the text is plain decoding's."""
    target_path = tiny_model("qwen3_next") if draft_arch == "qwen3_next" else tiny_model("llama")
    bundle = load(target_path)
    rows = _rows([4, 17, 9, 2], [MAX_BACKLOG + 20, 50, MAX_BACKLOG + 9, 12])
    eos = set(bundle.tokenizer.eos_token_ids)
    refs = [reference_tokens(bundle.model, p, m, eos) for p, m in rows]
    spec = SpeculativeConfig(method="draft", depth=3, adaptive_depth=True, compiled_verify=compiled,
                             draft_model=str(target_path))  # the target drafts for itself: every draft passes
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    eng.drafter.measure = False  # the steps as configured: no timing of both chains (it feeds the model too)
    counting = CountingModel(eng.drafter.model)
    eng.drafter.model = counting
    schedule = [0] * (MAX_BACKLOG + 3) + [3] * 4 + [0] * 6 + [2] * 3
    chosen = []

    def choose(n_active, **_):
        chosen.append(schedule[len(chosen)] if len(chosen) < len(schedule) else 0)
        return chosen[-1]

    eng.depth_control.choose = choose
    out = {r.key: r for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    for i, ref in enumerate(refs):
        assert out[i].tokens == ref, (draft_arch, width, compiled, i)
        # the draft model's state is the text's (backlog fed, nothing lost): it drafts the target's tokens
        assert out[i].stats.accepted_tokens == out[i].stats.drafted_tokens, (i, out[i].stats)
    assert sum(r.stats.drafted_tokens for r in out.values()) > 0
    if compiled == "on" and draft_arch == "llama":
        assert eng.drafter.bank.stats["compiled_calls"] > 0
    # forwards: prefills, one per drafting step, and backlog catch-ups: far fewer than rounds
    assert counting.calls < eng.counters.rounds / 2, (counting.calls, eng.counters.rounds)
    cache = eng.drafter.cache
    assert np.array_equal(cache.rows.host, np.array(cache.rows.device))


@pytest.mark.parametrize("draft_arch", ["llama", "qwen3_next"])
@pytest.mark.parametrize("width", [1, 3])
def test_one_token_prompts_start_with_an_empty_draft_cache(tiny_model, draft_arch, width):
    """A one-token prompt leaves the draft model nothing to prefill (its cache holds all prompt
    tokens but the last): the first round feeds that token, beside rows with long prompts."""
    path = tiny_model("qwen3_next") if draft_arch == "qwen3_next" else tiny_model("llama")
    bundle = load(path)
    rows = _rows([1, 9, 1, 1, 20], [8, 6, 10, 3, 7], seed=9)
    eos = set(bundle.tokenizer.eos_token_ids)
    spec = SpeculativeConfig(method="draft", depth=3, adaptive_depth=False, draft_model=str(path))
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    out = {r.key: r for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    for i, (p, m) in enumerate(rows):
        assert out[i].error is None and out[i].tokens == reference_tokens(bundle.model, p, m, eos), i
        assert out[i].stats.accepted_tokens == out[i].stats.drafted_tokens, (i, out[i].stats)
    if draft_arch == "llama":  # a shape first proposed over the empty cache is timed once the cache has entries
        measured = eng.drafter.bank.stats["measured_ms"]
        assert measured and all(np.isfinite(c) for c, _ in measured.values()), measured


@pytest.mark.parametrize("compiled_ms,eager_ms", [(10.0, 1.0), (1.0, 10.0)])
def test_each_shape_drafts_through_the_chain_measured_faster(tiny_model, compiled_ms, eager_ms):
    """The engine's draft drafter times both chains at each shape's first proposal (an injected
    clock, charged per chain: no wall time) and drafts through the faster; the text stays plain
    decoding's either way."""
    path = tiny_model("llama")
    bundle = load(path)
    rows = _rows([4, 17, 9], [30, 24, 18])
    eos = set(bundle.tokenizer.eos_token_ids)
    spec = SpeculativeConfig(method="draft", depth=2, adaptive_depth=False, draft_model=str(path))
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=2, order="input"))
    d, now = eng.drafter, [0.0]
    d.clock = lambda: now[0]
    propose, eager = d.bank.propose, d.eager_chain

    def charged(fn, ms):
        def run(*a, **k):
            now[0] += ms / 1e3
            return fn(*a, **k)
        return run

    d.bank.propose, d.eager_chain = charged(propose, compiled_ms), charged(eager, eager_ms)
    out = {r.key: r for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    for i, (p, m) in enumerate(rows):
        assert out[i].tokens == reference_tokens(bundle.model, p, m, eos), i
    want = compiled_ms < eager_ms
    assert d.compiled_pays and set(d.compiled_pays.values()) == {want}, d.compiled_pays
    measured = d.bank.stats["measured_ms"]
    assert all(v == pytest.approx((compiled_ms, eager_ms)) for v in measured.values()), measured
    shapes = len(d.compiled_pays)
    if want:  # every round compiled, besides the 4 timing calls of each shape
        assert d.bank.stats["eager_calls"] == 0
    else:  # only the timing ran the compiled chain
        assert d.bank.stats["compiled_calls"] == 4 * shapes and d.bank.stats["eager_calls"] > 0
