"""What a fresh MTP run builds: each program a compiled bank builds is a trace, a graph and, on a GPU,
kernel loads, paid again in every process, so a run builds only what its rounds run.

- a batch holding a job's last rows (an 8-row job at max_batch 8) knows from its first round that it is
  drained (an admission that fills the batch reads a request ahead), and adaptive depth tries no
  other depth there;
- a batch's caches are grown once, to what its rows can reach, so its programs have one capacity;
- the head's commits of rounds without drafts run in the deepest round's commit program.
Every run gives plain decoding's text.
"""

from __future__ import annotations

import numpy as np

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.depth import UNTRIED_SLOPE
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens


def _mtp_run(tiny_model, tmp_path, rows, width, adaptive=True):
    from test_mtp_draft import _sidecar

    bundle = load(tiny_model("llama"))
    head = _sidecar(bundle, tmp_path / "head")
    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=adaptive, mtp_head=head)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    eng.depth_control.slope = UNTRIED_SLOPE  # adaptive depth drafts before a round is timed, as on a GPU
    chosen, choose = [], eng.depth_control.choose
    eng.depth_control.choose = lambda w, **k: chosen.append(choose(w, **k)) or chosen[-1]
    out = {r.key: r.tokens for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    eos = set(bundle.tokenizer.eos_token_ids)
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eos), i
    return eng, chosen


def _rows(n, prompt=6, tokens=30, seed=5):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 400, prompt).tolist(), tokens) for _ in range(n)]


def _keys(eng) -> list:
    return list(eng.bank.programs.built) + list(eng.drafter.bank.programs.built)


def test_a_batch_of_the_jobs_last_rows_tries_no_other_depth(tiny_model, tmp_path):
    """Two rows at width 2, all of the job: no first plain rounds, no try of another depth (the depth
    moves only as the rows' own acceptance of the untrained head says)."""
    eng, chosen = _mtp_run(tiny_model, tmp_path, _rows(2), width=2)
    assert eng.depth_control.widths == {}, eng.depth_control.widths  # no try was ever scheduled
    assert chosen[:3] == [3, 3, 3] and chosen == sorted(chosen, reverse=True), chosen


def test_the_peek_keeps_the_rows_and_their_order(tiny_model, tmp_path):
    """More rows than the width: the request read ahead by the peek is the next one admitted (every row
    comes out, as plain decoding writes it), and the batch explores while rows wait."""
    eng, chosen = _mtp_run(tiny_model, tmp_path, _rows(5), width=2)
    assert eng.depth_control.widths, "rows were waiting: adaptive depth explores"


def _capacities(eng) -> set:
    """The cache capacities of the programs built (verify keys: (W, L, capacity, ...); head keys:
    (kind, W, K or K1, capacity, ...))."""
    return {k[2] for k in eng.bank.programs.built} | {k[3] for k in eng.drafter.bank.programs.built}


def test_a_batch_runs_at_one_capacity_when_its_rows_cross_a_bucket(tiny_model, tmp_path):
    """Rows of 200 prompt tokens and 80 new ones cross 256 cache entries mid-run: the caches are grown at
    the first round to what the rows can reach, so every program has one capacity (not 256, then all
    again at 512)."""
    rows = _rows(2, prompt=200, tokens=80)
    eng, _ = _mtp_run(tiny_model, tmp_path, rows, width=2, adaptive=False)
    assert _capacities(eng) == {512}, _keys(eng)


def test_commits_of_rounds_without_drafts_run_in_the_deepest_rounds_program(tiny_model, tmp_path):
    """Depth 3 with stretches at depth 0 (adaptive depth's tries of plain decoding): the head's catch-ups
    and the rounds that draft again after them commit through the programs of a depth-3 round's commit
    (4 verified tokens), padded (no programs of 1, 2 and 3 tokens), and the text is plain decoding's."""
    from test_mtp_draft import _sidecar

    bundle = load(tiny_model("llama"))
    eos = set(bundle.tokenizer.eos_token_ids)
    head = _sidecar(bundle, tmp_path / "head")
    rows = _rows(2, prompt=9, tokens=60, seed=9)

    def run():
        spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=True, mtp_head=head)
        eng = Engine(bundle, spec, ScheduleConfig(max_batch=2, order="input"))
        cycle = iter(([3, 3, 0, 0, 0, 3, 0, 3, 3, 0, 0] + [3] * 5) * 40)
        eng.depth_control.choose = lambda w, **k: next(cycle)
        out = {r.key: r.tokens for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
        for i, (p, m) in enumerate(rows):
            assert out[i] == reference_tokens(bundle.model, p, m, eos), i
        return {k[2] for k in eng.drafter.bank.programs.built if k[0] != "propose"}

    assert run() == {4}
