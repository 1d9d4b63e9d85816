"""Sampling and speculative acceptance, vectorized over rows with their own settings.

Acceptance is the lossless rule over each row's sampler-shaped p (greedy: a one-hot): keep draft d with
probability min(1, p(d)/q(d)), then sample the residual max(0, p - q), or p after every draft. Uniforms
come from each row's own seeded generator, so a row's text does not depend on its batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from . import small_ops
from .request import SamplingParams


@dataclass
class SamplerBatch:
    temps: mx.array  # [B] float32; 0 for greedy rows
    top_p: mx.array  # [B]
    top_k: mx.array  # [B] int32; 0 means off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_params(cls, params: Sequence[Optional[SamplingParams]]) -> "SamplerBatch":
        ps = [p or SamplingParams() for p in params]
        temps = np.array([max(p.temperature, 0.0) for p in ps], dtype=np.float32)
        top_p = np.array([p.top_p if 0 < p.top_p < 1 else 1.0 for p in ps], dtype=np.float32)
        top_k = np.array([max(int(p.top_k), 0) for p in ps], dtype=np.int32)
        sampled = temps > 0
        return cls(mx.array(temps), mx.array(top_p), mx.array(top_k), all_greedy=not sampled.any(),
                   any_top_k=bool((top_k[sampled] > 0).any()), any_top_p=bool((top_p[sampled] < 1).any()))


def shaped_probs(logits: mx.array, s: SamplerBatch) -> mx.array:
    """[B, L, V] logits -> [B, L, V] probabilities each row actually samples from."""
    logits = logits.astype(mx.float32)
    V = logits.shape[-1]
    greedy = (s.temps <= 0)[:, None, None]
    one_hot = (mx.arange(V)[None, None, :] == mx.argmax(logits, axis=-1)[..., None]).astype(mx.float32)
    if s.all_greedy:
        return one_hot
    x = logits / mx.where(s.temps > 0, s.temps, 1.0)[:, None, None]
    if s.any_top_k:
        k = mx.where(s.top_k > 0, mx.minimum(s.top_k, V), V)
        kth = mx.take_along_axis(-mx.sort(-x, axis=-1), (k - 1)[:, None, None].astype(mx.int32) * mx.ones(x.shape[:-1] + (1,), mx.int32), axis=-1)
        x = mx.where(x >= kth, x, -mx.inf)
    p = mx.softmax(x, axis=-1)
    if s.any_top_p:
        p_sorted = -mx.sort(-p, axis=-1)
        before = mx.cumsum(p_sorted, axis=-1) - p_sorted
        kept = (before < s.top_p[:, None, None]).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(p_sorted, mx.maximum(kept - 1, 0).astype(mx.int32), axis=-1)
        p = mx.where(p >= threshold, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    return mx.where(greedy, one_hot, p)


def uniforms(rng: np.random.Generator, n: Optional[int] = None):
    """`n` uniforms (one if None) drawn as float32: a float64 draw cast to float32 may round to 1.0,
    and `sample_from` would then return the last token whatever its probability."""
    u = rng.random(n, dtype=np.float32)
    return np.float32(u) if n is None else u


def sample_from(probs: mx.array, u: mx.array) -> mx.array:
    """Inverse-CDF sampling: [..., V] probabilities and [...] uniforms in [0, 1) -> token ids."""
    cdf = mx.cumsum(probs, axis=-1)
    target = u * cdf[..., -1]
    idx = (cdf <= target[..., None]).sum(axis=-1)
    return mx.minimum(idx, probs.shape[-1] - 1).astype(mx.int32)


def _within(limit: Optional[mx.array], B: int, K: int) -> mx.array:
    """[B, K] mask of the drafts each row may keep (row b drafted limit[b] of the K)."""
    if limit is None:
        return mx.ones((B, K), mx.bool_)
    return small_ops.arange(K)[None, :] < limit[:, None]


def _kept(ok: mx.array) -> mx.array:
    """[B, K] bool -> [B] int32: each row's count of leading Trues, in one reduction."""
    K = ok.shape[1]
    return mx.where(ok, K, small_ops.arange(K)[None]).min(axis=1).astype(mx.int32)


def accept_greedy(target_logits: mx.array, drafts: mx.array, limit: Optional[mx.array] = None):
    """[B, K+1, V] logits, [B, K] drafts (row b's first limit[b] real) -> (accepted [B], next [B])."""
    best = mx.argmax(target_logits, axis=-1)  # [B, K+1], not cast: only the next token is
    K = drafts.shape[1]
    if K == 0:
        return mx.zeros((best.shape[0],), mx.int32), best[:, 0].astype(mx.int32)
    n = _kept(((drafts == best[:, :K]) & _within(limit, best.shape[0], K)))
    nxt = mx.take_along_axis(best, n[:, None], axis=1)[:, 0].astype(mx.int32)
    return n, nxt


def accept_sampled(p: mx.array, drafts: mx.array, q: Optional[mx.array], u_accept: mx.array, u_next: mx.array,
                   limit: Optional[mx.array] = None):
    """p [B, K+1, V], drafts [B, K], q [B, K, V] (None: point masses, as prompt lookup's), uniforms
    u_accept [B, K], u_next [B] -> (accepted count [B], next token [B])."""
    B, K1, V = p.shape
    K = K1 - 1
    if K == 0:
        return mx.zeros((B,), mx.int32), sample_from(p[:, 0], u_next)
    p_d = mx.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]
    if q is None:
        q = (mx.arange(V)[None, None, :] == drafts[..., None]).astype(mx.float32)
        q_d = mx.ones(p_d.shape, mx.float32)
    else:
        q_d = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    within = _within(limit, B, K)
    n = _kept((u_accept * q_d < p_d) & within)
    # Past a row's own drafts there is no proposal: the token there comes from p itself.
    q = mx.where(within[..., None], q, 0.0)
    q_pad = mx.concatenate([q, mx.zeros((B, 1, V), q.dtype)], axis=1)
    at = n[:, None, None]
    p_at = mx.take_along_axis(p, at, axis=1)[:, 0]
    q_at = mx.take_along_axis(q_pad, at, axis=1)[:, 0]
    residual = mx.maximum(p_at - q_at, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual, p_at)
    return n, sample_from(residual, u_next)
