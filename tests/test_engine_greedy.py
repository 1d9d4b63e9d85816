"""Greedy speculative decoding is token-identical to greedy plain decoding.

Reference: mlx-lm's own `generate_step`, one row at a time, stopping at eos (which is not
emitted), as the engine does. Every family (llama, qwen3, qwen3_next hybrid, deepseek_v3 MLA),
every method at depth 1-6 with a fixed depth (`adaptive_depth=False`):
- ngram (prompt lookup);
- draft with a different-seed model of the same family and tokenizer (rejects almost
  everything) and with the target's own weights (accepts everything);
- mtp, for the families that ship MTP weights (qwen3_next, deepseek_v3);
- an oracle drafter that knows the reference continuation and is wrong exactly at a chosen
  position: always at the first (every draft rejected, every round), or at a position that
  cycles over 0..K per round and per row (every partial-accept count, rows of one batch
  committing different counts; on qwen3_next this drives the recurrent-state rollback).
Rows have different prompt lengths and max_tokens; the batch is narrower than the row count
for some runs, so rows join as others finish. The verify runs compiled (`on`, the default) or
eagerly (`off`), alternating with the depth.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.drafting.ngram import NgramDrafter
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from tiny_models import reference_tokens

FAMILIES = ["llama", "qwen3", "qwen3_next", "deepseek_v3"]
MTP_FAMILIES = {"qwen3_next", "deepseek_v3"}
DEPTHS = [1, 2, 3, 4, 5, 6]
PROMPTS = [
    ("def fibonacci(n):\n    if n < 2:\n        return n\n    return", 12),
    ("import os", 9),
    ("the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick", 24),
    (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
        "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
        11,
    ),
    ("Question: What is the capital of France?\nAnswer:", 7),
]
MAX_BATCH = 3  # fewer slots than rows: continuous batching is part of every run



class Ctx:
    def __init__(self, tiny_model, family):
        self.family = family
        self.path = tiny_model(family)
        self.other = tiny_model(family, seed=1)
        self.bundle = load(self.path)
        tok = self.bundle.tokenizer
        self.eos = set(tok.eos_token_ids)
        self.prompts = [tok.encode(p) for p, _ in PROMPTS]
        self.max_tokens = [m for _, m in PROMPTS]
        # long enough for an oracle to draft past any row's end
        self.long_refs = [
            reference_tokens(self.bundle.model, p, m + max(DEPTHS) + 2, self.eos)
            for p, m in zip(self.prompts, self.max_tokens)
        ]
        self.refs = [r[:m] for r, m in zip(self.long_refs, self.max_tokens)]

    def requests(self):
        return [
            Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m))
            for i, (p, m) in enumerate(zip(self.prompts, self.max_tokens))
        ]

    def run(self, method, depth, compiled="off", drafter=None, draft_model=None, max_batch=MAX_BATCH):
        spec = SpeculativeConfig(
            method=method, depth=depth, adaptive_depth=False, compiled_verify=compiled,
            draft_model=str(draft_model) if draft_model else None,
        )
        eng = Engine(self.bundle, spec, ScheduleConfig(max_batch=max_batch), drafter=drafter)
        results = {r.key: r for r in eng.generate(self.requests())}
        assert sorted(results) == list(range(len(PROMPTS)))
        return eng, [results[i] for i in range(len(PROMPTS))]

    def check_identical(self, results, label):
        for i, (res, ref, m) in enumerate(zip(results, self.refs, self.max_tokens)):
            assert res.error is None, res.error
            assert res.tokens == ref, f"{self.family} {label}: row {i} differs\n ref {ref}\n got {res.tokens}"
            assert res.finish_reason == ("length" if len(ref) == m else "stop")
            assert res.stats.completion_tokens == len(ref)


@pytest.fixture(scope="module", autouse=True)
def _load_each_draft_once():
    """Engines load their draft model by path; load each once for this module (read-only use)."""
    import mtplx.models.loading

    real, loaded = mtplx.models.loading.load, {}

    def cached(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = real(path, *args, **kwargs)
        return loaded[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(mtplx.models.loading, "load", cached)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def ctx(tiny_model):
    built = {}

    def get(family):
        if family not in built:
            built[family] = Ctx(tiny_model, family)
        return built[family]

    return get


class OracleDrafter(NgramDrafter):
    """Drafts the reference continuation, made wrong from position m(round, slot) on.

    Records, for every row and round where the reference covers the drafts, the count it
    expects the engine to accept and the count the engine did accept.
    """

    def __init__(self, ctx: Ctx, wrong_at):
        super().__init__()
        self.long = {tuple(p): r for p, r in zip(ctx.prompts, ctx.long_refs)}
        self.budget = {tuple(p): m for p, m in zip(ctx.prompts, ctx.max_tokens)}
        self.vocab = ctx.bundle.model.model.embed_tokens.weight.shape[0]
        self.wrong_at = wrong_at
        self.round = 0
        self.expected = []
        self.checked = []  # (expected, accepted) per row and round

    def prefill_row(self, tokens, hidden, first_token, prefix=None, edge=0):
        return {"ref": self.long[tuple(tokens)], "out": [int(first_token)], "max_tokens": self.budget[tuple(tokens)]}

    def propose(self, K, pending, sampler, u):
        drafts = np.zeros((len(self.rows), K), dtype=np.int32)
        self.expected = [None] * len(self.rows)
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            done = len(row["out"])
            cont = row["ref"][done : done + K]
            m = self.wrong_at(self.round, i, K)
            if len(cont) == K:
                drafts[i] = cont[:m] + [(t + 1) % self.vocab for t in cont[m:]]
                # a row never keeps more drafts than it has tokens left to emit after them
                self.expected[i] = min(m, row["max_tokens"] - done - 1)
            else:  # past the reference's end (eos): anything goes, nothing to check
                drafts[i] = 3
        self.round += 1
        return mx.array(drafts), None

    def commit(self, n_accept, next_tokens, drafts, active, verify_in=None, hidden=None):
        for i, row in enumerate(self.rows):
            if row is None or not active[i]:
                continue
            if drafts.shape[1] and self.expected[i] is not None:
                self.checked.append((self.expected[i], int(n_accept[i])))
            row["out"] += [int(t) for t in drafts[i, : n_accept[i]]] + [int(next_tokens[i])]
        self.expected = [None] * len(self.rows)


def _compiled_mode(depth):
    return "on" if depth % 2 else "off"


def _check_verify_path(results, compiled):
    comp = sum(r.stats.compiled_verify_calls for r in results)
    eager = sum(r.stats.eager_verify_calls for r in results)
    if compiled == "on":
        assert comp > 0, "compiled_verify: on never ran a compiled verify"
    else:
        assert comp == 0 and eager > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_engine_matches_mlx_lm(ctx, family):
    c = ctx(family)
    _, results = c.run("none", 3)
    c.check_identical(results, "none")
    assert all(r.stats.verify_calls == 0 and r.stats.drafted_tokens == 0 for r in results)
    # the rows really do differ in length and end at different times
    assert len({len(r.tokens) for r in results}) > 2


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_identity(ctx, family, depth):
    c = ctx(family)
    compiled = _compiled_mode(depth)
    _, results = c.run("ngram", depth, compiled)
    c.check_identical(results, f"ngram depth {depth}")
    _check_verify_path(results, compiled)
    assert all(r.stats.drafted_tokens > 0 for r in results if len(r.tokens) > 2)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_draft_model_greedy_identity(ctx, family, depth):
    c = ctx(family)
    compiled = _compiled_mode(depth)
    # a different-seed draft: almost every draft rejected
    _, results = c.run("draft", depth, compiled, draft_model=c.other)
    c.check_identical(results, f"draft(other) depth {depth}")
    _check_verify_path(results, compiled)
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert drafted > 0 and accepted / drafted < 0.5
    # the target's own weights as the draft: every draft accepted
    _, results = c.run("draft", depth, compiled, draft_model=c.path)
    c.check_identical(results, f"draft(same) depth {depth}")
    for r in results:
        assert r.stats.accepted_tokens == r.stats.drafted_tokens, (r.key, r.stats)
    assert sum(r.stats.drafted_tokens for r in results) > 0


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("family", sorted(MTP_FAMILIES))
def test_mtp_greedy_identity(ctx, family, depth):
    c = ctx(family)
    compiled = _compiled_mode(depth)
    _, results = c.run("mtp", depth, compiled)
    c.check_identical(results, f"mtp depth {depth}")
    _check_verify_path(results, compiled)
    assert sum(r.stats.drafted_tokens for r in results) > 0


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_draft_rejected(ctx, family, depth):
    c = ctx(family)
    oracle = OracleDrafter(c, lambda rnd, slot, K: 0)
    _, results = c.run("ngram", depth, _compiled_mode(depth + 1), drafter=oracle)
    c.check_identical(results, f"all-rejected depth {depth}")
    assert oracle.checked and all(acc == 0 for _, acc in oracle.checked)
    for r in results:
        assert r.stats.accepted_tokens == 0
        assert r.stats.drafted_tokens > 0 or len(r.tokens) <= 2


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_partial_accept_count(ctx, family, depth):
    c = ctx(family)
    oracle = OracleDrafter(c, lambda rnd, slot, K: (rnd + 2 * slot) % (K + 1))
    _, results = c.run("ngram", depth, _compiled_mode(depth + 1), drafter=oracle)
    c.check_identical(results, f"partial-accept depth {depth}")
    mismatched = [(e, a) for e, a in oracle.checked if e != a]
    assert not mismatched, f"accepted counts differ from the drafts' first wrong position: {mismatched}"
    assert {e for e, _ in oracle.checked} == set(range(depth + 1)), "not every accept count was exercised"


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "oracle"])
def test_greedy_identity_when_rows_stop_at_eos(tiny_model, method):
    """A 16-token model with eos (id 5, a token greedy decoding reaches): rows stop at eos, also when eos comes inside a run
    of accepted drafts or as the bonus token; eos is not emitted and the reason is `stop`."""
    target = tiny_model("small_vocab", eos_token_id=5)
    bundle = load(target)
    eos = set(bundle.tokenizer.eos_token_ids)
    assert eos == {5}
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 16, int(n)).tolist() for n in rng.integers(1, 30, 12)]
    max_tokens = 24
    refs = [reference_tokens(bundle.model, p, max_tokens, eos) for p in prompts]
    # the oracle drafts the text on through eos, so eos arrives inside accepted drafts
    through_eos = [reference_tokens(bundle.model, p, max_tokens + 8, set()) for p in prompts]
    assert sum(len(r) < max_tokens for r in refs) >= 3, "too few rows reach eos to test it"
    for depth in (1, 3, 5):
        spec = SpeculativeConfig(
            method="ngram" if method == "oracle" else method, depth=depth, adaptive_depth=False,
            compiled_verify="off", draft_model=str(target) if method == "draft" else None,
        )
        drafter = None
        if method == "oracle":  # right up to (and through) eos, then wrong
            fake = Ctx.__new__(Ctx)
            fake.prompts, fake.long_refs, fake.bundle = prompts, through_eos, bundle
            fake.max_tokens = [max_tokens] * len(prompts)
            drafter = OracleDrafter(fake, lambda rnd, slot, K: K)
        eng = Engine(bundle, spec, ScheduleConfig(max_batch=5), drafter=drafter)
        reqs = [Request(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
        got = {r.key: r for r in eng.generate(reqs)}
        for i, ref in enumerate(refs):
            assert got[i].tokens == ref, (method, depth, i)
            assert got[i].finish_reason == ("length" if len(ref) == max_tokens else "stop")
