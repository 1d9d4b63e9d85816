"""CompiledVerifyBank: parity modes, a perturbed compiled program, 6-bit permanent eager.

- `compiled_verify: parity` runs every verify compiled and eagerly and raises on a difference:
  it passes on qwen3 and the hybrid qwen3_next, and raises `CompiledVerifyParityError` once the
  compiled program's logits are perturbed (scaled by 1 + 1e-3: the argmax is unchanged, the
  logits are not).
- `parity2` keeps the compiled result and counts the same perturbation instead: bank stats and
  each row's `parity_failures`, with the text still equal to plain decoding.
- A 6-bit quantized model verifies eagerly for its whole life (`permanent_eager`) and its
  greedy output equals plain decoding of the same quantized model.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtplx.cache import BatchCache, layer_kinds
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.graphbank import CompiledVerifyBank, CompiledVerifyParityError
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from tiny_models import reference_tokens

PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
    "import os",
]
MAX_TOKENS = [10, 7, 9]



class Target:
    def __init__(self, bundle):
        self.bundle = bundle
        tok = bundle.tokenizer
        self.prompts = [tok.encode(p) for p in PROMPTS]
        eos = set(tok.eos_token_ids)
        self.refs = [reference_tokens(bundle.model, p, m, eos) for p, m in zip(self.prompts, MAX_TOKENS)]

    def engine(self, mode, method="ngram", depth=3, perturb=False):
        spec = SpeculativeConfig(method=method, depth=depth, adaptive_depth=False, compiled_verify=mode)
        eng = Engine(self.bundle, spec, ScheduleConfig(max_batch=len(PROMPTS)))
        if perturb:
            _perturb(eng.bank)
        return eng

    def run(self, eng):
        reqs = [Request(i, list(p), SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(zip(self.prompts, MAX_TOKENS))]
        out = {r.key: r for r in eng.generate(reqs)}
        return [out[i] for i in range(len(PROMPTS))]

    def check(self, results):
        for r, ref in zip(results, self.refs):
            assert r.error is None and r.tokens == ref


def _compiled_outputs(bank, change):
    """Make every compiled program of `bank` return `change(its outputs)`."""
    real = bank.programs.call

    def call(key, build, *args):
        out = real(key, build, *args)
        return None if out is None else change(list(out))

    bank.programs.call = call


def _perturb(bank):
    """Make every compiled program return slightly scaled logits (the argmax is unchanged)."""
    _compiled_outputs(bank, lambda out: (out[0] * (1 + 1e-3),) + tuple(out[1:]))


@pytest.fixture(scope="module")
def targets(tiny_model):
    built = {}

    def get(family):
        if family not in built:
            built[family] = Target(load(tiny_model(family)))
        return built[family]

    return get


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_parity_passes(targets, family):
    t = targets(family)
    eng = t.engine("parity")
    results = t.run(eng)
    t.check(results)
    stats = eng.bank.stats
    assert stats["compiled_calls"] > 0 and stats["parity_failures"] == 0, stats
    assert not eng.bank.permanent_eager
    assert all(r.stats.parity_failures == 0 for r in results)
    assert sum(r.stats.compiled_verify_calls for r in results) > 0


def test_parity_raises_on_a_perturbed_compiled_program(targets):
    t = targets("qwen3")
    eng = t.engine("parity", perturb=True)
    with pytest.raises(CompiledVerifyParityError, match="compiled verify differs from eager"):
        t.run(eng)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_parity_raises_when_the_compiled_program_writes_a_different_cache(targets, family):
    """Logits right, cache wrong (attention values / captured recurrent states scaled): the
    next verify would read the same wrong cache on both paths, so parity compares the cache
    the program writes as well."""
    t = targets(family)
    eng = t.engine("parity")
    kinds = len(layer_kinds(eng.model))

    def bad_cache(out):
        for i in range(kinds):
            out[2 + 2 * i + 1] = out[2 + 2 * i + 1] * 1.05  # values (kv) or states (gdn)
        return tuple(out)

    _compiled_outputs(eng.bank, bad_cache)
    with pytest.raises(CompiledVerifyParityError, match="cache"):
        t.run(eng)


def test_parity2_counts_instead_of_raising(targets):
    t = targets("qwen3")
    eng = t.engine("parity2", perturb=True)
    results = t.run(eng)
    t.check(results)  # compiled stays authoritative; the perturbation keeps every argmax
    stats = eng.bank.stats
    assert stats["compiled_calls"] > 0
    assert stats["parity_failures"] >= sum(r.stats.parity_failures for r in results) > 0
    for r in results:
        # every compiled verify of every row differed from eager
        assert r.stats.compiled_verify_calls > 0
        assert r.stats.parity_failures == r.stats.compiled_verify_calls
    # unperturbed parity2: nothing counted
    eng = t.engine("parity2")
    results = t.run(eng)
    t.check(results)
    assert eng.bank.stats["parity_failures"] == 0 and all(r.stats.parity_failures == 0 for r in results)


def _rounds(r):
    """Decode rounds of a plain-decoded row: one token each, plus the round that drew EOS."""
    return len(r.tokens) - 1 + (r.finish_reason == "stop")


def test_parity2_counts_plain_rounds_per_row(targets):
    """Plain decoding goes through the bank too: each row's parity failures and compiled calls
    are recorded for every round, drafting or not."""
    t = targets("qwen3")
    eng = t.engine("parity2", method="none", perturb=True)
    results = t.run(eng)
    t.check(results)
    for r in results:
        assert r.stats.verify_calls == 0
        assert r.stats.compiled_verify_calls == _rounds(r) > 0
        assert r.stats.parity_failures == r.stats.compiled_verify_calls
    assert eng.bank.stats["parity_failures"] >= sum(r.stats.parity_failures for r in results)
    eng = t.engine("off", method="none")
    for r in t.run(eng):
        assert r.stats.compiled_verify_calls == 0 and r.stats.eager_verify_calls == _rounds(r)


def test_parity2_counts_rounds_that_drafted_nothing(targets):
    """max_tokens 2: the prefill gives the first token and the one round left drafts nothing
    (a row never drafts past its own max_tokens); that round still ran through the bank."""
    t = targets("qwen3")
    eng = t.engine("parity2", perturb=True)
    reqs = [Request(i, list(p), SamplingParams(max_tokens=2)) for i, p in enumerate(t.prompts)]
    results = list(eng.generate(reqs))
    assert len(results) == len(t.prompts)
    for r in results:
        assert r.stats.drafted_tokens == 0 and r.stats.verify_calls == 0
        assert r.stats.compiled_verify_calls == _rounds(r) == 1
        assert r.stats.parity_failures == 1


@pytest.fixture(scope="module")
def six_bit(tiny_model):
    bundle = load(tiny_model("llama"))  # every input dim (64, 128) divides the group size
    nn.quantize(bundle.model, group_size=32, bits=6)
    mx.eval(bundle.model.parameters())
    return Target(bundle)


@pytest.mark.parametrize("mode", ["on", "parity"])
def test_six_bit_model_verifies_eagerly_and_exactly(six_bit, mode):
    t = six_bit
    assert any(isinstance(m, nn.QuantizedLinear) and m.bits == 6 for _, m in t.bundle.model.named_modules())
    eng = t.engine(mode)
    assert eng.bank.permanent_eager
    results = t.run(eng)
    t.check(results)  # equal to mlx-lm's plain decoding of the same quantized model
    stats = eng.bank.stats
    assert stats["compiled_calls"] == 0 and stats["fallback_calls"] > 0
    assert any("6-bit" in reason for reason in stats["fallback_reasons"])
    for r in results:
        assert r.stats.compiled_verify_calls == 0
        assert r.stats.eager_verify_calls > 0 or len(r.tokens) <= 1
    assert sum(r.stats.drafted_tokens for r in results) > 0


def test_other_widths_are_not_permanent_eager(tiny_model):
    class Rt:
        def __init__(self, model):
            self.model = model

    for bits in (4, 8):
        model = load(tiny_model("llama")).model
        nn.quantize(model, group_size=32, bits=bits)
        assert not CompiledVerifyBank(Rt(model), 4).permanent_eager


def test_verify_longer_than_the_growth_budget_falls_back(monkeypatch, targets):
    t = targets("qwen3")
    monkeypatch.setenv("MTPLX_COMPILED_VERIFY_MAX_LEN", "2")

    class Rt:
        model = t.bundle.model

        def forward(self, tokens, cache):
            return self.model(tokens, cache=cache.layers), None

    bank = CompiledVerifyBank(Rt(), max_verify_len=2)
    assert bank.growth_limit == 2
    cache = BatchCache.for_model(t.bundle.model, 1)
    t.bundle.model(mx.array([t.prompts[0]]), cache=cache.layers)
    cache.commit([len(t.prompts[0])])
    logits, _, compiled, _ = bank.verify(mx.array([[5, 6, 7, 8]], dtype=mx.int32), cache)
    assert not compiled and logits.shape[:2] == (1, 4)
    assert bank.stats["fallback_calls"] == 1
    assert any("MTPLX_COMPILED_VERIFY_MAX_LEN" in r for r in bank.stats["fallback_reasons"])


class _Rt:
    def __init__(self, model):
        self.model = model

    def forward(self, tokens, cache):
        return self.model(tokens, cache=cache.layers), None


@pytest.mark.parametrize("family, backend", [("qwen3", None), ("qwen3_next", "gdn")])
def test_capture_backend_is_checked_against_the_model_and_reported(targets, family, backend):
    t = targets(family)
    eng = t.engine("on")
    assert eng.bank.capture_backend == backend and eng.bank.stats["capture_backend"] == backend
    wrong = "gdn" if backend is None else None
    with pytest.raises(ValueError, match=rf"capture_backend={wrong!r} but the model's layers use {backend!r}"):
        CompiledVerifyBank(_Rt(t.bundle.model), 4, capture_backend=wrong)


def test_a_verify_past_the_growth_budget_compiles_no_larger_program(targets):
    """request_max_tokens is the growth budget: within it the verify is compiled; a row whose
    context plus verify length is past it runs eagerly, with the reason, and makes no program."""
    t = targets("qwen3")
    prompt = t.prompts[0]
    verify = mx.array([[5, 6, 7, 8]], dtype=mx.int32)
    for budget, compiled_expected in ((len(prompt) + 4, True), (len(prompt) - 8 - 1, False)):
        cache = BatchCache.for_model(t.bundle.model, 1)
        t.bundle.model(mx.array([prompt]), cache=cache.layers)
        cache.commit([len(prompt)])
        bank = CompiledVerifyBank(_Rt(t.bundle.model), max_verify_len=4, request_max_tokens=budget, growth_limit=8)
        assert bank.stats["request_max_tokens"] == budget
        logits, _, compiled, _ = bank.verify(verify, cache)
        assert compiled is compiled_expected and logits.shape[:2] == (1, 4)
        assert len(bank.programs.built) == (1 if compiled_expected else 0)
        if not compiled_expected:
            assert any("growth budget" in r for r in bank.stats["fallback_reasons"]), bank.stats


def test_the_engine_passes_the_longest_context_a_row_can_reach(targets):
    t = targets("qwen3")
    eng = t.engine("on")
    assert eng.bank.request_max_tokens == eng.max_context  # before any row: the model's context
    t.check(t.run(eng))
    want = max(len(p) + m for p, m in zip(t.prompts, MAX_TOKENS))
    assert eng.bank.request_max_tokens == want == eng.bank.stats["request_max_tokens"]
    assert eng.bank.stats["compiled_calls"] > 0 and eng.bank.stats["fallback_calls"] == 0, eng.bank.stats


def test_restored_tokens_count_the_prompt_tokens_the_prefix_store_restored(targets):
    t = targets("qwen3")
    eng = t.engine("on")
    assert CompiledVerifyBank(_Rt(t.bundle.model), 4, restored_tokens=7).stats["restored_tokens"] == 7
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 500, 24).tolist()
    rows = [prefix + rng.integers(3, 500, n).tolist() for n in (5, 9, 7)]
    reqs = [Request(i, p, SamplingParams(max_tokens=4), stable_prefix_len=len(prefix)) for i, p in enumerate(rows)]
    results = list(eng.generate(reqs))
    restored = sum(r.stats.cached_prompt_tokens for r in results)
    assert restored == len(prefix) * (len(rows) - 1)
    assert eng.bank.stats["restored_tokens"] == eng.bank.restored_tokens == restored
