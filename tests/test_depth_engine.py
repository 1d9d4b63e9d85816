"""The adaptive depth controller inside the engine: the round times it is fed are each round's own.

Rounds run one ahead (spec_rounds.py): while round r runs on the device, the host queues round
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

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.depth import EXPLORE_EVERY
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
    eng.clock = clock
    verify, propose = eng._verify, eng.drafter.propose

    def timed_verify(*a, **k):
        clock.now += verify_s
        return verify(*a, **k)

    def timed_propose(K, *a, **k):
        clock.now += step_s * K
        return propose(K, *a, **k)

    eng._verify, eng.drafter.propose = timed_verify, timed_propose
    chosen, choose = [], eng.depth_control.choose
    eng.depth_control.choose = lambda w: chosen.append(choose(w)) or chosen[-1]
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
