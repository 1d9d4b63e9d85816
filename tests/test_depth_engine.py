"""The adaptive depth controller inside the engine: the round times it is fed are each round's own.

Rounds run one ahead (rounds.py): while round r runs on the device, the host queues round
r+1, so the time between two reads holds round r+1's queueing too. A round is timed only when
the round queued in its interval has its depth (then the interval is what a run of rounds of that
depth costs each); otherwise a plain round followed by a costly drafting round carries that
round's cost, and drafting that loses to plain decoding looks like it pays (the H200, Qwen2.5-Coder
1.5B with its 0.5B draft: adaptive depth kept drafting at 0.66x plain).

The clock is injected and advanced by the work queued (a verify 4 ms, a draft-model step 5 ms,
costs charged when a round is queued, as on a host-bound device): no wall time is asserted.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.depth import EXPLORE_EVERY, UNTRIED_SLOPE
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _costly_engine(bundle, path, clock, verify_s=0.004, step_s=0.005, depth=2, width=1):
    """An engine whose draft model is the target itself (every draft passes: 3 tokens a depth-2
    round), with the clock charged per verify and per draft step."""
    spec = SpeculativeConfig(method="draft", depth=depth, adaptive_depth=True, draft_model=str(path))
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    eng.rounds.clock = clock
    verify, propose, folded = eng.rounds.verify, eng.drafter.propose, eng.bank.verify_round

    def timed_verify(*a, **k):
        clock.now += verify_s
        return verify(*a, **k)

    def timed_folded(*a, **k):  # the verify folded with acceptance (None: the round verifies apart)
        out = folded(*a, **k)
        clock.now += verify_s if out is not None else 0.0
        return out

    def timed_propose(K, *a, **k):
        clock.now += step_s * K
        return propose(K, *a, **k)

    eng.rounds.verify, eng.bank.verify_round, eng.drafter.propose = timed_verify, timed_folded, timed_propose
    chosen, choose = [], eng.depth_control.choose
    eng.depth_control.choose = lambda w, **k: chosen.append(choose(w, **k)) or chosen[-1]
    return eng, chosen


def test_a_draft_whose_rounds_cost_more_than_they_emit_falls_back_to_plain(tiny_model):
    """Plain 4 ms a token; depth 2 14 ms for 3 tokens (4.7 ms a token); depth 1 9 ms for 2: the
    controller settles on depth 0, tries drafting now and then, and the text stays plain decoding's."""
    path = tiny_model("llama")
    bundle = load(path)
    eos = set(bundle.tokenizer.eos_token_ids)
    rng = np.random.default_rng(7)
    rows = [(rng.integers(3, 400, 6).tolist(), 120) for _ in range(3)]
    eng, chosen = _costly_engine(bundle, path, FakeClock())
    out = {r.key: r for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    for i, (p, m) in enumerate(rows):
        assert out[i].tokens == reference_tokens(bundle.model, p, m, eos), i
    tail = chosen[len(chosen) // 2:]
    assert tail.count(0) > 0.75 * len(tail), chosen
    assert any(k > 0 for k in tail), chosen  # drafting is re-tried now and then


def test_a_draft_that_pays_keeps_drafting(tiny_model):
    """The same engine with cheap draft steps (0.5 ms): depth 2 emits 3 tokens for 5 ms against 4 ms
    for one: the controller drafts."""
    path = tiny_model("llama")
    bundle = load(path)
    rng = np.random.default_rng(7)
    rows = [(rng.integers(3, 400, 6).tolist(), 120) for _ in range(2)]
    eng, chosen = _costly_engine(bundle, path, FakeClock(), step_s=0.0005)
    list(eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)))
    tail = chosen[len(chosen) // 2:]
    assert tail.count(2) > 0.75 * len(tail), chosen


# -- adaptive depth with MTP: compiles never priced, the head's catch-ups compiled --
def _mtp_engine(bundle, head, width=1):
    from test_mtp_draft import _sidecar  # noqa: F401 (the random head below is built the same way)

    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=True, mtp_head=head)
    return Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))


def test_a_round_that_compiled_never_prices_its_depth(tiny_model, tmp_path):
    """A fake clock charged 4 ms a verify and 1 s for each program built (a compile, and on a GPU
    its kernel builds): adaptive depth with MTP over rows that need new programs as they grow and
    as depths change; no time the controller keeps holds a compile (a round in which the next
    round's program was built would make its depth look 100x dearer than it is)."""
    from test_mtp_draft import _sidecar

    bundle = load(tiny_model("llama"))
    eos = set(bundle.tokenizer.eos_token_ids)
    head = _sidecar(bundle, tmp_path / "head")
    rng = np.random.default_rng(4)
    rows = [(rng.integers(3, 400, int(n)).tolist(), 90) for n in (5, 200, 30)]
    eng = _mtp_engine(bundle, head)
    clock = FakeClock()
    eng.rounds.clock = lambda: clock.now + 1.0 * eng.counters.programs_built  # 1 s a program built
    fed, record, verify, folded = [], eng.depth_control.record, eng.rounds.verify, eng.bank.verify_round

    def timed_verify(*a, **k):
        clock.now += 0.004
        return verify(*a, **k)

    def timed_folded(*a, **k):  # the verify folded with acceptance (None: the round verifies apart)
        out = folded(*a, **k)
        clock.now += 0.004 if out is not None else 0.0
        return out

    eng.rounds.verify, eng.bank.verify_round = timed_verify, timed_folded
    eng.depth_control.record = lambda w, d, s, *a, **k: fed.append((d, s)) or record(w, d, s, *a, **k)
    out = {r.key: r.tokens for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
    timed = [(d, s) for d, s in fed if s is not None]
    assert len(timed) > 20, fed
    assert max(s for _, s in timed) < 0.1, [x for x in timed if x[1] >= 0.1]
    assert max(eng.depth_control.seconds.values()) < 0.1, eng.depth_control.seconds
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eos), i


@pytest.mark.parametrize("lookup", [0, 2])
def test_rounds_at_depth_0_leave_the_head_behind_and_it_catches_up_exactly(tiny_model, tmp_path, lookup, monkeypatch):
    """Adaptive depth at 0 for stretches (longer than HEAD_BEHIND too), then drafting again: the
    head commits none of the depth-0 rounds (a depth-0 round costs a plain round) and catches up
    with the next round that drafts, before rows move and at the end of a call. Every round's
    drafts and accepted counts are those of the head committing every round (HEAD_BEHIND = 0),
    and the text is plain decoding's."""
    from mtplx.drafting import mtp as mtp_drafting
    from test_mtp_draft import _sidecar

    bundle = load(tiny_model("llama"))
    eos = set(bundle.tokenizer.eos_token_ids)
    head = _sidecar(bundle, tmp_path / "head")
    rng = np.random.default_rng(6)
    rows = [(rng.integers(3, 60, int(n)).tolist(), m) for n, m in ((9, 150), (30, 40), (5, 90))]
    if lookup:
        rows = [((p[: len(p) // 3 + 1] * 3)[: len(p)], m) for p, m in rows]
    schedule = [0] * 5 + [3] * 3 + [0] * 20 + [2, 1, 0, 0, 1] + [0] * 7 + [3] * 10

    def run(behind):
        monkeypatch.setattr(mtp_drafting, "HEAD_BEHIND", behind)
        spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=True, mtp_head=head, mtp_lookup=lookup)
        eng = Engine(bundle, spec, ScheduleConfig(max_batch=2, order="input"))
        chosen, reads, read = [], [], eng.rounds.read
        eng.depth_control.choose = lambda w, **k: chosen.append(schedule[len(chosen) % len(schedule)]) or chosen[-1]
        eng.rounds.read = lambda flight: reads.append(read(flight)) or reads[-1]
        behind, heads = [], {}  # per advance: rounds behind; the head's state where it is not behind
        advance, d = eng.drafter.advance, eng.drafter

        def advanced(*a, **k):
            advance(*a, **k)
            behind.append(len(d.behind))
            if not d.behind:  # the first-draft logits and head hidden state after this round's commit
                heads[len(behind)] = [np.array(x) for x in d.extra]
        d.advance = advanced
        out = {r.key: r for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows))}
        return out, reads, behind, heads

    most = 8  # (HEAD_BEHIND lowered: stretches at depth 0 longer than it, between calls' ends)
    ref, ref_reads, ref_behind, ref_heads = run(0)
    got, got_reads, got_behind, got_heads = run(most)
    assert max(ref_behind) == 0 and max(got_behind) == most
    caught_up = [r for r in got_heads if r > 1 and got_behind[r - 2] > 0]  # commits that caught up
    assert len(caught_up) >= 3, got_behind
    for r, state in got_heads.items():  # the head after a catch-up is the head that never fell behind
        for a, b in zip(state, ref_heads[r]):
            assert np.allclose(a, b, atol=1e-4), (r, float(np.abs(a - b).max()))
    assert len(got_reads) == len(ref_reads)
    for r, (a, b) in enumerate(zip(ref_reads, got_reads)):
        assert np.array_equal(a, b), (r, a, b)  # accepted counts, next tokens, drafts: round by round
    for i, (p, m) in enumerate(rows):
        assert got[i].tokens == ref[i].tokens == reference_tokens(bundle.model, p, m, eos), i
        assert got[i].stats.accepted_tokens == ref[i].stats.accepted_tokens, i
    assert not lookup or sum(r.stats.accepted_tokens for r in got.values()) > 0  # lookup drafts that pass: the history caught up


def test_fixed_depth_builds_nothing_ahead(tiny_model, tmp_path):
    """`adaptive_depth: false`: no round is left behind by the head."""
    from test_mtp_draft import _sidecar

    bundle = load(tiny_model("llama"))
    head = _sidecar(bundle, tmp_path / "head")
    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, mtp_head=head)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=2, order="input"))
    rng = np.random.default_rng(8)
    behind, advance = [], eng.drafter.advance
    eng.drafter.advance = lambda *a, **k: advance(*a, **k) or behind.append(len(eng.drafter.behind))
    list(eng.generate(Request(i, rng.integers(3, 400, 6).tolist(), SamplingParams(max_tokens=30)) for i in range(3)))
    assert behind and max(behind) == 0


def test_the_heads_catch_ups_run_compiled(tiny_model, tmp_path, monkeypatch):
    """The head's catch-up after rounds at depth 0 commits them through the compiled commit programs,
    depth + 1 rounds a call (one eager forward over all of them would meet a new query length each
    time: on a GPU attention plans and kernels no program built). After a run at depth 3, the same
    rows with stretches at depth 0 (up to 11 rounds) run the head eagerly nowhere and give plain
    decoding's text."""
    from mtplx import scheduler
    from test_mtp_draft import _sidecar

    bundle = load(tiny_model("llama"))
    eos = set(bundle.tokenizer.eos_token_ids)
    head = _sidecar(bundle, tmp_path / "head")
    rng = np.random.default_rng(9)
    rows = [(rng.integers(3, 400, 9).tolist(), 70) for _ in range(3)]
    reqs = [Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: 2)  # as on a GPU: the last row keeps the width
    eng = _mtp_engine(bundle, head, width=2)
    eng.depth_control.choose = lambda w, **k: 3
    first = {r.key: r.tokens for r in eng.generate(reqs)}
    schedule = [3, 0, 0, 0, 2] + [0] * 11 + [3, 1] + [0] * 6 + [2, 3]
    cycle = iter(schedule * 20)
    eng.depth_control.choose = lambda w, **k: next(cycle)
    behind, d = [], eng.drafter
    advance = d.advance
    d.advance = lambda *a, **k: behind.append(len(d.behind)) or advance(*a, **k)
    second = {r.key: r.tokens for r in eng.generate(reqs)}
    assert behind and max(behind) > 4, behind  # catch-ups longer than a verify
    assert d.bank.stats["eager_calls"] == 0, d.bank.stats  # the head ran eagerly nowhere
    for i, (p, m) in enumerate(rows):
        assert first[i] == second[i] == reference_tokens(bundle.model, p, m, eos), i


def test_adaptive_depth_starts_where_the_heads_recorded_acceptance_pays(tiny_model, tmp_path):
    """The head's mtp_head.json records its held-out acceptance per draft position: the controller
    starts from it (not one guess for every head). A head that records 0.05 starts at
    depth 0 (plain decoding: drafting cannot pay), one that records 0.95 at its depth 3; greedy text
    is plain decoding's either way (the last rows of a job: no first plain rounds)."""
    import json

    from mtplx.models.mtp import SIDECAR_META
    from test_mtp_draft import _sidecar

    bundle = load(tiny_model("llama"))
    eos = set(bundle.tokenizer.eos_token_ids)
    rng = np.random.default_rng(10)
    rows = [(rng.integers(3, 400, 7).tolist(), 12) for _ in range(2)]
    first = {}
    for a in (0.05, 0.95):
        head = _sidecar(bundle, tmp_path / f"head-{a}")
        meta = json.loads((tmp_path / f"head-{a}" / SIDECAR_META).read_text())
        meta["heldout_acceptance_by_depth"] = [a] * 4
        (tmp_path / f"head-{a}" / SIDECAR_META).write_text(json.dumps(meta))
        eng = _mtp_engine(bundle, head, width=2)
        eng.depth_control.slope = UNTRIED_SLOPE  # a GPU's verify (on a CPU no recorded acceptance pays untimed)
        assert eng.depth_control.passed == {j: a for j in range(1, 5)}
        chosen, choose = [], eng.depth_control.choose
        eng.depth_control.choose = lambda w, **k: chosen.append(choose(w, **k)) or chosen[-1]
        out = {r.key: r.tokens for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m))
                                                      for i, (p, m) in enumerate(rows))}
        first[a] = chosen[0]
        for i, (p, m) in enumerate(rows):
            assert out[i] == reference_tokens(bundle.model, p, m, eos), (a, i)
    assert first == {0.05: 0, 0.95: 3}, first


def test_the_callers_time_with_a_result_never_prices_a_depth(tiny_model, tmp_path, monkeypatch):
    """A job writes each result (a shard commit fsyncs: up to 0.6 s on this CPU, against a 5 ms round
    on the H200) before it asks for the next round. A caller charging the fake clock 1 s per result:
    no time the controller is fed holds it (the round after each result would carry it), and the
    text is plain decoding's."""
    from mtplx import scheduler
    from test_mtp_draft import _sidecar

    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: 4)  # the batch keeps its width: results come
    bundle = load(tiny_model("llama"))                                # between rounds of one call
    eos = set(bundle.tokenizer.eos_token_ids)
    head = _sidecar(bundle, tmp_path / "head")
    rng = np.random.default_rng(11)
    rows = [(rng.integers(3, 400, 6).tolist(), m) for m in (12, 24, 36, 60)]
    clock = FakeClock()
    eng = _mtp_engine(bundle, head, width=4)
    eng.rounds.clock = clock
    fed, record, folded = [], eng.depth_control.record, eng.bank.verify_round

    def timed_folded(*a, **k):
        out = folded(*a, **k)
        clock.now += 0.004
        return out

    eng.bank.verify_round = timed_folded
    eng.depth_control.record = lambda w, d, s, *a, **k: fed.append((d, s)) or record(w, d, s, *a, **k)
    out = {}
    for r in eng.generate(Request(i, p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)):
        out[r.key] = r.tokens
        clock.now += 1.0
    timed = [s for _, s in fed if s is not None]
    assert len(timed) > 10, fed
    assert max(timed) < 0.1, fed
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eos), i
