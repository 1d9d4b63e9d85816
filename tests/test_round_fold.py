"""A speculative round's verify and acceptance as one compiled program (graphbank.verify_round).

With the compiled verify on, a round's verify of [pending, drafts], its acceptance (greedy or
sampled), the committed counts, the lengths after them and the round's read [W, 2 + K] are one
program: no acceptance op runs eagerly. The text is plain decoding's (greedy; the sampled side is
test_engine_sampling's chi-square, `mtp-compiled`).
"""

from __future__ import annotations

import numpy as np
import pytest

import mtplx.rounds
from mtplx.config import ScheduleConfig, SpeculativeConfig
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
    rows = [(rng.integers(3, 400, int(n)).tolist(), int(m)) for n, m in zip([3, 17, 6, 40, 9], [9, 3, 12, 7, 5])]
    eos = set(bundle.tokenizer.eos_token_ids)
    return bundle, str(head), str(path), rows, [reference_tokens(bundle.model, p, m, eos) for p, m in rows]


def _run(setup, method, width, adaptive=False, lookup=0):
    bundle, head, path, rows, _ = setup
    spec = SpeculativeConfig(method=method, depth=3, adaptive_depth=adaptive, compiled_verify="on", mtp_lookup=lookup,
                             mtp_head=head if method == "mtp" else None, draft_model=path if method == "draft" else None)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width, order="input"))
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    return eng, {r.key: list(r.tokens) for r in eng.generate(reqs)}


def _no_eager_acceptance(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("acceptance ran eagerly, outside the round's program")
    monkeypatch.setattr(mtplx.rounds, "accept_greedy", refuse)
    monkeypatch.setattr(mtplx.rounds, "accept_sampled", refuse)


@pytest.mark.parametrize("method,width,adaptive,lookup", [("mtp", 1, False, 0), ("mtp", 4, False, 0), ("mtp", 3, True, 0),
                                                          ("mtp", 2, False, 2), ("draft", 3, False, 0)])
def test_a_folded_round_accepts_inside_its_program_and_decodes_as_plain(setup, monkeypatch, method, width, adaptive, lookup):
    _no_eager_acceptance(monkeypatch)
    eng, out = _run(setup, method, width, adaptive=adaptive, lookup=lookup)
    refs = setup[4]
    for i, ref in enumerate(refs):
        assert out[i] == ref, i
    folded = [k for k in eng.bank.programs.built if len(k) > 3]
    assert folded and all(k[3] == ("greedy",) for k in folded), list(eng.bank.programs.built)
    # every decode round's verify was a folded program: the bank's plain verifies are the first
    # tokens' and depth-0 rounds' only where the fold does not serve (none here)
    assert eng.bank.stats["compiled_calls"] >= eng.counters.rounds


def test_parity_modes_compare_the_verify_apart(setup):
    """parity / parity2 compare the compiled verify's logits with eager's: the round is not folded there."""
    bundle, head, _, rows, refs = setup
    spec = SpeculativeConfig(method="mtp", depth=2, adaptive_depth=False, compiled_verify="parity2", mtp_head=head)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=2, order="input"))
    out = {r.key: list(r.tokens) for r in eng.generate(
        [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)])}
    assert all(out[i] == refs[i] for i in range(len(rows)))
    assert not any(len(k) > 3 for k in eng.bank.programs.built)
