"""An admission behind the round in flight reads its rows' first tokens after the round they join is queued.

At full width with requests waiting, rows are admitted while a round is carried across the
admission (rounds.py). Their first tokens stay on the device (prefill.py, `read=False`): the
round they join is queued from them, and only then are they read (`_land_joined`), so the device
does not wait for the host between the prefill and that round. A row that ends at its first
token (max_tokens 1 here) leaves its slot then, and the round queued with it drops what it made
there. Greedy text stays plain decoding's; the sampled side through refilled admissions is
test_engine_sampling's `mtp-refilled` chi-square.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.counters import Counters
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens, untrained_head


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    path = tiny_model("llama")
    bundle = load(path)
    head = untrained_head(bundle, tmp_path_factory.mktemp("head"))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 400, int(n)).tolist() for n in (3, 17, 6, 40, 9, 2, 25, 11, 5)]
    # staggered lengths so rows end at different rounds; every fifth row ends at its first token
    rows = [(prompts[i % len(prompts)], 1 if i % 5 == 3 else 4 + (i * 7) % 19) for i in range(36)]
    return bundle, str(head), str(tiny_model("llama", seed=1)), rows


def _engine(setup, method, width):
    bundle, head, draft, _ = setup
    spec = SpeculativeConfig(method=method.split("-")[0], depth=3, adaptive_depth=False, mtp_head=head if method != "draft" else None,
                             draft_model=draft if method == "draft" else None, mtp_lookup=2 if method == "mtp-lookup" else 0)
    return Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))


def _trace(eng):
    """Events in order: ('prefill', keys) per admission, 'launch' per queued round, ('first', key)
    when a row's first token reaches the host."""
    events = []
    run, launch, emit = eng.prefiller.run, eng.rounds.launch, eng.scheduler.emit

    def prefill(rows, *a, **k):
        events.append(("prefill", [r.req.key for r in rows]))
        return run(rows, *a, **k)

    def emitted(row, tokens):
        if not row.tokens and not row.stats.verify_calls and row.rounds == 0:
            events.append(("first", row.req.key))
        return emit(row, tokens)

    eng.prefiller.run = prefill
    eng.rounds.launch = lambda *a, **k: (events.append("launch"), launch(*a, **k))[1]
    eng.scheduler.emit = emitted
    return events


def _launches_before_first_tokens(events):
    """For every admission but the first (nothing is in flight then), how many rounds were queued
    between its prefill and the first of its rows' first tokens reaching the host."""
    out, at = [], None
    for e in events:
        if isinstance(e, tuple) and e[0] == "prefill":
            at = [0, set(e[1])]
        elif e == "launch" and at is not None:
            at[0] += 1
        elif isinstance(e, tuple) and e[0] == "first" and at is not None and e[1] in at[1]:
            out.append(at[0])
            at = None
    return out[1:]


@pytest.mark.parametrize("method", ["mtp", "mtp-lookup", "draft"])
def test_first_tokens_are_read_after_the_round_they_join_is_queued(setup, method):
    bundle, _, _, rows = setup
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    eng = _engine(setup, method, 6)
    events = _trace(eng)
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eng.eos), i
    seen = _launches_before_first_tokens(events)
    cache = eng.drafter.cache
    assert np.array_equal(cache.rows.host, np.array(cache.rows.device))
    # each admission behind a round in flight queued the round its rows join before reading them
    assert sum(n >= 1 for n in seen) >= 4, seen


def test_rows_that_end_at_their_first_token_behind_a_carried_round(setup):
    """Rows of max_tokens 1 admitted behind the round in flight: one token each, their slots refilled."""
    bundle, _, _, rows = setup
    many = [(rows[i % 9][0], 1 if i % 2 else 12) for i in range(30)]
    eng = _engine(setup, "mtp", 4)
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(many)]
    res = {r.key: r for r in eng.generate(reqs)}
    assert sorted(res) == list(range(30))
    for i, (p, m) in enumerate(many):
        assert res[i].tokens == reference_tokens(bundle.model, p, m, eng.eos), i
        assert res[i].finish_reason in ("length", "stop")


@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_an_admission_prefilled_on_a_stream_of_its_own_gives_the_same_text(setup, method):
    """The admission behind a round in flight prefills on its own stream (MLX orders
    the rounds after it through the arrays they share): the text stays plain decoding's."""
    bundle, _, _, rows = setup
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    eng = _engine(setup, method, 6)
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    assert eng.side_stream is not None
    for i, (p, m) in enumerate(rows):
        assert out[i] == reference_tokens(bundle.model, p, m, eng.eos), i


def test_on_a_gpu_an_admission_pads_its_rows_into_fewer_groups(monkeypatch):
    """A GPU prefill group costs its launches whatever its padding: an admission of rows of 73..208
    tokens is one group there (padded grid within 4x the real tokens), two on a CPU."""
    import mlx.core as mx

    from mtplx import prefill as prefill_mod

    lengths = [208, 177, 147, 199, 128, 73]

    class Runtime:
        model, split, want_hidden = None, False, False

    cpu = prefill_mod.Prefiller(Runtime(), 512, False, Counters())
    assert len(prefill_mod.length_groups(lengths, cpu.padding_waste)) == 2
    monkeypatch.setattr(prefill_mod.mx, "default_device", lambda: mx.Device(mx.gpu))
    gpu = prefill_mod.Prefiller(Runtime(), 512, False, Counters())
    assert len(prefill_mod.length_groups(lengths, gpu.padding_waste)) == 1
    assert len(prefill_mod.length_groups([16] + [600] * 3, gpu.padding_waste)) == 1
    assert len(prefill_mod.length_groups([10] * 4 + [600], gpu.padding_waste)) == 2  # 5 x 600 > 4 x 640
