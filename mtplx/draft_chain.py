"""The draft-model method's proposal: K draft-model steps per round, as one compiled call.

A round that drafts K tokens runs the draft model K times, not K + 1 (as mlx-lm's
`speculative_generate_step` does): the draft cache stays one token behind the committed text,
so the first step of a round feeds two tokens, the last accepted one and the pending one, and
no accepted token needs a forward of its own. After a round the draft cache keeps exactly what
the target keeps, minus that last token (its commit is the target's own counts).

Rounds without drafts (depth 0: the depth controller found that drafting does not pay) run no
draft step at all: each row's tokens that the draft model has not seen wait in a backlog
(`Backlog`), which a drafting round feeds first, in one forward (eagerly: it is rare), and
which is fed once it holds `MAX_BACKLOG` tokens.

`DraftChainBank`: the K steps (draft forwards, the sampler and its draws) as one `mx.compile`d
program over a shadow of the draft cache, as the verify bank does (graphbank.py), keyed by
(batch width, K, capacity bucket, sampler flags); the lengths enter as an array, so one program
serves every round of its shape. Attention-only draft caches compile; a recurrent draft model
(whose state is kept per step, see DraftModelDrafter) drafts eagerly. `draft_chain` is the math
both paths run: the compiled drafts must equal the eager ones.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from . import small_ops
from .cache import BatchCache
from .graphbank import _shadow_cache, _shadow_outputs
from .sampling import SamplerBatch, sample_from, shaped_probs

MAX_BACKLOG = 64  # tokens a row's draft cache may lag behind before a round without drafts feeds them
# (on a launch-bound GPU a forward of 64 costs little more than one of 1; at depth 0 a catch-up a try of
# drafting, every depth.EXPLORE_MOST rounds)


def fit_vocab(logits: mx.array, vocab: int) -> mx.array:
    """Draft logits over the target's vocabulary: cut, or padded with -inf (never drafted)."""
    V = logits.shape[-1]
    if V == vocab:
        return logits
    if V > vocab:
        return logits[..., :vocab]
    pad = mx.full(logits.shape[:-1] + (vocab - V,), -mx.inf, logits.dtype)
    return mx.concatenate([logits, pad], axis=-1)


def pick(logits: mx.array, sampler: SamplerBatch, u: mx.array, vocab: int):
    """One draft per row from [W, V'] draft logits: (ids [W], q [W, vocab], or None when every row
    is greedy: greedy acceptance needs no q, and the softmax over the vocabulary is skipped)."""
    if sampler.all_greedy:
        return mx.argmax(logits[..., :vocab], axis=-1).astype(mx.int32), None
    q = shaped_probs(fit_vocab(logits, vocab)[:, None], sampler)[:, 0]
    return sample_from(q, u).astype(mx.int32), q


def draft_chain(step: Callable[[mx.array, int], mx.array], feed: mx.array, sampler: SamplerBatch, u: mx.array,
                K: int, vocab: int) -> Tuple[mx.array, Optional[mx.array]]:
    """K drafts per row. `step(tokens [W, L], j) -> logits [W, L, V']` runs the draft model over
    step j's tokens and writes its cache: step 0 feeds `feed` [W, 2] (the last accepted token,
    the pending one), step j > 0 the draft of step j - 1. Returns drafts [W, K] and q [W, K, vocab]
    (None when every row is greedy)."""
    logits = step(feed, 0)[:, -1]
    drafts, qs = [], []
    for j in range(K):
        if j:
            logits = step(drafts[-1][:, None], j)[:, 0]
        tok, q = pick(logits, sampler, u[:, j], vocab)
        drafts.append(tok)
        qs.append(q)
    return small_ops.columns(drafts), (None if qs[0] is None else mx.stack(qs, axis=1))


def chain_seconds(chain: Callable[[], Optional[mx.array]], clock: Callable[[], float],
                  repeats: int = 3) -> Optional[float]:
    """Seconds a call of `chain()` (queues a round's draft steps, returns the drafts, or None where
    it cannot run: then None) takes: one untimed (it builds programs and kernels), then `repeats`
    queued as rounds are, each read while the next one runs."""
    last = chain()
    if last is None:
        return None
    np.array(last)
    started, last = clock(), None
    for _ in range(repeats):
        drafts = chain()
        mx.async_eval(drafts)
        if last is not None:
            np.array(last)
        last = drafts
    np.array(last)
    return (clock() - started) / repeats


class Backlog:
    """Per row, the tokens the draft cache has not seen yet, before the pending one: one (the last
    accepted token) after a drafting round, one more after each round without drafts."""

    def __init__(self):
        self.tokens: Optional[mx.array] = None  # [W, MAX_BACKLOG] int32, the first `size[i]` real
        self.size = np.zeros(0, dtype=np.int64)

    @staticmethod
    def row(last_prompt_token: int) -> mx.array:
        """A new row's backlog: its prompt's last token (the draft model prefilled the others)."""
        out = np.zeros((1, MAX_BACKLOG), dtype=np.int32)
        out[0, 0] = int(last_prompt_token)
        return mx.array(out)

    def after_round(self, last_accepted: mx.array):
        """A drafting round committed: each row's backlog is its last accepted token [W]."""
        W = last_accepted.shape[0]
        self.tokens = mx.concatenate([last_accepted[:, None].astype(mx.int32),
                                      mx.zeros((W, MAX_BACKLOG - 1), mx.int32)], axis=1)
        self.size = np.ones(W, dtype=np.int64)

    def append(self, pending: mx.array, live: np.ndarray):
        """A round without drafts committed the pending token of each live row: it joins the backlog."""
        at = mx.array(np.where(live, self.size, -1).astype(np.int32))
        self.tokens = mx.where(mx.arange(MAX_BACKLOG)[None] == at[:, None], pending[:, None].astype(mx.int32),
                               self.tokens)
        self.size = self.size + live

    def drop(self, m: np.ndarray):
        """The first m[i] tokens of each row were fed to the draft model."""
        shift = mx.array(m.astype(np.int32))
        idx = mx.minimum(mx.arange(MAX_BACKLOG)[None] + shift[:, None], MAX_BACKLOG - 1)
        self.tokens = mx.take_along_axis(self.tokens, idx, axis=1)
        self.size = self.size - m


def _capacity_ready(cache: BatchCache, L: int) -> Optional[list]:
    """The cache's arrays with room for L more entries per row, or None when it cannot be compiled over."""
    if any(k != "kv" for k in cache.kinds) or any(c.keys is None for c in cache.layers):
        return None
    for c in cache.layers:
        c._ensure_capacity(cache.batch, c.keys, c.values, cache.rows.max + L)
    return [a for c in cache.layers for a in c.state_arrays()]


class DraftChainBank:
    """The K draft steps of a round as compiled programs over a shadow of the draft model's cache."""

    def __init__(self, model, vocab: int):
        self.model = model
        self.vocab = vocab
        self._programs: Dict[Tuple, Callable] = {}
        self._broken: Dict[Tuple, str] = {}
        self.stats: Dict[str, object] = {"compiled_calls": 0, "eager_calls": 0, "programs": 0,
                                         "fallback_reasons": {},
                                         # "width W depth K": (ms compiled, ms eager), DraftModelDrafter.measure
                                         "measured_ms": {}}

    def _eager(self, reason: str):
        self.stats["eager_calls"] += 1
        reasons = self.stats["fallback_reasons"]
        reasons[reason] = reasons.get(reason, 0) + 1

    def _program(self, key, kinds, K: int, flags):
        fn = self._programs.get(key)
        if fn is not None:
            return fn
        model, vocab = self.model, self.vocab

        def run(feed, u, temps, top_p, top_k, lengths, *arrays):
            state = {"arrays": list(arrays), "lengths": lengths}

            def step(tokens, j):
                shadow = _shadow_cache(kinds, state["lengths"], state["arrays"])
                logits = model(tokens, cache=shadow.layers)
                state["arrays"] = _shadow_outputs(shadow)
                state["lengths"] = state["lengths"] + tokens.shape[1]
                return logits

            s = SamplerBatch(temps, top_p, top_k, *flags)
            drafts, q = draft_chain(step, feed, s, u, K, vocab)
            return (drafts, mx.zeros((0,)) if q is None else q) + tuple(state["arrays"])

        fn = self._programs[key] = mx.compile(run)
        self.stats["programs"] = len(self._programs)
        return fn

    def propose(self, cache: BatchCache, feed: mx.array, sampler: SamplerBatch, u: mx.array, K: int):
        """Drafts [W, K] and q (or None), the draft cache's arrays written past each row's length
        (its lengths are not moved: the round's commit does that); None when this runs eagerly."""
        arrays = _capacity_ready(cache, feed.shape[1] + K)
        if arrays is None:
            self._eager("cache not compilable (recurrent layers, or empty)")
            return None
        flags = (sampler.all_greedy, sampler.any_top_k, sampler.any_top_p)
        key = (cache.batch, K, arrays[0].shape[2]) + flags
        if key in self._broken:
            self._eager(self._broken[key])
            return None
        args = [feed, u, sampler.temps, sampler.top_p, sampler.top_k, cache.rows.device, *arrays]
        try:
            out = self._program(key, list(cache.kinds), K, flags)(*args)
        except Exception as e:  # a program that cannot compile: draft eagerly, say why
            self._broken[key] = f"compile failed: {type(e).__name__}: {e}"
            self._eager(self._broken[key])
            return None
        it = iter(out[2:])
        for layer in cache.layers:
            layer.keys, layer.values = next(it), next(it)
        self.stats["compiled_calls"] += 1
        return out[0], (out[1] if out[1].size else None)
