"""Memory admission under `schedule.memory_budget`, checked against what MLX really holds.

The batch is a rectangle: every slot is sized to the longest context a row admitted into it can
reach (scheduler.py). So one long row among short ones is the case to get right: under a budget a
few times what the long row really takes alone, the caches' real bytes (the target's, the
drafter's, the prefix store's), sampled at every round, and MLX's peak memory over the run (less
what it held before the run: the weights) stay within the budget, for plain decoding and for each
drafter that keeps caches of its own; every row comes back once with plain decoding's text. A row
that cannot fit alone is an error row naming the budget it needs, and a batch whose reach outlived
its long row is rebuilt to its width.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from tiny_models import reference_tokens, untrained_head

LONG = 3  # where the long row comes among the short ones


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    bundle = load(tiny_model("llama"))
    paths = {"mtp": str(untrained_head(bundle, tmp_path_factory.mktemp("head"))), "draft": str(tiny_model("llama", seed=1))}
    rng = np.random.default_rng(3)
    rows = [(rng.integers(3, 500, 6).tolist(), 8) for _ in range(15)]
    rows.insert(LONG, (rng.integers(3, 500, 300).tolist(), 600))
    eos = set(bundle.tokenizer.eos_token_ids)
    return bundle, paths, rows, [reference_tokens(bundle.model, p, m, eos) for p, m in rows]


def _engine(setup, method, budget, max_batch=16):
    bundle, paths, _, _ = setup
    spec = SpeculativeConfig(method=method, depth=2, adaptive_depth=False, mtp_head=paths.get("mtp") if method == "mtp" else None,
                             draft_model=paths["draft"] if method == "draft" else None)
    # prefill spans fixed: their size would otherwise follow the budget
    return Engine(bundle, spec, ScheduleConfig(max_batch=max_batch, memory_budget=budget, prefill_chunk=128, order="input"))


def _held(eng) -> int:
    """The bytes of every cache the engine holds now: the batch's, the drafter's state, the prefix store."""
    sched = eng.scheduler
    held = sched.cache.nbytes if sched.cache is not None else 0
    held += sum(a.nbytes for a in eng.drafter.state_arrays()) if eng.drafter is not None else 0
    return held + sum(prefix.nbytes for prefix, _ in eng.prefiller.store.values())


def _run(eng, rows):
    """(results by key, the most cache bytes held at a round, MLX's peak over the run, widths of the
    rounds with the long row in flight, widths of those after it)."""
    most, beside, after = [0], [], []
    read, run = eng.rounds.read, eng.rounds.run

    def sampled(flight):
        most[0] = max(most[0], _held(eng))
        return read(flight)

    def logged(sched):
        keys = [s.req.key for s in sched.slots if s is not None]
        (beside if LONG in keys else after if LONG in done else []).append(len(sched.slots))
        return run(sched)

    eng.rounds.read, eng.rounds.run = sampled, logged
    requests = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    done = {}
    for r in eng.generate(requests):
        done[r.key] = r
    mx.synchronize()
    return done, most[0], mx.get_peak_memory() - base, beside, after


def _alone(setup, method) -> int:
    """MLX's peak memory running the long row alone, under no budget to speak of."""
    rows = setup[2]
    return _run(_engine(setup, method, 2**34), [rows[LONG]])[2]


@pytest.mark.parametrize("method", ["none", "mtp", "draft"])
def test_one_long_row_among_short_ones_stays_within_the_budget(setup, method):
    _, _, rows, refs = setup
    budget = int(2.5 * _alone(setup, method))
    done, held, peak, beside, _ = _run(_engine(setup, method, budget), rows)
    assert sorted(done) == list(range(len(rows)))
    for i, ref in enumerate(refs):
        assert done[i].error is None and done[i].tokens == ref, f"row {i}: {done[i].error}"
    assert held <= budget, f"{method}: caches of {held} bytes under a budget of {budget}"
    assert peak <= budget, f"{method}: MLX's peak {peak} bytes over a budget of {budget}"
    assert beside, "the long row never ran"


def test_a_batch_gets_its_width_back_after_its_long_row(setup):
    """Beside the long row the batch is narrow (its slots are as long as the long row's reach); once it
    is done, the batch is rebuilt around the short rows left, wider."""
    rows = setup[2]
    budget = int(2.5 * _alone(setup, "none"))
    _, _, _, beside, after = _run(_engine(setup, "none", budget), rows)
    assert beside and after and max(after) > max(beside), (beside, after)


def test_a_row_that_never_fits_is_an_error_naming_the_budget(setup):
    rows = setup[2]
    eng = _engine(setup, "none", 600 * 1024)
    done = _run(eng, rows[LONG : LONG + 2])[0]
    error = done[0].error
    assert done[0].finish_reason == "error" and done[1].error is None
    need = re.search(r"schedule.memory_budget is 600 KiB: raise schedule.memory_budget to at least ([\d.]+) (KiB|MiB)", error)
    assert need and float(need.group(1)) * {"KiB": 1, "MiB": 1024}[need.group(2)] > 600, error


@pytest.mark.parametrize("method", ["none", "ngram"])
@pytest.mark.parametrize("rows_worth", [1, 2, 4])
def test_every_row_comes_back_once_under_a_budget(setup, method, rows_worth):
    """Budgets of 1, 2 and 4 times what the longest short row needs alone: each row once, its own text."""
    _, _, rows, refs = setup
    short = [r for i, r in enumerate(rows) if i != LONG]
    eng = _engine(setup, method, 2**34)
    need = max(eng.scheduler.alone(eng.scheduler.new_row(Request(key=0, prompt_tokens=p, params=SamplingParams(max_tokens=m)))[0])
               for p, m in short)
    done, held, _, _, _ = _run(_engine(setup, method, rows_worth * need), short)
    assert sorted(done) == list(range(len(short)))
    assert [done[i].tokens for i in range(len(short))] == [ref for i, ref in enumerate(refs) if i != LONG]
    assert held <= rows_worth * need
