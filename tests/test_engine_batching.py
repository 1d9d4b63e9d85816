"""Continuous batching: every row of a batched run equals its own single-row greedy output.

Rows have very different prompt lengths (1 to ~150 tokens) and max_tokens (1 to 20), so they
finish at different times and new rows take their slots. Widths (`schedule.max_batch`) 1, 2,
7 and 32, every method, on the hybrid qwen3_next (the hardest cache: recurrent state plus
attention KV per row) and on llama. The reference is mlx-lm's `generate_step`, one row alone.

The engine's rounds are observed before every call: how many rows are in flight and whether a
request waits (`drained`, known since the scheduler reads a request ahead when an admission fills
the batch): while requests
remain, every slot must be busy (a finished row's slot is refilled before the next round).
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

N_ROWS = 40
WIDTHS = [1, 2, 7, 32]
NARROW_ROWS = 8  # rows used at widths 1 and 2 (each round is one or two rows: keep it short)



def recording(eng: Engine) -> Engine:
    """Logs (rows in flight, batch width, whether a request waits) in `eng.log` before every call of rounds."""
    eng.log, run = [], eng.rounds.run
    eng.rounds.run = lambda sched: (eng.log.append((sched.live, len(sched.slots), not sched.drained)), run(sched))[1]
    return eng


class OracleDrafter(NgramDrafter):
    """Drafts the reference continuation, wrong from a position that varies by round and slot,
    so rows of one batch keep different counts every round."""

    def __init__(self, refs, vocab):
        super().__init__()
        self.refs, self.vocab, self.round = refs, vocab, 0

    def prefill_row(self, tokens, hidden, first_token, prefix=None, edge=0):
        return {"ref": self.refs[tuple(tokens)], "out": [int(first_token)]}

    def propose(self, K, pending, sampler, u):
        drafts = np.full((len(self.rows), K), 3, dtype=np.int32)
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            cont = row["ref"][len(row["out"]) : len(row["out"]) + K]
            m = (self.round + i) % (K + 1)
            good = cont[:m] + [(t + 1) % self.vocab for t in cont[m:]]
            drafts[i, : len(good)] = good
        self.round += 1
        return mx.array(drafts), None

    def commit(self, n_accept, next_tokens, drafts, active, verify_in=None, hidden=None):
        for i, row in enumerate(self.rows):
            if row is not None and active[i]:
                row["out"] += [int(t) for t in drafts[i, : n_accept[i]]] + [int(next_tokens[i])]


class Family:
    def __init__(self, tiny_model, family):
        self.family = family
        self.bundle = load(tiny_model(family))
        self.draft_path = tiny_model("llama", seed=3)  # a dense draft with the same tokenizer
        tok = self.bundle.tokenizer
        eos = set(tok.eos_token_ids)
        rng = np.random.default_rng(0)
        text = open(__file__).read()
        self.rows = []
        for i in range(N_ROWS):
            n = int(rng.choice([1, 2, 5, 17, 40, 90, 150]))
            start = int(rng.integers(0, len(text) - 2000))
            prompt = tok.encode(text[start : start + 4 * n])[:n]
            if len(prompt) < n:
                prompt = (prompt * n)[:n]
            max_tokens = int(rng.choice([1, 2, 3, 6, 11, 20]))
            self.rows.append((prompt, max_tokens))
        self.long_refs = [reference_tokens(self.bundle.model, p, m + 8, eos) for p, m in self.rows]
        self.refs = [r[:m] for r, (_, m) in zip(self.long_refs, self.rows)]
        assert len({len(p) for p, _ in self.rows}) >= 5 and len({m for _, m in self.rows}) >= 5

    def engine(self, method, width):
        spec = SpeculativeConfig(
            method="ngram" if method == "oracle" else method, depth=3, compiled_verify="on",
            adaptive_depth=False,  # every round drafts: the batching under test is the speculative one
            draft_model=str(self.draft_path) if method == "draft" else None,
        )
        drafter = None
        if method == "oracle":
            vocab = self.bundle.model.model.embed_tokens.weight.shape[0]
            drafter = OracleDrafter({tuple(p): r for (p, _), r in zip(self.rows, self.long_refs)}, vocab)
        return recording(Engine(self.bundle, spec, ScheduleConfig(max_batch=width), drafter=drafter))


@pytest.fixture(scope="module")
def families(tiny_model):
    built = {}

    def get(family):
        if family not in built:
            built[family] = Family(tiny_model, family)
        return built[family]

    return get


CASES = [("qwen3_next", m) for m in ("none", "ngram", "draft", "mtp", "oracle")] + [
    ("llama", m) for m in ("none", "ngram", "draft")
]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("family,method", CASES)
def test_batched_rows_equal_single_row_output(families, family, method, width):
    fam = families(family)
    n_rows = NARROW_ROWS if width <= 2 else N_ROWS
    eng = fam.engine(method, width)
    requests = [
        Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m))
        for i, (p, m) in enumerate(fam.rows[:n_rows])
    ]
    order = []
    results = {}
    for r in eng.generate(requests):
        order.append(r.key)
        results[r.key] = r
    assert sorted(results) == list(range(n_rows))
    for i in range(n_rows):
        r = results[i]
        assert r.error is None, r.error
        assert r.tokens == fam.refs[i], f"{family}/{method} width {width}: row {i} (prompt {len(fam.rows[i][0])} tokens)"
        assert r.finish_reason == ("length" if len(fam.refs[i]) == fam.rows[i][1] else "stop")
    if method != "none":
        assert sum(r.stats.drafted_tokens for r in results.values()) > 0
    # rows finish out of order: a short row admitted late finishes before a long one admitted early
    if width > 1:
        assert order != sorted(order)

    # While requests remain, every slot is busy: finished rows free their slot for the next row.
    assert eng.log, "no decode round ran"
    waiting_rounds = [(n, w) for n, w, waits in eng.log if waits]
    assert waiting_rounds, "the queue never outlasted the batch: nothing to check"
    assert all(n == width for n, w in waiting_rounds), f"idle slots while rows waited: {waiting_rounds}"
    assert max(n for n, _, _ in eng.log) == min(width, n_rows)
    # the per-row stat agrees: rows that ran entirely while the queue was full saw the full width
    if width > 1:
        assert max(r.stats.batch_width for r in results.values()) == width


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "mtp"])
def test_greedy_rows_stay_exact_next_to_sampled_rows(families, method):
    """A batch that mixes greedy and sampled rows takes the sampled acceptance path for all
    rows; the greedy rows must still equal their single-row greedy output."""
    fam = families("qwen3_next")
    eng = fam.engine(method, 7)
    requests = []
    for i, (p, m) in enumerate(fam.rows[:16]):
        params = SamplingParams(max_tokens=m) if i % 2 == 0 else SamplingParams(max_tokens=m, temperature=1.0, top_p=0.9)
        requests.append(Request(key=i, prompt_tokens=list(p), params=params, seed=i))
    results = {r.key: r for r in eng.generate(requests)}
    for i in range(0, 16, 2):
        assert results[i].tokens == fam.refs[i], f"greedy row {i} changed next to sampled rows ({method})"
    for i in range(1, 16, 2):
        assert results[i].error is None and len(results[i].tokens) <= fam.rows[i][1]
