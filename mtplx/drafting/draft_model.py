"""The draft-model method: a smaller model with the target's vocabulary drafts K tokens a round.

The draft cache stays one token behind, so a round's first step feeds the last accepted and the pending
token (K forwards, not K + 1). Each shape drafts through whichever of the compiled chain and the eager
steps its first proposal timed faster (a 0.5B draft on the H200: 12.5 ms eager, 16.8 compiled)."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import small_ops
from ..cache import BatchCache, RowStateCache
from ..config import SpeculativeConfig
from ..gdn import install_capture
from ..graphbank import Programs, mirror, shadow_cache, shadow_outputs
from ..models.loading import ModelBundle
from ..recurrent import install_stepping
from ..sampling import SamplerBatch, sample_from, shaped_probs
from .base import CachedDrafter, DraftBank

MAX_BACKLOG = 64  # tokens a row's draft cache may lag (a launch-bound forward of 64 costs about one of 1)


def fit_vocab(logits: mx.array, vocab: int) -> mx.array:
    """Draft logits over the target's vocabulary: cut, or padded with -inf (never drafted)."""
    V = logits.shape[-1]
    if V >= vocab:
        return logits[..., :vocab] if V > vocab else logits
    return mx.concatenate([logits, mx.full(logits.shape[:-1] + (vocab - V,), -mx.inf, logits.dtype)], axis=-1)


def pick(logits: mx.array, sampler: SamplerBatch, u: mx.array, vocab: int):
    """One draft per row from [W, V'] draft logits: (ids, q [W, vocab], None when every row is greedy)."""
    if sampler.all_greedy:
        return mx.argmax(logits[..., :vocab], axis=-1).astype(mx.int32), None
    q = shaped_probs(fit_vocab(logits, vocab)[:, None], sampler)[:, 0]
    return sample_from(q, u).astype(mx.int32), q


def draft_chain(step: Callable[[mx.array, int], mx.array], feed: mx.array, sampler: SamplerBatch, u: mx.array,
                K: int, vocab: int) -> Tuple[mx.array, Optional[mx.array]]:
    """(drafts [W, K], q [W, K, vocab] or None). `step(tokens, j) -> logits` runs the draft model: step 0
    over `feed` [W, 2] (last accepted, pending), step j over step j - 1's draft."""
    logits = step(feed, 0)[:, -1]
    drafts, qs = [], []
    for j in range(K):
        if j:
            logits = step(drafts[-1][:, None], j)[:, 0]
        tok, q = pick(logits, sampler, u[:, j], vocab)
        drafts.append(tok)
        qs.append(q)
    return small_ops.columns(drafts), (None if qs[0] is None else mx.stack(qs, axis=1))


class DraftChainBank(DraftBank):

    def __init__(self, model, vocab: int, programs: Programs):
        super().__init__(programs)
        self.model = model
        self.vocab = vocab
        self.stats["measured_ms"] = {}  # "width W depth K": (ms compiled, ms eager)

    def _build(self, kinds, K: int, flags):
        model, vocab = self.model, self.vocab

        def run(feed, u, temps, top_p, top_k, lengths, *arrays):
            state = {"arrays": list(arrays), "lengths": lengths}

            def step(tokens, j):
                shadow = shadow_cache(kinds, state["lengths"], state["arrays"])
                logits = model(tokens, cache=shadow.layers)
                state["arrays"] = shadow_outputs(shadow)
                state["lengths"] = state["lengths"] + tokens.shape[1]
                return logits

            drafts, q = draft_chain(step, feed, SamplerBatch(temps, top_p, top_k, *flags), u, K, vocab)
            return (drafts, mx.zeros((0,)) if q is None else q) + tuple(state["arrays"])
        return run

    def propose(self, cache: BatchCache, feed: mx.array, sampler: SamplerBatch, u: mx.array, K: int):
        """(drafts, q or None), lengths not moved; None where this runs eagerly."""
        arrays = self.ready(cache, feed.shape[1] + K)
        if arrays is None:
            return None
        flags = (sampler.all_greedy, sampler.any_top_k, sampler.any_top_p)
        key = (cache.batch, K, arrays[0].shape[2]) + flags
        out = self.call(key, lambda: self._build(list(cache.kinds), K, flags), feed, u, sampler.temps, sampler.top_p,
                        sampler.top_k, cache.rows.device, *arrays)
        if out is None:
            return None
        mirror(cache, out[2:])
        return out[0], (out[1] if out[1].size else None)


class DraftModelDrafter(CachedDrafter):
    """`measure`: each shape drafts through the chain its first proposal timed faster."""

    name = "draft"
    device_side = True
    programs = 2  # the round's verify, the draft chain
    margin = MAX_BACKLOG  # a backlog fed at once (a round's feed and drafts are fewer)
    clock = staticmethod(time.perf_counter)  # what the two chains are timed with (tests inject one)

    def __init__(self, draft_model, vocab_size: int, chunk_size: int = 512, compiled: bool = True,
                 measure: bool = False, counters=None):
        super().__init__(counters)
        install_capture(draft_model)  # a recurrent draft's rollback
        install_stepping(draft_model)
        self.model = draft_model
        self.vocab = vocab_size
        self.chunk = chunk_size
        self.bank = DraftChainBank(draft_model, vocab_size, Programs(self.counters)) if compiled else None
        self.measure = measure
        self.compiled_pays: Dict[tuple, bool] = {}  # (width, K, sampler flags) -> the compiled chain was faster
        # the tokens each row's draft cache has not seen, before the pending one: extra[0][i, :backlog[i]]
        self.extra: List[mx.array] = []
        self.backlog = np.zeros(0, dtype=np.int64)
        self._state_layers: List[RowStateCache] = []
        self._steps: Optional[list] = None  # each recurrent layer's state per token fed this round

    def prefill_row(self, tokens, hidden, first_token, prefix=None, edge=0):
        """(cache of the prompt but its last token, [backlog: the last], recurrent snapshot at `edge`)."""
        cache = BatchCache.for_model(self.model, 1)
        start, end = 0, len(tokens) - 1
        if prefix is not None:
            cache.write_row(0, prefix)
            start = prefix[0]
        cut = [edge] if start < edge <= end else []
        bounds = sorted({*range(start, end, self.chunk), *cut, end})
        at_edge = None
        for s, e in zip(bounds, bounds[1:]):
            self.model(mx.array(tokens[s:e], dtype=mx.int32)[None], cache=cache.layers)
            cache.commit([e - s])
            if e < end:  # the last part is evaluated with the row's first round
                cache.eval()
            if cut and e == edge and any(isinstance(c, RowStateCache) for c in cache.layers):
                at_edge = cache.snapshot_row(0)
        backlog = np.zeros((1, MAX_BACKLOG), dtype=np.int32)
        backlog[0, 0] = tokens[-1]
        return cache, [mx.array(backlog)], at_edge

    def probe(self):
        return self.prefill_row([0, 0], None, 0)

    def snapshot(self, state, length, hidden_at_edge=None):
        at_edge = state[2]
        return at_edge if at_edge is not None and at_edge[0] == length else state[0].snapshot_row(0, length)

    def reset(self):
        super().reset()
        self.backlog = np.zeros(0, dtype=np.int64)

    def extend(self, states):
        super().extend(states)
        self.backlog = np.concatenate([self.backlog, np.ones(len(states), dtype=np.int64)])

    def write(self, slot, state):
        super().write(slot, state)
        self.backlog[slot] = 1

    def take(self, keep):
        super().take(keep)
        self.backlog = self.backlog[np.asarray(keep, dtype=np.int64)]

    def _feed(self, tokens: mx.array, counts: np.ndarray):
        """The draft model over tokens [W, L], each row keeping counts[i]; recurrent states go to `_steps`."""
        self.cache.set_capturing(True)
        logits = self.model(tokens, cache=self.cache.layers)
        self.cache.set_capturing(False)
        if self._state_layers and self._steps is not None:
            for t in range(tokens.shape[1]):
                self._steps.append([[None if s is None else s[:, t] for s in c._steps] for c in self._state_layers])
        self.cache.advance(mx.array(counts.astype(np.int32)), counts, exact=True)
        return logits

    def _catch_up(self, keep: int):
        m = np.maximum(self.backlog - keep, 0)
        if not m.any():
            return
        L = 1 << (int(m.max()) - 1).bit_length()  # few shapes
        self._steps = None
        self._feed(self.extra[0][:, :L], m)
        idx = mx.minimum(mx.arange(MAX_BACKLOG)[None] + mx.array(m.astype(np.int32))[:, None], MAX_BACKLOG - 1)
        self.extra[0] = mx.take_along_axis(self.extra[0], idx, axis=1)  # the fed tokens dropped
        self.backlog = self.backlog - m

    def _restore_states(self, counts: mx.array):
        """Each recurrent layer's state after each row's counts[i] tokens of the round."""
        for li, layer in enumerate(self._state_layers):
            for i in range(len(layer.cache)):
                steps = [s[li][i] for s in self._steps]
                if any(x is None for x in steps):
                    continue
                stacked = mx.stack(steps, axis=1)
                idx = counts.reshape((-1,) + (1,) * (stacked.ndim - 1))
                layer.cache[i] = mx.take_along_axis(stacked, idx, axis=1).squeeze(1)
        self._steps = None

    def propose(self, K, pending, sampler, u):
        self._state_layers = [c for c in self.cache.leaves if isinstance(c, RowStateCache)]
        self._steps = None
        self._catch_up(keep=1)
        feed = mx.concatenate([self.extra[0][:, :1], pending[:, None].astype(mx.int32)], axis=1)
        self.start = self.cache.rows.mark()
        out = self.bank.propose(self.cache, feed, sampler, u, K) if self._compiled_pays(K, feed, sampler, u) else None
        return out if out is not None else self.eager_chain(K, feed, sampler, u)

    def eager_chain(self, K, feed, sampler, u):
        """The K draft steps eagerly, keeping recurrent states after every token for the commit."""
        self._steps = [[list(c.cache) for c in self._state_layers]] if self._state_layers else None
        W = self.cache.batch
        step = lambda tokens, j: self._feed(tokens, np.full(W, tokens.shape[1], dtype=np.int64))
        return draft_chain(step, feed, sampler, u, K, self.vocab)

    def _compiled_pays(self, K, feed, sampler, u) -> bool:
        if self.bank is None:
            return False
        if not self.measure or self._state_layers:  # a recurrent draft drafts eagerly anyway
            return True
        key = (self.cache.batch, K, sampler.all_greedy, sampler.any_top_k, sampler.any_top_p)
        if key not in self.compiled_pays:
            compiled = self._seconds(K, feed, sampler, u, True)
            if compiled is None:  # an empty cache: the bank drafts eagerly itself, for now
                return True
            eager = self._seconds(K, feed, sampler, u, False)
            self.compiled_pays[key] = compiled <= eager
            self.bank.stats["measured_ms"][f"width {key[0]} depth {K}"] = (round(1e3 * compiled, 3), round(1e3 * eager, 3))
        if not self.compiled_pays[key]:
            self.bank.eager("the eager steps measured faster at this width and depth")
        return self.compiled_pays[key]

    def _seconds(self, K, feed, sampler, u, compiled: bool) -> Optional[float]:
        """Seconds this round's chain takes, queued as rounds are after an untimed run, or None."""
        def chain():
            out = self.bank.propose(self.cache, feed, sampler, u, K) if compiled else self.eager_chain(K, feed, sampler, u)
            self.cache.rows.restore(self.start)
            return None if out is None else out[0]

        last = chain()
        if last is None:
            return None
        np.array(last)
        started, last = self.clock(), None
        for _ in range(3):
            drafts = chain()
            mx.async_eval(drafts)
            if last is not None:
                np.array(last)
            last = drafts
        np.array(last)
        return (self.clock() - started) / 3

    def commit(self, n_accept, next_tokens, drafts, active, verify_in=None, hidden=None):
        keep = np.where(active, n_accept + 1, 0)
        self.advance(mx.array(n_accept.astype(np.int32)), None, mx.array(keep.astype(np.int32)), keep, verify_in, None,
                     exact=True)

    def advance(self, n, nxt, counts, most, verify_in, hidden, following=None, exact=False):
        """The round's commit: each row keeps its counts (the round fed the token before the pending one)."""
        live = np.asarray(most) > 0
        if verify_in.shape[1] == 1:  # no drafts: each live row's pending token joins its backlog
            at = mx.array(np.where(live, self.backlog, -1).astype(np.int32))
            self.extra[0] = mx.where(mx.arange(MAX_BACKLOG)[None] == at[:, None], verify_in[:, 0][:, None].astype(mx.int32),
                                     self.extra[0])
            self.backlog = self.backlog + live
            W = self.cache.batch  # nothing fed, but the engine corrects every advance it queued
            self.cache.rows.advance(mx.zeros(W, mx.int32), np.zeros(W, dtype=np.int64), exact)
            if self.backlog.max() >= MAX_BACKLOG:
                self._state_layers = [c for c in self.cache.leaves if isinstance(c, RowStateCache)]
                self._catch_up(keep=1)
            return
        self.cache.rows.restore(self.start)
        self.cache.rows.advance(counts, most, exact)
        if self._steps is not None:
            self._restore_states(counts)
        last = mx.take_along_axis(verify_in, n.astype(mx.int32)[:, None], axis=1)  # the last accepted token
        self.extra[0] = mx.concatenate([last.astype(mx.int32), mx.zeros((last.shape[0], MAX_BACKLOG - 1), mx.int32)], axis=1)
        self.backlog = np.ones(last.shape[0], dtype=np.int64)


def check_draft_vocab(name, draft_tokenizer, tokenizer) -> None:
    """Refuse a draft model unless each of its tokens has the target's id (a drafted id is verified as is)."""
    mine, theirs = draft_tokenizer.get_vocab(), tokenizer.get_vocab()
    differ = [t for t, i in mine.items() if theirs.get(t) != i]
    if differ:
        raise ValueError(f"draft model {name} has a different tokenizer: {len(differ)} of its {len(mine)} tokens "
                         f"have another id in the target's (e.g. {differ[0]!r})")


def load(spec: SpeculativeConfig, bundle: ModelBundle, counters=None) -> DraftModelDrafter:
    from ..architectures import prepare
    from ..kernels import install
    from ..models.loading import load as load_model
    draft = load_model(spec.draft_model, gguf_mode=bundle.gguf_mode)
    check_draft_vocab(spec.draft_model, draft.tokenizer, bundle.tokenizer)
    prepare(draft.model, draft.model_type, bundle.vocab_size)
    # the target's CUDA decode paths but the layer kernels, which patch the target alone
    install(draft.model, spec.compiled_verify != "off", layers=False)
    return DraftModelDrafter(draft.model, bundle.vocab_size, compiled=spec.compiled_verify != "off", measure=True,
                             counters=counters)
