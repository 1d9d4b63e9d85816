"""Sampled speculative decoding follows the target distribution, end to end.

On a 16-token-vocabulary model (`make_small_vocab_model`, no eos) many rows with different seeds
run in one batched generate per method (ngram: point-mass drafts; draft: a different-seed draft
model; mtp: a random sidecar head drafting over the whole vocabulary, its q from the head), each
drafting depth 3 and emitting 16 tokens (at least four rounds); plain sampling (none) runs the same
rows. Every row is checked against the model's own distributions, computed apart from the engine
(one forward over the prompt and the row's tokens, shaped by the row's sampler in numpy):
- the first three tokens against their exact joint (one forward over all 16^2 two-token
  continuations): the pairs (t1, t2), (t2, t3) and t3;
- each position 1..16 against its distribution given the row's own prefix, and the same over the
  positions the rounds make special: the bonus token (sampled after all of a round's drafts
  passed) and the token after it (the next round's first, drafted from the state a full
  acceptance left). A spy on the rounds' landing records each row's accepted counts, which mark
  those positions. Rows' distributions differ, so each check is a chi-square over the sum of
  unequal multinomials (`chi2_conditional`), by token id and by the token's rank under its own
  distribution. A token of probability zero fails outright.

Negative controls: acceptance with a known bug (a bonus token from q or from the residual, a
residual that is p or not renormalized, the uniforms shifted by one), wired in where the engine
calls it (the eager acceptance in rounds.py, the compiled round program of graphbank.verify_round),
must fail the same checks on the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
DEPTH = 3
MAX_TOKENS = 16
ROWS = 300  # per setting; the controls run the same rows
SETTINGS = {  # a flat one (drafts often all pass: bonus tokens) and one with a support (top-k, top-p)
    "t1.5": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5),
    "topk_topp": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=6, top_p=0.85),
}
P_OK = 1e-5  # each of a run's ~80 checks: a correct engine fails one with probability ~1e-3
P_REJECT = P_OK / 10  # a known bug must fail the very checks the engine passes, with margin


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
    A count in a cell of probability zero (outside the sampler's support) gives p = 0."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    if counts[probs <= 0].sum() > 0:
        return float("inf"), 0, 0.0
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


def chi2_conditional(drawn, probs, min_expected=5.0):
    """Chi-square of draws against each draw's own distribution: `drawn` [N] categories, `probs` [N, C]
    the distribution each was drawn from. The counts are a sum of unequal multinomials: expected
    probs.sum(0), covariance sum(diag(p) - p p^T); cells expected below `min_expected` are pooled
    (with the next smallest while the pool is too). A draw of probability zero gives p = 0."""
    probs = np.asarray(probs, np.float64)
    rows = np.arange(len(drawn))
    if (probs[rows, drawn] <= 0).any():
        return float("inf"), 0, 0.0
    hits = np.zeros_like(probs)
    hits[rows, drawn] = 1.0
    exp = probs.sum(0)
    pool = exp < min_expected
    if pool.any() and exp[pool].sum() < min_expected and not pool.all():
        pool[np.flatnonzero(~pool)[np.argmin(exp[~pool])]] = True
    cells = lambda a: np.concatenate([a[:, ~pool], a[:, pool].sum(1, keepdims=True)], axis=1)[:, :-1]
    probs, hits = cells(probs), cells(hits)  # (the last cell is implied by the others)
    d = (hits - probs).sum(0)
    cov = np.diag(probs.sum(0)) - probs.T @ probs  # singular where a cell is certain for every draw
    stat, dof = float(d @ np.linalg.pinv(cov, hermitian=True) @ d), int(np.linalg.matrix_rank(cov, hermitian=True))
    return stat, dof, chi2_pvalue(stat, dof)


def by_rank(tokens, probs):
    """Each token's rank under its own distribution (0: the likeliest), and those distributions by rank."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranks = np.argsort(order, axis=-1)[np.arange(len(tokens)), tokens]
    return ranks, np.take_along_axis(probs, order, axis=-1)


def conditionals(model, tokens, params):
    """[rows, L, V]: the distribution of each row's token at each position given the prompt and the
    row's tokens before it (one forward over the whole rows, no cache), shaped by `params`."""
    seqs = np.concatenate([np.tile(PROMPT, (len(tokens), 1)), tokens], axis=1)
    logits = np.array(model(mx.array(seqs)).astype(mx.float32))[:, len(PROMPT) - 1 : -1]
    return _shape(logits, params)


@dataclass
class Samples:
    """Rows' tokens [rows, MAX_TOKENS] by setting, and where rounds put their bonus tokens."""

    tokens: dict = field(default_factory=dict)
    bonus: dict = field(default_factory=dict)  # [rows, MAX_TOKENS]: a fully accepted round's last token
    after: dict = field(default_factory=dict)  # the token after one (the next round's first)
    stats: dict = field(default_factory=dict)


def round_positions(rounds, length):
    """(bonus, after) masks over a row's `length` tokens from its rounds' (drafted, accepted): token 0
    is the prefill's, then each round emits its accepted drafts and one token more."""
    bonus, after = np.zeros(length, bool), np.zeros(length, bool)
    at, full = 1, False
    for drafted, kept in rounds:
        after[at] = full
        full = 0 < drafted == kept
        if at + kept < length:
            bonus[at + kept] = full
        at += kept + 1
        if at >= length:
            return bonus, after
    raise AssertionError(f"rounds {rounds} emit fewer than {length} tokens")


def spec_for(method, draft, depth=DEPTH, **kw):
    """A SpeculativeConfig for `method` (none, ngram, draft, mtp), its drafter from `draft` (paths)."""
    return SpeculativeConfig(method=method, depth=depth, **{"adaptive_depth": False, **kw},
                             draft_model=draft["draft"] if method == "draft" else None,
                             mtp_head=draft["mtp"] if method == "mtp" else None)


def sample_rows(bundle, spec, seed, rows=ROWS, max_batch=128, engine=None):
    """`rows` rows of each setting from one generate (seeds from `seed` on), with a spy on the rounds'
    landing that records each row's (drafted, accepted) per round and counts rounds landed after
    rows joined behind them (rounds.py: `Rounds.carried`)."""
    eng = engine or Engine(bundle, spec, ScheduleConfig(max_batch=max_batch))
    rounds, carried, land = {}, [0], eng.rounds.land

    def spy(sched, flight, out, *rest):
        carried[0] += any(s is not None and s is not r for s, r in zip(sched.slots, flight.rows))
        for i, row in enumerate(flight.rows):
            if flight.depths is not None and row is not None and sched.slots[i] is row:
                rounds.setdefault(row.req.key, []).append((int(flight.depths[i]), int(out[i, 0])))
        return land(sched, flight, out, *rest)

    eng.rounds.land = spy
    requests = [Request(key=(name, i), prompt_tokens=list(PROMPT), params=params, seed=seed + k * rows + i)
                for k, (name, params) in enumerate(SETTINGS.items()) for i in range(rows)]
    results = {}
    drafted = accepted = 0
    for r in eng.generate(requests):
        assert r.error is None and len(r.tokens) == MAX_TOKENS, (r.key, r.error, r.tokens)
        results[r.key] = r.tokens
        drafted += r.stats.drafted_tokens
        accepted += r.stats.accepted_tokens
    out = Samples()
    for name in SETTINGS:
        keys = [(name, i) for i in range(rows)]
        out.tokens[name] = np.array([results[k] for k in keys])
        if spec.method != "none":
            marks = [round_positions(rounds[k], MAX_TOKENS) for k in keys]
            out.bonus[name], out.after[name] = (np.array(m) for m in zip(*marks))
    bank = getattr(eng.drafter, "bank", None)
    out.stats = {
        "drafted": drafted, "accepted": accepted,
        "bonus": sum(int(b.sum()) for b in out.bonus.values()),
        "compiled_proposals": bank.stats["compiled_calls"] if bank is not None else 0,
        "landed_past_an_admission": carried[0],
        # rounds whose verify and sampled acceptance were one program (graphbank.verify_round)
        "folded_programs": sum(len(k) > 3 and k[3][0] == "sampled" for k in eng.bank.programs.built) if eng.bank else 0,
    }
    return out


def exactness_tests(model, samples):
    """(check, stat, dof, p) of every check of every setting's rows (the module docstring)."""
    out = []
    for name, params in SETTINGS.items():
        tokens = samples.tokens[name]
        out += [(f"{name} {t}", *r) for t, *r in distribution_tests(tokens[:, :3], exact_joint(model, params))]
        probs = conditionals(model, tokens, params)
        where = {f"position {j + 1}": np.s_[:, j] for j in range(tokens.shape[1])}
        if name in samples.bonus:
            where.update(bonus=samples.bonus[name], after_bonus=samples.after[name])
        for what, at in where.items():
            t, p = tokens[at], probs[at]
            if len(t) >= 20:
                out.append((f"{name} {what} by id", *chi2_conditional(t, p)))
                out.append((f"{name} {what} by rank", *chi2_conditional(*by_rank(t, p))))
    return out


def failed(tests, alpha=P_OK):
    return [f"{check}: chi2 {s:.1f} on {dof} dof, p={p:.2g}" for check, s, dof, p in tests if p < alpha]


def least(tests, label):
    """The check of least p, printed with `label` (pytest -s shows each run's power)."""
    worst = min(tests, key=lambda t: t[3])
    print(f"\n{label}: {len(failed(tests))} of {len(tests)} checks fail; least p {worst[3]:.2g} ({worst[0]})")
    return worst


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    from mtplx.training.train_head import TrainConfig, _init_head, save_sidecar

    target = tiny_model("small_vocab")
    draft = tiny_model("small_vocab", seed=1)
    bundle = load(target)
    assert bundle.model.model.embed_tokens.weight.shape[0] == V and not bundle.tokenizer.eos_token_ids
    head = tmp_path_factory.mktemp("mtp_head")
    save_sidecar(bundle, _init_head(bundle.model, TrainConfig(seed=2)), head, {})
    return bundle, {"draft": str(draft), "mtp": str(head)}


def run_rows(bundle, draft, method):
    """`method`-compiled: with the compiled programs (the verify folded with acceptance, the draft
    model's proposal); `method`-refilled: compiled, 32 rows in flight, so rows stream in as others
    finish and each admission happens behind a round still in flight; `method`-adaptive: compiled,
    adaptive depth on (each sampled row drafts a depth of its own, from its own counts)."""
    name, _, variant = method.partition("-")
    spec = spec_for(name, draft, compiled_verify="on" if variant else "off", adaptive_depth=variant == "adaptive")
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=32 if variant == "refilled" else 128))
    eng.depth_control.slope = UNTRIED_SLOPE  # a GPU's fixed cost per drafted token: sampled rows draft deep
    return sample_rows(bundle, spec, SEEDS[method], engine=eng)


SEEDS = {"none": 0, "ngram": 10**6, "draft": 2 * 10**6, "mtp": 3 * 10**6, "draft-compiled": 4 * 10**6,
         "mtp-refilled": 5 * 10**6, "mtp-compiled": 6 * 10**6, "ngram-compiled": 7 * 10**6,
         "mtp-adaptive": 8 * 10**6}


@pytest.mark.parametrize("method", list(SEEDS))
def test_sampled_output_follows_the_target_distribution(setup, method):
    bundle, draft = setup
    samples = run_rows(bundle, draft, method)
    stats = samples.stats
    if method != "none":
        # rounds really speculated: both outcomes often, and rounds that kept every draft
        assert 0.05 < stats["accepted"] / stats["drafted"] < 0.9, stats
        assert stats["bonus"] >= 50, stats
    if method == "draft-compiled":
        assert stats["compiled_proposals"] > 0, stats
    if "-" in method:
        assert stats["folded_programs"] > 0, stats
    if method == "mtp-refilled":
        assert stats["landed_past_an_admission"] > 20, stats
    tests = exactness_tests(bundle.model, samples)
    least(tests, f"{method} ({stats['bonus']} bonus tokens)")
    assert not failed(tests), failed(tests)


def _at(x, n):
    """x[b, n[b]] of [B, K, V]."""
    return mx.take_along_axis(x, n[:, None, None], axis=1)[:, 0]


def _proposal(p, drafts, q):
    """q, or the point masses on the drafts where they were proposed deterministically (prompt lookup)."""
    return q if q is not None else (mx.arange(p.shape[-1])[None, None] == drafts[..., None]).astype(mx.float32)


def _wrong_bonus(draw):
    """Acceptance whose bonus token (every draft kept) is `draw(p there, q of the last draft, u_accept,
    u_next)` instead of a draw from p there."""
    def accept(p, drafts, q, u_accept, u_next, limit=None):
        n, nxt = accept_sampled(p, drafts, q, u_accept, u_next, limit)
        full = (n == (drafts.shape[1] if limit is None else limit)) & (n > 0)
        q = _proposal(p, drafts, q)
        return n, mx.where(full, draw(_at(p, n), _at(q, mx.maximum(n - 1, 0)), u_accept, u_next), nxt)
    return accept


def _residual_bonus(p, q, u_accept, u_next):
    left = mx.maximum(p - q, 0.0)
    return sample_from(mx.where(left.sum(-1, keepdims=True) > 0, left, p), u_next)


def _residual_from_p(p, drafts, q, u_accept, u_next, limit=None):
    """After a rejection, resample from the target p instead of the residual max(0, p - q)."""
    n, _ = accept_sampled(p, drafts, q, u_accept, u_next, limit)
    return n, sample_from(_at(p, n), u_next)


def _residual_unnormalized(p, drafts, q, u_accept, u_next, limit=None):
    """After a rejection, the residual max(0, p - q) sampled as if it summed to 1: a uniform past its
    mass lands on the last token."""
    n, nxt = accept_sampled(p, drafts, q, u_accept, u_next, limit)
    q = _proposal(p, drafts, q)
    q_pad = mx.concatenate([q, mx.zeros_like(q[:, :1])], axis=1)
    left = mx.maximum(_at(p, n) - _at(q_pad, n), 0.0)
    wrong = mx.minimum((mx.cumsum(left, axis=-1) <= u_next[:, None]).sum(-1), p.shape[-1] - 1).astype(mx.int32)
    return n, mx.where(n < (drafts.shape[1] if limit is None else limit), wrong, nxt)


def _uniforms_off_by_one(p, drafts, q, u_accept, u_next, limit=None):
    """The next token reads the uniform before its own in a round's layout: the last draft's acceptance's."""
    return accept_sampled(p, drafts, q, u_accept, u_accept[:, -1], limit)


CONTROLS = {
    "bonus from q": _wrong_bonus(lambda p, q, u_accept, u_next: sample_from(q, u_next)),
    "bonus from the residual": _wrong_bonus(_residual_bonus),
    "residual from p": _residual_from_p,
    "residual not renormalized": _residual_unnormalized,
    "uniforms off by one": _uniforms_off_by_one,
}


@pytest.mark.parametrize("compiled", ["on", "off"])
@pytest.mark.parametrize("control", list(CONTROLS))
def test_a_known_acceptance_bug_fails_the_same_checks(setup, monkeypatch, control, compiled):
    """The engine's acceptance (eager: rounds.py; folded into the compiled round program:
    graphbank.verify_round) replaced by a known bug, on the very rows of the engine's own test: the
    checks that pass the engine reject it."""
    bundle, draft = setup
    calls = {"eager": 0, "folded": 0}

    def wired(where):
        def accept(*args):
            calls[where] += 1
            return CONTROLS[control](*args)
        return accept

    monkeypatch.setattr(mtplx.rounds, "accept_sampled", wired("eager"))
    monkeypatch.setattr(mtplx.graphbank, "accept_sampled", wired("folded"))
    samples = run_rows(bundle, draft, "mtp-compiled" if compiled == "on" else "mtp")
    assert calls["folded" if compiled == "on" else "eager"] > 0, calls
    assert compiled == "off" or samples.stats["folded_programs"] > 0
    worst = least(exactness_tests(bundle.model, samples), f"{control} ({'compiled' if compiled == 'on' else 'eager'})")
    assert worst[3] < P_REJECT, f"{control} went unnoticed: least p {worst[3]:.2g} ({worst[0]})"


@pytest.mark.parametrize("method,compiled", [("none", "off"), ("ngram", "off"), ("draft", "off"), ("draft", "on"), ("mtp", "off"),
                                             ("mtp", "on")])
def test_a_sampled_row_does_not_depend_on_its_batch_mates(setup, method, compiled):
    """A row's seed alone fixes its sampled text: alone, or next to other rows of other lengths
    (whose ends decide where the engine's calls end, and with them the rounds drafted ahead)."""
    bundle, draft = setup

    def run(requests):
        spec = spec_for(method, draft, compiled_verify=compiled)
        eng = Engine(bundle, spec, ScheduleConfig(max_batch=8))
        return {r.key: r.tokens for r in eng.generate(requests)}

    rows = [Request(("x", i), list(PROMPT), SamplingParams(max_tokens=12, temperature=1.0), seed=100 + i) for i in range(4)]
    mates = [Request(i, [1, 2, 3, 4, 5, 6][: i + 1], SamplingParams(max_tokens=30, temperature=1.0), seed=i) for i in range(5)]
    alone = {}
    for r in rows:
        alone.update(run([r]))
    batched = run(mates + rows)
    assert {k: batched[k] for k in alone} == alone
