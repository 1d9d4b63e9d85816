"""Host work per decode step: what the plain decoding loop does on the host besides the forward."""

import mtplx.rounds as rounds_mod
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.rounds import REFILL_AT
from mtplx.request import Request, SamplingParams
from tiny_models import reference_tokens


def _requests(n, temperature=0.0):
    return [Request(key=(i, 0), prompt_tokens=[3 + i, 17, 9, 40 + i], seed=i,
                    params=SamplingParams(max_tokens=12, temperature=temperature)) for i in range(n)]


def test_greedy_plain_rounds_draw_no_uniforms_and_keep_the_text(tiny_model, monkeypatch):
    """All-greedy plain decoding draws nothing from the rows' generators (a numpy round trip per
    row and step), and its tokens are still mlx-lm's own greedy ones; sampled rows draw."""
    bundle = load(tiny_model("llama"))
    engine = Engine(bundle, SpeculativeConfig(method="none"), ScheduleConfig(max_batch=4))
    calls = []
    real = rounds_mod.uniforms
    monkeypatch.setattr(rounds_mod, "uniforms", lambda rng: (calls.append(1), real(rng))[1])
    out = {r.key: r.tokens for r in engine.generate(_requests(4))}
    assert not calls
    for req in _requests(4):
        assert out[req.key] == reference_tokens(bundle.model, req.prompt_tokens, 12, engine.eos)
    list(engine.generate(_requests(2, temperature=1.0)))
    assert calls


def test_no_plain_round_is_queued_past_the_last_rows_length(tiny_model):
    """Rows that end by length: the round that gives their last token is the last forward (each
    round emits one token per row, so none is queued after it), at one row and at several; the
    text is still mlx-lm's."""
    bundle = load(tiny_model("llama"))
    for width, compiled in ((1, "on"), (1, "off"), (3, "on")):
        engine = Engine(bundle, SpeculativeConfig(method="none", compiled_verify=compiled), ScheduleConfig(max_batch=width))
        engine.eos.clear()  # every row runs to max_tokens
        forwards = []
        real = engine.rounds.verify
        engine.rounds.verify = lambda tokens, cache, *a: (forwards.append(tokens.shape[0]), real(tokens, cache, *a))[1]
        reqs = _requests(3)
        out = {r.key: r for r in engine.generate(reqs)}
        assert all(r.finish_reason == "length" and len(r.tokens) == 12 for r in out.values())
        # the first token of a row comes from its prefill: 11 decode forwards per row, rows batched
        assert len(forwards) == (33 if width == 1 else 11), (width, compiled, len(forwards))
        for req in reqs:
            assert out[req.key].tokens == reference_tokens(bundle.model, req.prompt_tokens, 12, set())


def test_with_requests_waiting_plain_rounds_refill_several_slots_at_once(tiny_model):
    """A refill drains the pipeline (the round in flight is read, admission prefills): at width 16
    with requests waiting, plain rounds return once 1/4 of the slots (4) are free, not at every
    finished row (rows of staggered lengths end one at a time); when none waits, they return once
    half the slots are idle; the text stays mlx-lm's greedy text."""
    bundle = load(tiny_model("llama"))
    for compiled in ("on", "off"):
        engine = Engine(bundle, SpeculativeConfig(method="none", compiled_verify=compiled), ScheduleConfig(max_batch=16))
        many = [Request(key=i, prompt_tokens=[3 + i % 7, 17, 9, 40 + i % 5], params=SamplingParams(max_tokens=4 + (i * 7) % 23))
                for i in range(40)]
        freed, inner = [], engine.rounds.run

        def counted(sched):
            yield from inner(sched)
            freed.append((sched.drained, sum(s is None for s in sched.slots), sched.live, len(sched.slots)))

        engine.rounds.run = counted
        out = {r.key: r.tokens for r in engine.generate(many)}
        for req in many:
            assert out[req.key] == reference_tokens(bundle.model, req.prompt_tokens, req.params.max_tokens, engine.eos)
        waiting = [free for drained, free, live, _ in freed if not drained and live]
        assert waiting and min(waiting) >= 16 // REFILL_AT == 4, freed
        assert all(live <= width // 2 or not live for drained, _, live, width in freed if drained), freed
