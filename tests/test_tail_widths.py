"""A drained batch's tail: once half its slots are idle it moves to the narrowest power of two that
holds its live rows, where a round's cost follows its width (a CPU); on a GPU it keeps its width
(`tail_keeps_width`). Rows keep their own slots' state, generators and positions
(BatchCache.take_rows): greedy output is plain decoding's, and a sampled row's text is its seed's,
narrowed or not.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx import scheduler
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens, untrained_head

WIDTH = 8


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    bundle = load(tiny_model("llama"))
    head = untrained_head(bundle, tmp_path_factory.mktemp("head"))
    draft = tiny_model("llama", seed=1)
    rng = np.random.default_rng(5)
    # 12 rows at width 8: rows end at different rounds, the last ones after the source is drained
    rows = [(rng.integers(3, 400, int(n)).tolist(), int(m))
            for n, m in zip([5, 30, 9, 14, 3, 22, 7, 11, 18, 4, 26, 8], [2, 15, 4, 11, 6, 20, 3, 9, 13, 5, 24, 7])]
    eos = set(bundle.tokenizer.eos_token_ids)
    return bundle, {"mtp": str(head), "draft": str(draft)}, rows, [reference_tokens(bundle.model, p, m, eos) for p, m in rows]


def _run(setup, method, keeps, monkeypatch, **sampling):
    """Results by key and the widths the rounds ran at, with the tail kept at `keeps` rows or wider."""
    bundle, paths, rows, _ = setup
    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: keeps)
    lookup = method == "mtp-lookup"  # MTP with prompt lookup on the device (speculative.mtp_lookup)
    method = "mtp" if lookup else method
    spec = SpeculativeConfig(method=method, depth=3, adaptive_depth=False, mtp_head=paths["mtp"] if method == "mtp" else None,
                             draft_model=paths["draft"] if method == "draft" else None, mtp_lookup=2 if lookup else 0)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=WIDTH, order="input"))
    widths, run = [], eng.rounds.run
    eng.rounds.run = lambda sched: (widths.append(len(sched.slots)), run(sched))[1]
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m, **sampling), seed=7 + i)
            for i, (p, m) in enumerate(rows)]
    return {r.key: r.tokens for r in eng.generate(reqs)}, set(widths)


@pytest.mark.parametrize("method", ["none", "ngram", "mtp", "mtp-lookup", "draft"])
def test_a_narrowed_tail_decodes_as_plain(setup, method, monkeypatch):
    _, _, rows, refs = setup
    out, widths = _run(setup, method, 1, monkeypatch)
    assert [out[i] for i in range(len(rows))] == refs
    assert WIDTH in widths and min(widths) < WIDTH, widths


@pytest.mark.parametrize("method", ["none", "ngram", "mtp", "mtp-lookup", "draft"])
def test_a_sampled_row_keeps_its_text_in_a_narrowed_tail(setup, method, monkeypatch):
    """A sampled row's text depends on its seed alone: the same with the tail kept at its width
    (whose sampled output is distribution-tested, test_engine_sampling.py) and narrowed."""
    texts = []
    for keeps in (WIDTH, 1):
        out, widths = _run(setup, method, keeps, monkeypatch, temperature=1.0, top_p=0.9)
        assert (min(widths) < WIDTH) == (keeps == 1), widths
        texts.append(out)
    assert texts[0] == texts[1]


def test_the_widths(monkeypatch):
    free = scheduler.Memory(budget=1, ahead=0, slot=lambda reach: 0, prefill=lambda rows: 0, kept=lambda: 0)
    sched = scheduler.Scheduler(None, set(), 64, 100, free)

    def target(live, width):
        sched.slots = [None] * width
        return sched.narrows(live)

    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: 1)
    assert target(3, 32) == 4 and target(16, 32) == 16 and target(17, 32) is None and target(1, 2) == 1
    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: 32)
    assert target(3, 32) is None and target(3, 64) == 4
    # narrowing copies the live rows while the wide batch is held: only where both fit the budget
    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: 1)
    sched.memory = free._replace(budget=35, slot=lambda reach: 1)
    assert target(3, 32) is None and target(2, 16) == 2
