"""A drained batch's tail at tail widths whose programs were built ahead (mtplx/tail_widths.py).

Where the tail keeps its width (a GPU: Engine.TAIL_KEEPS_WIDTH), `tail_narrowest` lets a drained
batch move to narrower powers of two once its live rows fit them, for every method alike. Each
compiled program used at a wider width has its twins at the tail widths built with it, so every
narrow program the tail runs was built that way (`twins` counts them), none by the tail's own
rounds; the text is plain decoding's, and a sampled row's text is its seed's, narrowed or not.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtplx import tail_widths
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


def _engine(setup, method, narrowest, params=None):
    bundle, paths, _, _ = setup
    lookup = method == "mtp-lookup"  # MTP with prompt lookup on the device (speculative.mtp_lookup)
    method = "mtp" if lookup else method
    spec = SpeculativeConfig(method=method, depth=3, adaptive_depth=False, mtp_head=paths["mtp"] if method == "mtp" else None,
                             draft_model=paths["draft"] if method == "draft" else None, mtp_lookup=2 if lookup else 0)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=WIDTH, order="input"))
    eng.TAIL_KEEPS_WIDTH = WIDTH  # as on a GPU: the tail keeps the batch's width unless it may move to a tail width
    eng.tail_narrowest = narrowest
    widths = []  # the width of each call of the rounds, with the rounds it ran
    for name in ("_round", "_plain_rounds"):
        def counted(slots, *a, _inner=getattr(eng, name), **k):
            before = eng.counters["rounds"]
            out = yield from _inner(slots, *a, **k)
            widths.append((len(slots), eng.counters["rounds"] - before))
            return out
        setattr(eng, name, counted)
    return eng, widths


def _banks(eng):
    return [b for b in (eng.bank, getattr(eng.drafter, "bank", None)) if b is not None]


def _width_of(bank, key):
    return key[1] if isinstance(key[0], str) else key[0]


@pytest.mark.parametrize("method", ["none", "ngram", "mtp", "mtp-lookup", "draft"])
def test_the_tail_moves_to_tail_widths_built_ahead(setup, method):
    _, _, rows, refs = setup
    eng, widths = _engine(setup, method, narrowest=2)
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    assert [out[i] for i in range(len(rows))] == refs  # plain decoding's tokens
    ran = {w for w, n in widths if n}
    assert WIDTH in ran and min(ran) < WIDTH and ran <= {8, 4, 2}, widths
    for bank in _banks(eng):
        narrow = [k for k in bank._programs if _width_of(bank, k) < WIDTH]
        assert narrow, list(bank._programs)
        assert bank.stats["twins"] == len(narrow), (bank.stats, list(bank._programs))  # none built by a tail round
        assert not bank._broken, bank._broken


@pytest.mark.parametrize("method", ["none", "mtp"])
def test_without_twins_the_narrowed_tail_builds_its_own_programs(setup, method):
    """The CPU rule (TAIL_KEEPS_WIDTH 1) narrows without tail widths: the tail's rounds build them."""
    _, _, rows, refs = setup
    eng, widths = _engine(setup, method, narrowest=0)
    eng.TAIL_KEEPS_WIDTH = 1
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    assert [out[i] for i in range(len(rows))] == refs
    for bank in _banks(eng):
        assert bank.stats["twins"] == 0 and any(_width_of(bank, k) < WIDTH for k in bank._programs)


@pytest.mark.parametrize("method", ["none", "ngram", "mtp", "mtp-lookup", "draft"])
def test_a_sampled_row_keeps_its_text_in_a_narrowed_tail(setup, method):
    """A sampled row's text depends on its seed alone: the same with the tail kept at its width
    (whose sampled output is distribution-tested, test_engine_sampling.py) and moved to tail widths."""
    _, _, rows, _ = setup
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m, temperature=1.0, top_p=0.9), seed=7 + i)
            for i, (p, m) in enumerate(rows)]
    texts = []
    for narrowest in (0, 2):
        eng, widths = _engine(setup, method, narrowest)
        texts.append({r.key: r.tokens for r in eng.generate(reqs)})
        assert (min(w for w, n in widths if n) < WIDTH) == bool(narrowest), widths
    assert texts[0] == texts[1]


def test_the_widths():
    assert tail_widths.twin_widths(8, 32) == (8, 16)
    assert tail_widths.twin_widths(0, 32) == ()
    assert tail_widths.target(14, 32, keeps=32, narrowest=8) == 16
    assert tail_widths.target(17, 32, keeps=32, narrowest=8) is None
    assert tail_widths.target(3, 16, keeps=32, narrowest=8) == 8
    assert tail_widths.target(3, 8, keeps=32, narrowest=8) is None
    assert tail_widths.target(3, 32, keeps=32, narrowest=0) is None
    assert tail_widths.target(3, 32, keeps=1, narrowest=0) == 4  # the CPU rule, as before
    assert tail_widths.TAIL_NARROWEST == 0


def test_a_batch_narrowed_at_a_larger_capacity_finds_its_first_proposal_built(setup, monkeypatch):
    """Without capacity reserved at admission (generation.RESERVE_CAPACITY off) the rows cross a
    capacity bucket (256 -> 512) while the batch is wide, then narrow: the narrowed batch's first
    round proposes at the new capacity, where the wide batch never proposed (its drafts were made
    ahead in each commit), so that proposal's twins come with the wide commit's."""
    import mtplx.generation

    monkeypatch.setattr(mtplx.generation, "RESERVE_CAPACITY", False)
    bundle, paths, _, _ = setup
    rng = np.random.default_rng(9)
    rows = [(rng.integers(3, 400, 220 + i).tolist(), m) for i, m in enumerate([40, 64, 44, 70, 48, 58, 52, 66])]
    eos = set(bundle.tokenizer.eos_token_ids)
    eng, widths = _engine(setup, "mtp", narrowest=2)
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    assert [out[i] for i in range(len(rows))] == [reference_tokens(bundle.model, p, m, eos) for p, m in rows]
    assert min(w for w, n in widths if n) < WIDTH, widths
    bank = eng.drafter.bank
    assert ("propose", WIDTH) not in {k[:2] for k in bank._programs if k[3] == 512}  # never proposed wide there
    narrow = [k for k in bank._programs if k[1] < WIDTH]
    assert any(k[0] == "propose" and k[3] == 512 for k in narrow), narrow
    assert bank.stats["twins"] == len(narrow), list(bank._programs)
