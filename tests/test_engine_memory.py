"""Memory admission: under any `schedule.memory_budget` every row comes back exactly once.

A row that fits alone but not beside the rows in flight waits for a slot; the rows admitted
before it in the same pass still run (they were taken from the source). Budgets from 1 to 8
rows' worth, rows of mixed prompt lengths and max_tokens, plain and speculative decoding. The
engine's rounds are observed before every call: the rows in flight's cache estimate never exceeds
the budget.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from tiny_models import reference_tokens


def in_flight(eng: Engine) -> Engine:
    """Logs (rows in flight, their cache bytes) in `eng.log` before every call of rounds."""
    eng.log, run = [], eng.rounds.run

    def logged(sched):
        live = [s for s in sched.slots if s is not None]
        eng.log.append((len(live), sum(eng.row_bytes(len(s.req.prompt_tokens), s.max_tokens) for s in live)))
        return run(sched)

    eng.rounds.run = logged
    return eng


@pytest.fixture(scope="module")
def setup(tiny_model):
    bundle = load(tiny_model("llama"))
    rng = np.random.default_rng(7)
    text = open(__file__).read()
    tok = bundle.tokenizer
    rows = []
    for _ in range(14):
        n = int(rng.choice([3, 9, 30, 70]))
        start = int(rng.integers(0, len(text) - 600))
        prompt = (tok.encode(text[start : start + 6 * n]) * n)[:n]
        rows.append((prompt, int(rng.choice([2, 5, 9]))))
    eos = set(tok.eos_token_ids)
    refs = [reference_tokens(bundle.model, p, m, eos) for p, m in rows]
    return bundle, rows, refs


@pytest.mark.parametrize("method", ["none", "ngram"])
@pytest.mark.parametrize("rows_worth", range(1, 9))
def test_every_row_comes_back_once_under_a_memory_budget(setup, method, rows_worth):
    bundle, rows, refs = setup
    spec = SpeculativeConfig(method=method, depth=2)
    probe = Engine(bundle, spec, ScheduleConfig(max_batch=8))
    sizes = [probe.row_bytes(len(p), m) for p, m in rows]
    budget = rows_worth * max(sizes)
    eng = in_flight(Engine(bundle, spec, ScheduleConfig(max_batch=8, memory_budget=budget)))
    requests = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    keys = [r.key for r in eng.generate(requests)]
    assert sorted(keys) == list(range(len(rows))), f"rows lost or doubled at {rows_worth} rows' worth: {sorted(keys)}"
    assert eng.log, "no decode round ran"
    assert all(b <= budget for _, b in eng.log), f"in flight over the budget {budget}: {max(b for _, b in eng.log)}"
    most = max(n for n, _ in eng.log)
    assert most <= min(8, budget // min(sizes))
    if rows_worth >= 2:
        assert most >= min(rows_worth, 8), f"budget for {rows_worth} rows, at most {most} ran together"


def test_budgeted_rows_keep_their_text(setup):
    bundle, rows, refs = setup
    spec = SpeculativeConfig(method="ngram", depth=2)
    budget = 3 * max(Engine(bundle, spec).row_bytes(len(p), m) for p, m in rows)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=8, memory_budget=budget))
    requests = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    results = {r.key: r for r in eng.generate(requests)}
    for i, ref in enumerate(refs):
        assert results[i].error is None and results[i].tokens == ref, f"row {i}"
