"""Speculation that never loses to plain decoding: the depth controller decodes plainly where drafting
loses and drafts again where it pays (from each row's own acceptance and the measured costs), a round
at depth 0 costs no drafter work, prompt lookup's depth-0 rounds are plain rounds queued one ahead, a
try of a depth whose programs are not built is priced by what builds cost here, and a sampled row's
depth comes from its own history alone. Costs are counted, never timed.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.depth import CPU_SLOPE, EXPLORE_EVERY, UNTRIED_SLOPE, DepthController, RowAcceptance
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens, untrained_head


def _rounds(ctrl, rates, cost, rounds, width=8, shape=8):
    """Rounds as the engine feeds them: `width` rows, row i's drafts passing with chance rates(r)[i]
    at every position (counted deterministically: its expected run), each row's own RowAcceptance,
    a round of depth k timed cost[k]. Returns the chosen depths."""
    rows = [RowAcceptance(ctrl.max_depth) for _ in range(width)]
    chosen = []
    for r in range(rounds):
        k = ctrl.choose(width, accept=ctrl.row_acceptance(rows), caps=[ctrl.max_depth] * width, shape=shape)
        chosen.append(k)
        n = np.array([min(k, int(np.log(0.5) / np.log(max(a, 1e-6)))) if a < 1 else k for a in rates(r)])
        for row, a in zip(rows, n):
            row.add(k, int(a))
        j = np.arange(1, k + 1)[:, None]
        reached, passed = (n[None] >= j - 1).sum(1).tolist(), (n[None] >= j).sum(1).tolist()
        ctrl.record(width, k, cost[k], int(n.sum()), int(np.minimum(n + 1, k).sum()), reached, passed, shape=shape)
    return chosen


def _mode(xs):
    return max(set(xs), key=xs.count)


# a CPU: a round's cost follows the tokens it computes (8 rows, depth k: 8 (k + 1) tokens)
CPU_COST = {k: 0.01 * (1 + 0.8 * k) for k in range(4)}
# a GPU: a verify of 4 tokens a row costs little more than one of 1
GPU_COST = {k: 0.004 * (1 + 0.1 * k) for k in range(4)}


def test_plain_where_drafting_loses_and_drafting_again_where_it_pays():
    """8 rows on a GPU-like device drafting at depth 3 while their drafts pass (0.9); then every row's
    drafts stop passing (new rows, text the drafter never saw): the controller falls back to plain
    decoding within a few rounds, from the rows' own counts; when the drafts pass again it drafts
    again (its tries from plain decoding measure it)."""
    ctrl = DepthController(3, slope=UNTRIED_SLOPE)
    phase = lambda r: [0.9] * 8 if r < 100 or r >= 300 else [0.02] * 8
    chosen = _rounds(ctrl, phase, GPU_COST, 500)
    assert _mode(chosen[60:100]) == 3, chosen
    assert chosen[100:300].count(0) > 0.85 * 200, chosen[100:300]
    assert 0 in chosen[100:115], chosen[100:115]  # within a few rounds
    assert _mode(chosen[420:]) == 3, chosen[300:]


def test_a_batch_of_rows_that_pay_and_rows_that_do_not_is_priced_by_its_rows():
    """Two rows whose drafts pass (0.95) among six whose drafts never do, on a GPU-like device (a round
    costs what a row's does): the round's tokens are the rows' sum, the two good rows earn what
    drafting costs, so the batch drafts; on a CPU-like device (cost follows tokens) it does not."""
    mixed = lambda r: [0.95, 0.95] + [0.0] * 6
    gpu = _rounds(DepthController(3, slope=UNTRIED_SLOPE), mixed, GPU_COST, 200)
    cpu = _rounds(DepthController(3, slope=CPU_SLOPE), mixed, CPU_COST, 200)
    assert _mode(gpu[100:]) == 3, gpu
    assert cpu[100:].count(0) > 0.8 * 100, cpu


def test_a_try_that_builds_programs_is_priced_against_the_work_left():
    """Plain decoding measured and built; drafting not built at this width. With builds costing 20 s
    (a fresh GPU host) and 2 s of work left, no round drafts (no try either); with builds of 10 ms
    the deepest depth is measured right after plain decoding, as usual."""
    def run(build_seconds, left):
        ctrl = DepthController(3, slope=UNTRIED_SLOPE)
        ctrl.build_seconds = build_seconds
        chosen = []
        for _ in range(4 * EXPLORE_EVERY):
            k = ctrl.choose(1, left=left, shape=1)
            chosen.append(k)
            ctrl.record(1, k, GPU_COST[k], 0, 0, shape=1)
        return chosen

    rate = 1 / GPU_COST[0]  # tokens a second plain
    assert set(run(20.0, 2.0 * rate)) == {0}
    cheap = run(0.01, 2.0 * rate)
    assert cheap[:4] == [0, 0, 3, 3], cheap  # both ends timed first (a first round builds: untimed)


def test_the_cost_of_catching_up_is_priced():
    """From plain decoding, depth 3 pays a little over plain; an MTP head 500 rounds behind must
    catch up first, which costs more than the few rounds left earn: the controller stays plain."""
    ctrl = DepthController(3, prior=[0.5] * 3, slope=UNTRIED_SLOPE)
    ctrl.explore = False
    for k in (0, 3):
        for _ in range(3):
            ctrl.record(1, k, GPU_COST[k], 0, 0, shape=1)
    assert ctrl.choose(1, left=50.0, shape=1) > 0
    assert ctrl.choose(1, left=50.0, shape=1, lag=500) == 0


def test_a_sampled_rows_depth_reads_its_own_counts_as_of_plan_lag_rounds_before():
    """Its depth for round n comes from its counts after round n - PLAN_LAG (however many rounds
    were read when the round was planned), and stays until a round uses it."""
    ctrl = DepthController(3, prior=[0.9] * 3, slope=0.5)
    row = RowAcceptance(3, sampled=True)
    first = ctrl.sampled_depth(row)
    assert first > 0
    row.launch()
    for _ in range(2):  # two rounds read whose drafts all failed: round 3 still reads round 0's counts
        row.add(3, 0)
    row.next_depth = None
    assert ctrl.sampled_depth(row) == first
    row.launch()
    for _ in range(10):
        row.add(3, 0)
        row.launch()
    assert ctrl.sampled_depth(row) == 0  # its own drafts fail: it decodes plainly (one try every SAMPLED_RETRY)


def test_a_sampled_rows_fixed_costs_are_the_calibrated_curve_at_the_jobs_width():
    """With a calibration profile, a sampled row's fixed costs are its curve at the job's max_batch
    (not the width of the moment, which its batch mates set): steep at 32 rows, flat at one."""
    curves = {1: [1.0, 1.02, 1.04, 1.06], 32: [1.0, 1.9, 2.8, 3.7]}
    depth = {w: DepthController(3, prior=[0.8] * 3, shapes=curves, fixed_width=w).sampled_depth(RowAcceptance(3, True))
             for w in (1, 32)}
    assert depth == {1: 3, 32: 0}, depth


# -- inside the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = tiny_model("llama")
    bundle = load(path)
    head = untrained_head(bundle, tmp_path_factory.mktemp("head"))
    return bundle, str(head)


def _rows(n, seed=3, prompt=6, tokens=40):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 400, prompt).tolist(), tokens) for _ in range(n)]


def test_rounds_at_depth_0_run_no_head_work_of_their_own(setup, monkeypatch):
    """150 rounds at depth 0 after one that drafts: the MTP head drafts nothing and commits the
    depth-0 rounds only in catch-ups of depth + 1 rounds a program call (its per-token work, what a
    later switch back needs), never one of a round's own; the text is plain decoding's."""
    from mtplx import scheduler
    from mtplx.drafting import mtp as mtp_drafting

    bundle, head = setup
    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: 2)  # one call: no narrowing
    spec = SpeculativeConfig(method="mtp", depth=3, mtp_head=head)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=2, order="input"))
    picks = iter([3] + [0] * 1000)
    eng.depth_control.choose = lambda w, **k: next(picks)
    widths, through = [], eng.drafter._commit_through
    eng.drafter._commit_through = lambda verify_in, *a, **k: widths.append(verify_in.shape[1]) or through(verify_in, *a, **k)
    proposed, bank_propose = [], eng.drafter.bank.propose
    eng.drafter.bank.propose = lambda *a, **k: proposed.append(1) or bank_propose(*a, **k)
    rows = _rows(2, tokens=150)
    out = {r.key: r.tokens for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    eos = set(bundle.tokenizer.eos_token_ids)
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eos), i
    rounds = eng.counters.rounds
    assert rounds > 100 and len(proposed) == 1  # the first round's drafts only
    calls = 1 + -(-rounds // 4) + 2 * -(-rounds // mtp_drafting.HEAD_BEHIND)  # (each catch-up's last round: a call)
    assert set(widths) == {4} and len(widths) <= calls, (len(widths), rounds)


def test_prompt_lookup_at_depth_0_queues_plain_rounds_one_ahead(setup):
    """ngram with the controller at depth 0: each round is queued before the one in flight is read
    (as plain decoding's), nothing is drafted, and the text is plain decoding's; where it drafts
    again its rounds are read before the next is queued."""
    bundle, _ = setup
    eng = Engine(bundle, SpeculativeConfig(method="ngram", depth=3), ScheduleConfig(max_batch=3, order="input"))
    schedule = iter([0] * 20 + [3] * 6 + [0] * 1000)
    eng.depth_control.choose = lambda w, **k: next(schedule)
    events, launch, read, propose = [], eng.rounds.launch, eng.rounds.read, eng.drafter.propose
    eng.rounds.launch = lambda *a, **k: (events.append("queue"), launch(*a, **k))[1]
    eng.rounds.read = lambda f: (events.append("read"), read(f))[1]
    eng.drafter.propose = lambda *a, **k: (events.append("draft"), propose(*a, **k))[1]
    rows = _rows(3, tokens=60)
    out = {r.key: r.tokens for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    eos = set(bundle.tokenizer.eos_token_ids)
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eos), i
    first = events[:10]
    assert first[:3] == ["queue", "queue", "read"] and "draft" not in first, first
    drafting = events.index("draft")
    assert events[drafting - 1 : drafting + 3] == ["queue", "draft", "read", "queue"] or events[drafting + 1] == "read", events


def test_a_sampled_row_whose_drafts_fail_stops_drafting(setup):
    """A sampled row drafting with an untrained head (its drafts rarely pass), at a fixed cost of 0.5
    a drafted token: it drafts a few rounds, then decodes plainly (one draft every SAMPLED_RETRY
    rounds), from its own counts."""
    bundle, head = setup
    spec = SpeculativeConfig(method="mtp", depth=3, mtp_head=head)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=1))
    eng.depth_control.slope = 0.5
    [r] = list(eng.generate([Request(0, _rows(1)[0][0], SamplingParams(max_tokens=80, temperature=1.0), seed=4)]))
    assert r.stats.drafted_tokens < 20, r.stats


def test_a_sampled_rows_text_does_not_depend_on_its_batch_mates_under_adaptive_depth(setup):
    """Adaptive depth with sampled rows (the fixed GPU slope: they draft and stop as their own counts
    say) beside greedy and sampled mates of other lengths: each sampled row's text is what it is
    alone."""
    bundle, head = setup

    def run(requests, width):
        eng = Engine(bundle, SpeculativeConfig(method="mtp", depth=3, mtp_head=head), ScheduleConfig(max_batch=width))
        eng.depth_control.slope = UNTRIED_SLOPE
        return {r.key: r.tokens for r in eng.generate(requests)}

    prompts = _rows(6, seed=9)
    rows = [Request(("x", i), prompts[i][0], SamplingParams(max_tokens=30, temperature=1.0), seed=100 + i) for i in range(3)]
    mates = [Request(i, prompts[3 + i % 3][0][: i + 2], SamplingParams(max_tokens=10 + 7 * i, temperature=0.0 if i % 2 else 0.9),
                     seed=i) for i in range(5)]
    alone = {}
    for r in rows:
        alone.update(run([r], 1))
    batched = run(mates + rows, 4)
    assert {k: batched[k] for k in alone} == alone


def test_the_engine_reports_each_programs_build_as_it_starts(setup):
    """on_progress("build", 1) as each compiled program's first call starts: what the progress line
    shows while a machine's first run builds kernels."""
    bundle, head = setup
    eng = Engine(bundle, SpeculativeConfig(method="mtp", depth=3, mtp_head=head), ScheduleConfig(max_batch=2))
    events = []
    eng.on_progress = lambda kind, n: events.append(kind)
    list(eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(_rows(2, tokens=12))))
    assert events.count("build") == eng.counters.programs_built > 0
    assert events.index("build") < events.index("decode") or events[0] == "prefill"


def test_a_build_is_priced_against_the_rows_the_caller_says_are_left(setup):
    """`Engine.expected_requests` (a job: its rows left) sizes the work a build is priced against:
    8 rows of 20 tokens at width 2 have 160 tokens left at the first round; without it the engine
    counts the rows in flight and a batch more."""
    bundle, head = setup

    def first_left(expected):
        eng = Engine(bundle, SpeculativeConfig(method="mtp", depth=3, mtp_head=head), ScheduleConfig(max_batch=2))
        eng.expected_requests = expected
        seen, choose = [], eng.depth_control.choose
        eng.depth_control.choose = lambda w, **k: seen.append(k["left"]) or choose(w, **k)
        list(eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(_rows(8, tokens=20))))
        return seen[0]

    assert first_left(8) == 8 * 20 - 2  # (the two rows in flight have their first tokens)
    assert first_left(None) == 2 * 19 + (1 + 2) * 20  # (the admission read one request ahead: it waits)


def test_a_run_that_never_drafts_builds_no_head_program(setup):
    """Adaptive depth at 0 from the start (rows streaming through a batch, admissions between):
    the MTP head's catch-ups run eagerly and the last call's are dropped, so the run builds the
    plain round's program only, as plain decoding does; the text is plain decoding's."""
    bundle, head = setup
    eng = Engine(bundle, SpeculativeConfig(method="mtp", depth=3, mtp_head=head), ScheduleConfig(max_batch=2, order="input"))
    eng.depth_control.choose = lambda w, **k: 0
    rows = _rows(5, tokens=30)
    out = {r.key: r.tokens for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    eos = set(bundle.tokenizer.eos_token_ids)
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eos), i
    assert not eng.drafter.bank.programs.built and eng.drafter.bank.stats["eager_calls"] > 0
    plain = Engine(bundle, SpeculativeConfig(method="none"), ScheduleConfig(max_batch=2, order="input"))
    list(plain.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)))
    assert eng.counters.programs_built == plain.counters.programs_built
