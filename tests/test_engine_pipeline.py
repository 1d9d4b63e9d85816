"""Speculative rounds one ahead (device-side drafters: MTP, a draft model).

Round r+1 is queued on the device before round r is read, each round is read once (no
`mx.eval`, no other read in a decode round), and the output stays what plain decoding gives:
greedy rows token for token at widths 1, 4 and 7, with rows of different prompt lengths and
max_tokens finishing at different rounds (some while a round is queued past their end), rows
joining as others leave, and the batch draining once no request waits. The sampled side is
tested through the same path in test_engine_sampling (chi-square, batch-mate independence).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.depth import UNTRIED_SLOPE
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx import rounds as rounds_mod
from mtplx.rounds import REFILL_AT
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens, untrained_head


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = tiny_model("llama")
    bundle = load(path)
    head = untrained_head(bundle, tmp_path_factory.mktemp("head"))
    rng = np.random.default_rng(5)
    rows = [(rng.integers(3, 400, int(n)).tolist(), int(m)) for n, m in zip([3, 17, 6, 40, 9, 2, 25, 11, 5], [1, 3, 9, 14, 7, 12, 5, 10, 2])]
    eos = set(bundle.tokenizer.eos_token_ids)
    refs = [reference_tokens(bundle.model, p, m, eos) for p, m in rows]
    drafts = {"draft": str(tiny_model("llama", seed=1)), "draft-self": str(path)}  # rejects / accepts nearly all
    return bundle, str(head), drafts, rows, refs


def _engine(setup, method, width, depth=3, adaptive=False, compiled="on"):
    bundle, head, drafts, _, _ = setup
    spec = SpeculativeConfig(method=method.split("-")[0], depth=depth, adaptive_depth=adaptive, compiled_verify=compiled,
                             mtp_head=head if method.startswith("mtp") else None, draft_model=drafts.get(method),
                             mtp_lookup=2 if method == "mtp-lookup" else 0)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    eng.depth_control.slope = UNTRIED_SLOPE  # adaptive depth drafts before a round is timed, as on a GPU
    return eng


def _requests(rows):
    return [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]


def _trace(eng, events):
    """Events in order: "queue" for every round queued (launched), "read" for every round read."""
    launch, read = eng.rounds.launch, eng.rounds.read
    eng.rounds.launch = lambda *a, **k: (events.append("queue"), launch(*a, **k))[1]
    eng.rounds.read = lambda f: (events.append("read"), read(f))[1]


@pytest.mark.parametrize("method", ["mtp", "mtp-lookup", "draft"])
def test_the_next_round_is_queued_before_this_one_is_read(setup, method):
    eng = _engine(setup, method, 4)
    events = []
    _trace(eng, events)
    list(eng.generate(_requests(setup[3])))
    queued, ahead = 0, []
    for e in events:
        queued += 1 if e == "queue" else -1
        if e == "read":
            ahead.append(queued)  # rounds still queued, unread, after this read
    assert len(ahead) == eng.counters.rounds == eng.counters.host_reads
    assert min(ahead) >= 0 and max(ahead) == 1
    # every read but the last of each call (the pipeline drains when a row's slot can be refilled)
    # finds the following round already queued
    assert sum(a == 1 for a in ahead) > len(ahead) / 2, ahead


@pytest.mark.parametrize("method", ["mtp", "mtp-lookup", "draft"])
def test_a_decode_round_reads_the_device_once(setup, method, monkeypatch):
    eng = _engine(setup, method, 4)
    in_prefill, evals = [False], []
    run = eng.prefiller.run

    def prefill(*a, **k):
        in_prefill[0] = True
        try:
            return run(*a, **k)
        finally:
            in_prefill[0] = False

    eng.prefiller.run = prefill
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (evals.append(in_prefill[0]), real(*a, **k))[1])
    list(eng.generate(_requests(setup[3])))
    assert eng.counters.rounds > 5
    assert eng.counters.host_reads == eng.counters.rounds
    assert not [e for e in evals if not e], "mx.eval in a decode round"


@pytest.mark.parametrize("width", [1, 4, 7])
@pytest.mark.parametrize("method,adaptive,compiled", [("mtp", False, "on"), ("mtp", True, "on"), ("mtp", False, "off"),
                                                       ("mtp-lookup", False, "on"), ("mtp-lookup", True, "off"),
                                                       ("draft", False, "on"), ("draft-self", False, "off")])
def test_greedy_output_through_the_pipeline_equals_plain(setup, method, adaptive, compiled, width):
    """Eager forwards (compiled_verify: off, the draft model's own) take the cache's shared-length
    path only while the host's lengths are exact, never from upper bounds."""
    _, _, _, rows, refs = setup
    eng = _engine(setup, method, width, depth=4 if width < 7 else 6, adaptive=adaptive, compiled=compiled)
    out = {r.key: r for r in eng.generate(_requests(rows))}
    for i, ref in enumerate(refs):
        assert out[i].tokens == ref, (method, width, i)
        assert out[i].finish_reason == ("length" if len(ref) == rows[i][1] else "stop")
        assert out[i].stats.completion_tokens == len(ref)
    drafted = sum(r.stats.drafted_tokens for r in out.values())
    # adaptive at width 7: every row is in the first batch, and its few tokens left never pay a depth's build
    assert drafted > 0 or (adaptive and width == 7)
    if method == "draft-self":  # rows end inside runs of accepted drafts, with a round queued past them
        assert sum(r.stats.accepted_tokens for r in out.values()) > 0.9 * drafted
    if compiled == "on":  # rounds queued past a row's end stay within the growth budget: no eager verify
        assert eng.bank.stats["fallback_calls"] == 0, eng.bank.stats["fallback_reasons"]
    # the host's lengths are exact again after every call (admission and compaction read them)
    cache = eng.drafter.cache
    assert np.array_equal(cache.rows.host, np.array(cache.rows.device))


@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_rounds_queued_past_a_rows_end_stay_compiled(setup, method):
    """Sampled rows draft `speculative.depth` to their last token, and a round is queued past a
    finished row: the verify's growth budget has room for both, so no verify falls back to eager."""
    _, _, _, rows, _ = setup
    eng = _engine(setup, method, 4, depth=6)
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m, temperature=1.0), seed=i)
            for i, (p, m) in enumerate(rows)]
    out = list(eng.generate(reqs))
    assert len(out) == len(rows) and all(r.error is None for r in out)
    assert eng.bank.stats["compiled_calls"] > 0
    assert eng.bank.stats["fallback_calls"] == 0, eng.bank.stats["fallback_reasons"]


@pytest.mark.parametrize("lookup", [0, 2])
def test_synchronous_mtp_rounds_keep_exact_lengths(setup, lookup):
    """An MTP drafter run synchronously (as if it drafted on the host: each round read before the
    next) commits exactly, so its head cache's lengths never turn into upper bounds."""
    bundle, head, _, rows, refs = setup
    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, mtp_head=head, mtp_lookup=lookup)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=4, order="input"))
    d = eng.drafter
    d.__class__ = type("SynchronousMtpDrafter", (type(d),), {"device_side": False})
    rounds = []
    land = eng.rounds.land
    eng.rounds.land = lambda *a: (rounds.append(eng.drafter.cache.rows.unread), land(*a))[1]
    out = {r.key: r.tokens for r in eng.generate(_requests(rows))}
    assert [out[i] for i in range(len(rows))] == refs
    assert rounds and set(rounds) == {0}


def test_a_pipelined_mtp_round_runs_two_programs(setup):
    """The head's commit of round r and its drafts for round r+1 are one compiled program: a
    round is the verify and that program, plus one proposal where a call's first round starts
    (admission may have changed the rows) and the drafts of the round after a call's last."""
    _, _, _, rows, refs = setup
    eng = _engine(setup, "mtp", 4)
    calls = [0]
    inner = eng.rounds.run
    eng.rounds.run = lambda sched: (calls.__setitem__(0, calls[0] + 1), (yield from inner(sched)))[1]
    out = {r.key: r.tokens for r in eng.generate(_requests(rows))}
    assert [out[i] for i in range(len(rows))] == refs
    rounds, head = eng.counters.rounds, eng.drafter.bank.stats
    assert eng.bank.stats["compiled_calls"] == rounds and head["eager_calls"] == 0
    assert rounds > 2 * calls[0]
    assert head["compiled_calls"] <= rounds + calls[0], (head, rounds, calls)  # not two per round


@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_no_round_is_queued_past_the_last_rows_length(setup, method):
    """One row at a time: a row a token short of max_tokens ends with the round in flight, so no
    round is queued after it; only rows that end at an eos pay for one round past their end."""
    _, _, _, rows, refs = setup
    eng = _engine(setup, method, 1)
    out = {r.key: r for r in eng.generate(_requests(rows))}
    assert [out[i].tokens for i in range(len(rows))] == refs
    forwards = sum(r.stats.compiled_verify_calls + r.stats.eager_verify_calls for r in out.values())
    at_eos = sum(r.finish_reason == "stop" for r in out.values())
    assert forwards <= eng.counters.rounds <= forwards + at_eos, (forwards, eng.counters.rounds, at_eos)


@pytest.mark.parametrize("method", ["mtp", "mtp-lookup", "draft"])
def test_an_admission_happens_behind_the_round_in_flight(setup, method, monkeypatch):
    """At full width with requests waiting, rows are admitted while the round queued before the
    admission is still unread: the pipeline runs empty (a read with no round queued behind it)
    only where the batch drains at its end and narrows, not once per admission. The admitted rows'
    slots drop what that round made for the rows that left them, and the text stays plain
    decoding's. An admission of prompts shorter than a prefill chunk syncs only where it reads its
    first tokens: no mx.eval at all."""
    bundle, _, _, rows, _ = setup
    eng = _engine(setup, method, 8)
    monkeypatch.setattr(rounds_mod, "REFILL_AT", 8)  # an admission at every freed slot of width 8: many admissions
    evals, real = [0], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (evals.__setitem__(0, evals[0] + 1), real(*a, **k))[1])
    events, idle_lengths = [], []  # a slot whose row has finished holds no entries (nothing to attend over)
    _trace(eng, events)
    launch = eng.rounds.launch

    def launched(sched, *a, **k):
        idle = [i for i, s in enumerate(sched.slots) if s is None]
        idle_lengths.extend(int(sched.cache.rows.host[i]) for i in idle)
        idle_lengths.extend(int(eng.drafter.cache.rows.host[i]) for i in idle)
        return launch(sched, *a, **k)

    eng.rounds.launch = launched
    many = [(rows[i % len(rows)][0], 4 + (i * 7) % 23) for i in range(40)]
    out = {r.key: r.tokens for r in eng.generate(_requests(many))}
    monkeypatch.setattr(mx, "eval", real)
    for i, (p, m) in enumerate(many):
        assert out[i] == reference_tokens(bundle.model, p, m, eng.eos), i
    queued, emptied = 0, 0
    for e in events:
        queued += 1 if e == "queue" else -1
        emptied += e == "read" and queued == 0
    assert eng.counters.admissions >= 20
    # the end (one read) and narrowing 8 -> 4 -> 2 -> 1 (a CPU narrows a drained batch), a round or two
    # where no row could go on past the one in flight
    assert emptied <= 6, (emptied, eng.counters.admissions)
    assert evals[0] == 0
    assert idle_lengths and set(idle_lengths) == {0}, idle_lengths
    cache = eng.drafter.cache
    assert np.array_equal(cache.rows.host, np.array(cache.rows.device))


@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_a_batch_that_narrows_after_an_admission_reads_the_carried_round_first(setup, method):
    """The last request joins behind the round in flight and leaves the batch half idle: before it
    narrows (which needs exact lengths), that round is read and landed; the text stays plain's."""
    bundle, _, _, rows, _ = setup
    eng = _engine(setup, method, 8)
    many = [(rows[i][0], 2) for i in range(7)] + [(rows[7][0], 24), (rows[8][0], 9)]
    landed, inner = [], eng.rounds.land_carried
    eng.rounds.land_carried = lambda sched: (landed.append(eng.rounds.carried is not None), inner(sched))[1]
    out = {r.key: r.tokens for r in eng.generate(_requests(many))}
    for i, (p, m) in enumerate(many):
        assert out[i] == reference_tokens(bundle.model, p, m, eng.eos), i
    assert any(landed), landed
    cache = eng.drafter.cache
    assert np.array_equal(cache.rows.host, np.array(cache.rows.device))


def test_with_requests_waiting_a_wide_batch_refills_several_slots_at_once(setup):
    """A refill drains the pipeline (the round in flight is read, admission prefills): at width 16
    with requests waiting, a call returns once 1/4 of its slots (4) are free, not at every finished
    row (rows of staggered lengths end one at a time), and the text stays plain decoding's."""
    bundle, head, _, rows, _ = setup
    eng = _engine(setup, "mtp", 16)
    many = [(rows[i % len(rows)][0], 4 + (i * 7) % 23) for i in range(40)]
    freed, inner = [], eng.rounds.run

    def counted(sched):
        yield from inner(sched)
        freed.append((sched.drained, sum(s is None for s in sched.slots), sched.live > 0))

    eng.rounds.run = counted
    out = {r.key: r.tokens for r in eng.generate(_requests(many))}
    for i, (p, m) in enumerate(many):
        assert out[i] == reference_tokens(bundle.model, p, m, eng.eos), i
    waiting = [f for d, f, going in freed if not d and going]
    assert waiting and min(waiting) >= 16 // REFILL_AT == 4, freed
