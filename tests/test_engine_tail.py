"""A job's tail: once no request waits, a batch narrows as its rows finish, only where that pays.

On a CPU a round's cost follows its width, so a drained batch narrows to a power of two once half
its slots are idle. On a GPU a round of up to 32 rows costs about what one row's does, and every
narrower width compiles verify and draft programs of its own for a job's last few rounds (a short
job's fixed cost): there the batch keeps its width (`tail_keeps_width`, by device). Either
way the output is plain decoding's, token for token. And when every row in flight is within the
round's depth of its max_tokens, each drafts only what it can still emit but the round keeps its
shape, so the last rounds compile no shorter verify or draft programs.
"""

from __future__ import annotations

import numpy as np
import pytest

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
    rng = np.random.default_rng(11)
    # 12 rows at width 8: rows end at different rounds, the last ones after the source is drained
    rows = [(rng.integers(3, 400, int(n)).tolist(), int(m))
            for n, m in zip([5, 30, 9, 14, 3, 22, 7, 11, 18, 4, 26, 8], [2, 15, 4, 11, 6, 20, 3, 9, 13, 5, 17, 7])]
    eos = set(bundle.tokenizer.eos_token_ids)
    return bundle, str(head), rows, [reference_tokens(bundle.model, p, m, eos) for p, m in rows]


def _run(setup, method, keeps, monkeypatch):
    from mtplx import scheduler

    bundle, head, rows, refs = setup
    monkeypatch.setattr(scheduler, "tail_keeps_width", lambda: keeps)
    spec = SpeculativeConfig(method=method, depth=3, adaptive_depth=False, mtp_head=head if method == "mtp" else None)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=WIDTH, order="input"))
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    assert [out[i] for i in range(len(rows))] == refs  # plain decoding's tokens either way
    widths = {key[0] for key in eng.bank.programs.built}
    head_bank = getattr(eng.drafter, "bank", None)
    head_widths = {key[1] for key in head_bank.programs.built} if head_bank is not None else set()
    lengths = {key[1] for key in eng.bank.programs.built}
    return widths, head_widths, lengths


@pytest.mark.parametrize("method", ["none", "ngram", "mtp"])
def test_a_drained_batch_keeps_its_width_where_narrowing_does_not_pay(setup, method, monkeypatch):
    widths, head_widths, _ = _run(setup, method, WIDTH, monkeypatch)
    assert widths == {WIDTH}, widths  # no program compiled for a narrower tail
    assert head_widths <= {WIDTH}
    narrowed, head_narrowed, _ = _run(setup, method, 1, monkeypatch)  # the CPU rule: the tail narrows
    assert min(narrowed) < WIDTH and WIDTH in narrowed, narrowed
    if method == "mtp":
        assert min(head_narrowed) < WIDTH


def test_the_rule_follows_the_device():
    import mlx.core as mx

    from mtplx import scheduler

    assert scheduler.tail_keeps_width() == (32 if mx.default_device().type == mx.DeviceType.gpu else 1)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_the_last_rounds_keep_the_rounds_shape(setup, method, monkeypatch):
    """Rows within the depth of their max_tokens draft fewer (their own limit), but the round keeps
    its K: a fixed depth compiles verify programs of one length only, whatever the rows' ends."""
    _, _, lengths = _run(setup, method, WIDTH, monkeypatch)
    assert lengths == {4}, lengths  # depth 3: [pending, d1, d2, d3]


def test_the_mtp_lookup_history_and_the_head_cache_cross_a_capacity_bucket_together(setup):
    """With `mtp_lookup` the head's programs are keyed by the head cache's capacity and the row
    history's: both are grown at admission to what the rows can reach, so every program has one
    capacity, the same for both."""
    bundle, head, _, _ = setup
    rng = np.random.default_rng(4)
    rows = [(rng.integers(3, 400, n).tolist(), m) for n, m in [(220, 40), (226, 36), (231, 30), (240, 24)]]
    eos = set(bundle.tokenizer.eos_token_ids)
    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, mtp_head=head, mtp_lookup=2)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=4, order="input"))
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(rows)]
    out = {r.key: r.tokens for r in eng.generate(reqs)}
    assert [out[i] for i in range(len(rows))] == [reference_tokens(bundle.model, p, m, eos) for p, m in rows]
    keys = list(eng.drafter.bank.programs.built)
    assert {k[3] for k in keys} == {512}, keys  # the rows cross 256 entries: grown to 512 at once
    assert all(k[3] == k[-1] for k in keys), keys  # head cache capacity == history capacity in every program
