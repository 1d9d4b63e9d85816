"""Sampled speculative decoding follows the target distribution, end to end.

On a 16-token-vocabulary model (`make_small_vocab_model`, no eos) the exact distribution of the
first three generated tokens is computed from the model's own logits: one batched forward over
all 16^2 two-token continuations of the prompt, each step shaped by the row's sampler
(temperature, top-k, top-p) in numpy. Many rows with different seeds run in one batched
generate per method; the empirical joint distributions of (t1, t2) and (t2, t3) and the marginal
of t3 are chi-square tested against the exact ones, for plain sampling (method none) and for
speculative sampling (ngram: point-mass drafts; draft: a different-seed draft model; mtp: a random
sidecar MTP head drafting over the whole vocabulary, its q from the head). Token 1
comes from the prefill; tokens 2 and 3 come from the first speculative round (depth 2), i.e.
from accepted drafts, residual resamples and bonus tokens. A run with a deliberately wrong
residual shows the test rejects what it should.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mtplx.graphbank
import mtplx.rounds
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.depth import UNTRIED_SLOPE
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from mtplx.sampling import accept_sampled, sample_from
from test_sampling import chi2_pvalue

V = 16
PROMPT = [3, 5, 7, 3, 5, 7, 3, 5]
ROWS_PER_SETTING = 1000
WRONG_ROWS_PER_SETTING = 600  # a wrong residual is far off: fewer rows show it
SETTINGS = {
    "t1": SamplingParams(max_tokens=4, temperature=1.0),
    "topk_topp": SamplingParams(max_tokens=4, temperature=0.8, top_k=6, top_p=0.85),
}
P_OK = 1e-4
P_REJECT = P_OK / 10  # a wrong residual must fail the very test above, with margin


def _shape(logits, params):
    """Independent numpy reference of the sampler-shaped distribution (rows of logits)."""
    x = logits.astype(np.float64) / params.temperature
    if params.top_k:
        kth = -np.sort(-x, axis=-1)[..., params.top_k - 1 : params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if 0 < params.top_p < 1:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p
        keep_sorted = before < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def exact_joint(model, params):
    """P[t1, t2, t3] of the first three tokens after PROMPT under the shaped sampler."""
    pairs = np.array([(a, b) for a in range(V) for b in range(V)], dtype=np.int32)
    seqs = np.concatenate([np.tile(PROMPT, (V * V, 1)), pairs], axis=1)
    logits = np.array(model(mx.array(seqs)).astype(mx.float32))  # [256, len+2, V]
    n = len(PROMPT)
    p1 = _shape(logits[0, n - 1], params)  # [V]
    p2 = _shape(logits[::V, n], params)  # [V(t1), V]: rows with t2 = 0 stand for each t1
    p3 = _shape(logits[:, n + 1], params).reshape(V, V, V)  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(joint.sum() - 1) < 1e-6
    return joint


def chi2_pooled(counts, probs, min_expected=5.0):
    """Chi-square of counts against probs, pooling cells expected below `min_expected`.
    Cells of probability zero must be empty (the sampler's support is respected)."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    assert counts[probs <= 0].sum() == 0, "a sequence of probability zero was generated"
    total = counts.sum()
    exp = probs * total
    big = exp >= min_expected
    obs_cells = list(counts[big]) + [counts[~big].sum()]
    exp_cells = list(exp[big]) + [exp[~big].sum()]
    obs_cells, exp_cells = np.array(obs_cells), np.array(exp_cells)
    keep = exp_cells > 0
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, dof, chi2_pvalue(stat, dof)


def distribution_tests(samples, joint):
    """(name, stat, dof, p) for the (t1, t2) pair, the (t2, t3) pair and the t3 marginal."""
    s = np.asarray(samples)
    c12 = np.zeros((V, V))
    np.add.at(c12, (s[:, 0], s[:, 1]), 1)
    c23 = np.zeros((V, V))
    np.add.at(c23, (s[:, 1], s[:, 2]), 1)
    c3 = np.bincount(s[:, 2], minlength=V)
    return [
        ("t1,t2", *chi2_pooled(c12, joint.sum(2))),
        ("t2,t3", *chi2_pooled(c23, joint.sum(0))),
        ("t3", *chi2_pooled(c3, joint.sum((0, 1)))),
    ]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    from mtplx.training.train_head import TrainConfig, _init_head, save_sidecar

    target = tiny_model("small_vocab")
    draft = tiny_model("small_vocab", seed=1)
    bundle = load(target)
    assert bundle.model.model.embed_tokens.weight.shape[0] == V and not bundle.tokenizer.eos_token_ids
    head = tmp_path_factory.mktemp("mtp_head")
    save_sidecar(bundle, _init_head(bundle.model, TrainConfig(seed=2)), head, {})
    exact = {name: exact_joint(bundle.model, params) for name, params in SETTINGS.items()}
    return bundle, {"draft": str(draft), "mtp": str(head)}, exact


def run_rows(bundle, draft, method, seed_base, rows=ROWS_PER_SETTING):
    """`method`-compiled: with the compiled programs (the verify, the draft model's proposal);
    `method`-adaptive: compiled, adaptive depth on (each sampled row drafts its own depth);
    `method`-refilled: compiled, 32 rows in flight, so rows stream in as others finish and each
    admission happens behind a round still in flight (rounds.py: `Rounds.carried`)."""
    refilled, adaptive = method.endswith("-refilled"), method.endswith("-adaptive")
    method, compiled = method.split("-")[0], "on" if method.endswith(("-compiled", "-refilled", "-adaptive")) else "off"
    spec = SpeculativeConfig(
        method=method, depth=2, adaptive_depth=adaptive, compiled_verify=compiled,
        draft_model=draft["draft"] if method == "draft" else None, mtp_head=draft["mtp"] if method == "mtp" else None,
    )
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=32 if refilled else 128))
    eng.depth_control.slope = UNTRIED_SLOPE  # sampled rows draft their own depth, at a GPU's fixed cost
    carried, land = [0], eng.rounds.land
    eng.rounds.land = lambda sched, flight, *a: (carried.__setitem__(0, carried[0] + any(
        s is not None and s is not r for s, r in zip(sched.slots, flight.rows))), land(sched, flight, *a))[1]
    requests = []
    for name, params in SETTINGS.items():
        for i in range(rows):
            requests.append(Request(key=(name, i), prompt_tokens=list(PROMPT), params=params, seed=seed_base + len(requests)))
    samples = {name: [] for name in SETTINGS}
    stats = {"drafted": 0, "accepted": 0}
    for r in eng.generate(requests):
        assert r.error is None and len(r.tokens) == 4, (r.key, r.error, r.tokens)
        samples[r.key[0]].append(r.tokens[:3])
        stats["drafted"] += r.stats.drafted_tokens
        stats["accepted"] += r.stats.accepted_tokens
    bank = getattr(eng.drafter, "bank", None)
    stats["compiled_proposals"] = bank.stats["compiled_calls"] if bank is not None else 0
    stats["landed_past_an_admission"] = carried[0]  # rounds read after rows joined behind them
    # rounds whose verify and sampled acceptance were one program (graphbank.verify_round)
    stats["folded_programs"] = sum(len(k) > 3 and k[3][0] == "sampled" for k in eng.bank.programs.built) if eng.bank else 0
    return samples, stats


SEEDS = {"none": 0, "ngram": 10**6, "draft": 2 * 10**6, "mtp": 3 * 10**6, "draft-compiled": 4 * 10**6,
         "mtp-refilled": 5 * 10**6, "mtp-compiled": 6 * 10**6, "mtp-adaptive": 7 * 10**6}


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "mtp", "draft-compiled", "mtp-refilled", "mtp-compiled",
                                    "mtp-adaptive"])
def test_sampled_output_follows_the_target_distribution(setup, method):
    bundle, draft, exact = setup
    samples, stats = run_rows(bundle, draft, method, SEEDS[method])
    if method != "none":
        # the first round really speculated, and both outcomes happened often
        assert stats["drafted"] >= 2 * len(SETTINGS) * ROWS_PER_SETTING
        assert 0.05 < stats["accepted"] / stats["drafted"] < 0.9, stats
    if method == "draft-compiled":
        assert stats["compiled_proposals"] > 0, stats
    if method.endswith(("-compiled", "-refilled", "-adaptive")):
        assert stats["folded_programs"] > 0, stats
    if method == "mtp-refilled":
        assert stats["landed_past_an_admission"] > 20, stats
    failures = []
    for name in SETTINGS:
        for test, stat, dof, p in distribution_tests(samples[name], exact[name]):
            if p < P_OK:
                failures.append(f"{method}/{name} {test}: chi2 {stat:.1f} on {dof} dof, p={p:.2g}")
    assert not failures, failures


def _wrong_residual(p, drafts, q, u_accept, u_next, limit=None):
    """After a rejection, resample from the target p instead of the residual max(0, p - q)."""
    n, _ = accept_sampled(p, drafts, q, u_accept, u_next, limit)
    return n, sample_from(mx.take_along_axis(p, n[:, None, None], axis=1)[:, 0], u_next)


@pytest.mark.parametrize("method", ["ngram", "draft", "mtp", "draft-compiled", "mtp-compiled"])
def test_a_wrong_residual_is_detected(setup, method, monkeypatch):
    bundle, draft, exact = setup
    monkeypatch.setattr(mtplx.rounds, "accept_sampled", _wrong_residual)
    monkeypatch.setattr(mtplx.graphbank, "accept_sampled", _wrong_residual)  # the round program's (verify_round)
    samples, _ = run_rows(bundle, draft, method, SEEDS[method], rows=WRONG_ROWS_PER_SETTING)
    worst = {name: min(p for _, _, _, p in distribution_tests(samples[name], exact[name])) for name in SETTINGS}
    assert max(worst.values()) < P_REJECT, f"a wrong residual went unnoticed: {worst}"


@pytest.mark.parametrize("method,compiled", [("none", "off"), ("ngram", "off"), ("draft", "off"), ("draft", "on"), ("mtp", "off"),
                                             ("mtp", "on")])
def test_a_sampled_row_does_not_depend_on_its_batch_mates(setup, method, compiled):
    """A row's seed alone fixes its sampled text: alone, or next to other rows of other lengths
    (whose ends decide where the engine's calls end, and with them the rounds drafted ahead)."""
    bundle, draft, _ = setup

    def run(requests):
        spec = SpeculativeConfig(method=method, depth=3, adaptive_depth=False, compiled_verify=compiled,
                                 draft_model=draft["draft"] if method == "draft" else None,
                                 mtp_head=draft["mtp"] if method == "mtp" else None)
        eng = Engine(bundle, spec, ScheduleConfig(max_batch=8))
        return {r.key: r.tokens for r in eng.generate(requests)}

    rows = [Request(("x", i), list(PROMPT), SamplingParams(max_tokens=12, temperature=1.0), seed=100 + i) for i in range(4)]
    mates = [Request(i, [1, 2, 3, 4, 5, 6][: i + 1], SamplingParams(max_tokens=30, temperature=1.0), seed=i) for i in range(5)]
    alone = {}
    for r in rows:
        alone.update(run([r]))
    batched = run(mates + rows)
    assert {k: batched[k] for k in alone} == alone
