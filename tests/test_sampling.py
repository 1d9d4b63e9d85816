"""Speculative acceptance keeps the target distribution (mtplx/sampling.py), checked by counting.

`accept_sampled` gets 20k independent rows at once (one vectorized call): random target p and
draft q over a small vocabulary, drafts drawn from q (or fixed drafts with q=None, a point
mass). The first emitted token (the accepted first draft, else the residual sample) must be
distributed as p[0], and after an accepted first draft d1 the next emitted token as p[1 | d1].
A chi-square test decides; the same test applied to a deliberately wrong residual (resampling
from p instead of max(0, p - q)) must reject, which shows the sample size has the power to
catch the bug it is meant to catch.

The bonus token (drawn from p after every draft passed) and the token at a row's own depth limit
(rows of one call drafting different counts) are tested the same way against targets fixed per
position, with their own negative controls: a bonus drawn from the residual max(0, p - q), and a
limit applied by cutting the accepted count after the fact, must both be rejected.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mtplx.request import SamplingParams
from mtplx.sampling import SamplerBatch, accept_greedy, accept_sampled, sample_from, shaped_probs, uniforms

V, K, N = 8, 3, 20000
P_OK = 1e-3  # a correct sampler fails this with probability 1e-3 (seeds are fixed: deterministic)
P_REJECT = 1e-8  # a wrong residual must be rejected far beyond chance


def chi2_pvalue(stat: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty; ample for these thresholds)."""
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_test(observed: np.ndarray, expected_probs: np.ndarray):
    """(statistic, dof, p-value) of counts against probabilities; zero-probability cells must be empty."""
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(expected_probs, dtype=np.float64)
    total = observed.sum()
    assert not (observed[probs <= 0] > 0).any(), "a token of probability zero was emitted"
    exp = probs * total
    keep = exp > 0
    stat = float(((observed[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, dof, chi2_pvalue(stat, dof)


def test_chi2_pvalue_matches_known_quantiles():
    # chi-square 0.999 quantiles: dof 7 -> 24.32, dof 50 -> 86.66
    assert abs(chi2_pvalue(24.32, 7) - 1e-3) < 3e-4
    assert abs(chi2_pvalue(86.66, 50) - 1e-3) < 2e-4
    assert abs(chi2_pvalue(7.0, 7) - 0.43) < 0.03


def _dirichlet(rng, shape, alpha=0.7, zeros=0):
    x = rng.dirichlet([alpha] * V, size=shape)
    if zeros:  # a support like top-k leaves: some tokens have probability exactly zero
        flat = x.reshape(-1, V)
        for row in flat:
            row[rng.choice(V, zeros, replace=False)] = 0.0
            row /= row.sum()
    return x.astype(np.float32)


def _draw(rng, probs):
    """One token per row from probs [..., V] (host-side, independent of the engine's sampler)."""
    c = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[:-1])[..., None] * c[..., -1:]
    return np.minimum((c <= u).sum(axis=-1), V - 1)


class Case:
    """N rows: p0 [V] at position 0, P1 [V, V] (position 1 given d1), p2.. fixed; q likewise."""

    def __init__(self, seed, point_mass=False, zeros=0, q_equals_p=False):
        rng = np.random.default_rng(seed)
        self.p0 = _dirichlet(rng, (), zeros=zeros)
        self.P1 = _dirichlet(rng, (V,), zeros=zeros)  # target at position 1, given d1
        self.prest = _dirichlet(rng, (K - 1,), zeros=zeros)  # positions 2..K
        if q_equals_p:
            self.q0, self.Q1 = self.p0, self.P1
        else:
            self.q0 = _dirichlet(rng, ())
            self.Q1 = _dirichlet(rng, (V,))
        d1 = _draw(rng, np.broadcast_to(self.q0, (N, V)))
        d2 = _draw(rng, self.Q1[d1])
        rest = [_draw(rng, np.broadcast_to(self.prest[j], (N, V))) for j in range(K - 2)]
        self.drafts = np.stack([d1, d2] + rest, axis=1).astype(np.int32)
        if point_mass:
            # deterministic drafts (prompt lookup): any rule independent of the uniforms; d1 is
            # one of two likely tokens (a spread of d1 over all tokens would hide a wrong residual)
            top = np.argsort(-self.p0)
            self.drafts = ((np.arange(N)[:, None] * 3 + np.arange(K)[None]) % V).astype(np.int32)
            self.drafts[:, 0] = np.where(np.arange(N) % 3 == 0, top[1], top[0])
            self.drafts[:, 1] = self.P1[self.drafts[:, 0]].argmax(-1)
            self.q = None
        else:
            q = np.empty((N, K, V), np.float32)
            q[:, 0] = self.q0
            q[:, 1] = self.Q1[d1]
            q[:, 2:] = self.prest[: K - 2]  # later positions: q = p there (not what is tested)
            self.q = mx.array(q)
        d1 = self.drafts[:, 0]
        p = np.empty((N, K + 1, V), np.float32)
        p[:, 0] = self.p0
        p[:, 1] = self.P1[d1]
        p[:, 2:] = self.prest
        self.p = mx.array(p)
        self.u_accept = mx.array(rng.random((N, K)).astype(np.float32))
        self.u_next = mx.array(rng.random(N).astype(np.float32))

    def run(self, accept=accept_sampled):
        n, nxt = accept(self.p, mx.array(self.drafts), self.q, self.u_accept, self.u_next)
        return np.array(n), np.array(nxt)

    def first_tokens(self, n, nxt):
        return np.where(n >= 1, self.drafts[:, 0], nxt)

    def second_tokens(self, n, nxt):
        """For rows that kept d1: the next emitted token (d2 if kept, else the resample)."""
        kept = n >= 1
        second = np.where(n >= 2, self.drafts[:, 1], nxt)
        return kept, second


def wrong_residual_accept(p, drafts, q, u_accept, u_next):
    """The classic bug: after a rejection, resample from p instead of max(0, p - q)."""
    n, _ = accept_sampled(p, drafts, q, u_accept, u_next)
    p_at = mx.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    return n, sample_from(p_at, u_next)


def _first_token_test(case, accept=accept_sampled):
    n, nxt = case.run(accept)
    counts = np.bincount(case.first_tokens(n, nxt), minlength=V)
    return chi2_test(counts, case.p0)


def _second_token_test(case, accept=accept_sampled):
    """Pooled chi-square over d1 = a of the next token against P1[a], among rows that kept d1."""
    n, nxt = case.run(accept)
    kept, second = case.second_tokens(n, nxt)
    stat, dof = 0.0, 0
    for a in range(V):
        rows = kept & (case.drafts[:, 0] == a)
        if rows.sum() < 200:
            continue
        s, d, _ = chi2_test(np.bincount(second[rows], minlength=V), case.P1[a])
        stat, dof = stat + s, dof + d
    assert dof > 0
    return stat, dof, chi2_pvalue(stat, dof)


@pytest.mark.parametrize("zeros", [0, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_first_emitted_token_follows_target(seed, zeros):
    case = Case(seed, zeros=zeros)
    stat, dof, pv = _first_token_test(case)
    assert pv > P_OK, f"chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"
    # the drafts were really tried: some kept, some rejected
    n, _ = case.run()
    assert 0.05 < (n >= 1).mean() < 0.95


@pytest.mark.parametrize("zeros", [0, 3])
def test_first_emitted_token_follows_target_with_point_mass_drafts(zeros):
    case = Case(2, point_mass=True, zeros=zeros)
    stat, dof, pv = _first_token_test(case)
    assert pv > P_OK, f"chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"


@pytest.mark.parametrize("point_mass", [False, True])
def test_token_after_an_accepted_draft_follows_target(point_mass):
    case = Case(3, point_mass=point_mass)
    stat, dof, pv = _second_token_test(case)
    assert pv > P_OK, f"chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"


@pytest.mark.parametrize("point_mass", [False, True])
def test_wrong_residual_is_rejected(point_mass):
    """The test has the power to catch a wrong residual (same data, same sample size)."""
    case = Case(0 if not point_mass else 2, point_mass=point_mass)
    stat, dof, pv = _first_token_test(case, wrong_residual_accept)
    assert pv < P_REJECT, f"a wrong residual passed: chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"
    stat, dof, pv = _second_token_test(Case(3, point_mass=point_mass), wrong_residual_accept)
    assert pv < P_REJECT, f"a wrong residual passed at position 1: chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"


def test_identical_draft_and_target_accept_everything():
    case = Case(4, q_equals_p=True)
    n, _ = case.run()
    assert (n == K).all()


def test_no_drafts_samples_from_target():
    rng = np.random.default_rng(5)
    p0 = _dirichlet(rng, (), zeros=2)
    p = mx.array(np.broadcast_to(p0, (N, 1, V)).copy())
    n, nxt = accept_sampled(p, mx.zeros((N, 0), mx.int32), None, mx.zeros((N, 0)), mx.array(rng.random(N).astype(np.float32)))
    assert (np.array(n) == 0).all()
    _, _, pv = chi2_test(np.bincount(np.array(nxt), minlength=V), p0)
    assert pv > P_OK


def test_greedy_acceptance_keeps_the_argmax_prefix():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((5, K + 1, V)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = best[:, :K].copy()
    cut = np.array([0, 1, 2, 3, 3])  # first wrong position per row (3 = all right)
    for i, c in enumerate(cut):
        if c < K:
            drafts[i, c] = (best[i, c] + 1) % V
    n, nxt = accept_greedy(mx.array(logits), mx.array(drafts.astype(np.int32)))
    assert np.array(n).tolist() == cut.tolist()
    assert np.array(nxt).tolist() == [int(best[i, c]) for i, c in enumerate(cut)]
    # one-hot p through accept_sampled is the same rule whatever the uniforms
    onehot = (np.arange(V)[None, None] == best[..., None]).astype(np.float32)
    u = mx.array(rng.random((5, K)).astype(np.float32))
    n2, nxt2 = accept_sampled(mx.array(onehot), mx.array(drafts.astype(np.int32)), None, u, mx.array(rng.random(5).astype(np.float32)))
    assert np.array(n2).tolist() == cut.tolist() and np.array(nxt2).tolist() == np.array(nxt).tolist()


def _generator_about_to_draw_one():
    """A generator whose next float64 draw is >= 1 - 2**-25 (it rounds to 1.0 in float32)."""
    rng, skipped = np.random.default_rng(0), 0
    while True:
        x = rng.random(1 << 22)
        hit = np.nonzero(x >= 1 - 2.0**-25)[0]
        if hit.size:
            g = np.random.default_rng(0)
            g.bit_generator.advance(skipped + int(hit[0]))  # one 64-bit step per float64 draw
            return g
        skipped += x.size


def test_uniforms_are_below_one():
    """A row's uniforms never reach 1, whatever its generator's state: at u = 1, `sample_from`
    returns the last token id even when its probability is 0."""
    g = _generator_about_to_draw_one()
    old = np.random.Generator(type(g.bit_generator)())
    old.bit_generator.state = g.bit_generator.state
    assert np.float32(old.random()) == 1.0  # what a float64 draw cast to float32 gives here
    probs = mx.array([[0.5, 0.5, 0.0, 0.0]])
    assert np.array(sample_from(probs, mx.array([1.0]))).tolist() == [3]  # the bug's consequence
    u = np.concatenate([np.atleast_1d(uniforms(g)), uniforms(g, 1 << 22)])
    assert u.dtype == np.float32 and u.max() < 1.0
    assert set(np.array(sample_from(mx.broadcast_to(probs, (u.size, 4)), mx.array(u))).tolist()) == {0, 1}


def test_sample_from_inverse_cdf():
    probs = mx.array([[0.1, 0.0, 0.6, 0.3]] * 5)
    u = mx.array([0.0, 0.05, 0.1, 0.69, 0.999])
    assert np.array(sample_from(probs, u)).tolist() == [0, 0, 2, 2, 3]


def _np_shaped(logits, temperature, top_k, top_p):
    """Independent reference for the sampler-shaped distribution."""
    x = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if 0 < top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def test_shaped_probs_matches_reference():
    rng = np.random.default_rng(7)
    settings = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (1.3, 6, 0.7), (0.0, 0, 1.0), (1.0, 40, 1.0)]
    logits = rng.standard_normal((len(settings), 3, 16)).astype(np.float32) * 2
    sampler = SamplerBatch.from_params([SamplingParams(temperature=t, top_k=k, top_p=tp) for t, k, tp in settings])
    got = np.array(shaped_probs(mx.array(logits), sampler))
    for i, (t, k, tp) in enumerate(settings):
        for j in range(3):
            if t == 0:
                want = np.eye(16)[logits[i, j].argmax()]
            else:
                want = _np_shaped(logits[i, j], t, k, tp)
            np.testing.assert_allclose(got[i, j], want, atol=1e-5)


# ------------------------------------------------------------------ the bonus token and per-row limits


class FixedCase:
    """N rows with one target p[j] and one proposal q[j] per position j (the same for every row,
    whatever the drafts: a target that depends on position only is still a target), drafts drawn
    from q, and a per-row draft limit. A row that keeps all of its `limit` drafts emits its next
    token from p[limit] (the bonus when limit = K): no proposal was made there, so nothing may be
    subtracted from p."""

    def __init__(self, seed, limits=None):
        rng = np.random.default_rng(seed)
        self.p = _dirichlet(rng, (K + 1,), zeros=2)
        noise = _dirichlet(rng, (K,))
        self.q = (0.75 * self.p[:K] + 0.25 * noise).astype(np.float32)  # close to p: drafts often all pass
        self.q /= self.q.sum(-1, keepdims=True)
        self.drafts = np.stack([_draw(rng, np.broadcast_to(self.q[j], (N, V))) for j in range(K)], 1).astype(np.int32)
        self.limit = np.full(N, K, np.int64) if limits is None else rng.choice(limits, N)
        self.u_accept = mx.array(rng.random((N, K)).astype(np.float32))
        self.u_next = mx.array(rng.random(N).astype(np.float32))

    def run(self, accept=accept_sampled):
        p = mx.array(np.broadcast_to(self.p, (N, K + 1, V)).copy())
        q = mx.array(np.broadcast_to(self.q, (N, K, V)).copy())
        n, nxt = accept(p, mx.array(self.drafts), q, self.u_accept, self.u_next, mx.array(self.limit.astype(np.int32)))
        return np.array(n), np.array(nxt)

    def after_all_kept(self, accept=accept_sampled):
        """Pooled chi-square, over limit values, of the token after a row kept all its drafts."""
        n, nxt = self.run(accept)
        assert (n <= self.limit).all(), "a row kept drafts past its own limit"
        stat, dof, rows = 0.0, 0, 0
        for m in np.unique(self.limit):
            sel = (self.limit == m) & (n == m)
            if sel.sum() < 300:
                continue
            s, d, _ = chi2_test(np.bincount(nxt[sel], minlength=V), self.p[m])
            stat, dof, rows = stat + s, dof + d, rows + int(sel.sum())
        assert dof > 0 and rows > N // 10, "too few rows kept all their drafts: nothing was tested"
        return stat, dof, chi2_pvalue(stat, dof)


def residual_bonus_accept(p, drafts, q, u_accept, u_next, limit=None):
    """The bug to catch: the token after the kept drafts drawn from the residual max(0, p - q)
    with the last proposal's q, as if a draft had been rejected there."""
    n, nxt = accept_sampled(p, drafts, q, u_accept, u_next, limit)
    B, K1, _ = p.shape
    at = n[:, None, None]
    p_at = mx.take_along_axis(p, at, axis=1)[:, 0]
    q_last = mx.take_along_axis(q, mx.maximum(at - 1, 0), axis=1)[:, 0]
    res = mx.maximum(p_at - q_last, 0.0)
    res = mx.where(res.sum(-1, keepdims=True) > 0, res, p_at)
    lim = limit if limit is not None else mx.full((B,), K1 - 1, mx.int32)
    return n, mx.where((n == lim) & (n > 0), sample_from(res, u_next), nxt)


def unlimited_accept(p, drafts, q, u_accept, u_next, limit=None):
    """The bug to catch: the limit applied by cutting the accepted count after the fact, so the
    token at a row's limit is resampled from the residual of a draft it never proposed."""
    n, nxt = accept_sampled(p, drafts, q, u_accept, u_next)
    cut = mx.minimum(n, limit)
    B = p.shape[0]
    at = cut[:, None, None]
    p_at = mx.take_along_axis(p, at, axis=1)[:, 0]
    q_pad = mx.concatenate([q, mx.zeros((B, 1, p.shape[-1]), q.dtype)], axis=1)
    res = mx.maximum(p_at - mx.take_along_axis(q_pad, at, axis=1)[:, 0], 0.0)
    res = mx.where(res.sum(-1, keepdims=True) > 0, res, p_at)
    return cut, mx.where(cut < n, sample_from(res, u_next), nxt)


@pytest.mark.parametrize("seed", [7, 8])
def test_bonus_token_follows_target(seed):
    case = FixedCase(seed)
    stat, dof, pv = case.after_all_kept()
    assert pv > P_OK, f"bonus token: chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"
    # and the first emitted token (kept draft or residual) still follows p[0]
    n, nxt = case.run()
    first = np.where(n >= 1, case.drafts[:, 0], nxt)
    _, _, pv0 = chi2_test(np.bincount(first, minlength=V), case.p[0])
    assert pv0 > P_OK


def test_bonus_from_a_residual_is_rejected():
    stat, dof, pv = FixedCase(7).after_all_kept(residual_bonus_accept)
    assert pv < P_REJECT, f"a residual bonus passed: chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"


@pytest.mark.parametrize("seed", [9, 10])
def test_token_at_a_rows_depth_limit_follows_target(seed):
    """Rows of one call drafted 0..K tokens each (the rest of the [B, K] drafts is padding)."""
    case = FixedCase(seed, limits=[0, 1, 2, K])
    stat, dof, pv = case.after_all_kept()
    assert pv > P_OK, f"token at the row's limit: chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"


def test_a_limit_applied_after_acceptance_is_rejected():
    case = FixedCase(9, limits=[1, 2])
    stat, dof, pv = case.after_all_kept(unlimited_accept)
    assert pv < P_REJECT, f"a cut-after-the-fact limit passed: chi2 {stat:.1f} on {dof} dof, p={pv:.2g}"
