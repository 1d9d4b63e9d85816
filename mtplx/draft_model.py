"""The draft-model method: a smaller model with the target's tokenizer drafts K tokens a round.

Its proposal runs through draft_chain.py (K draft steps as one compiled program, or eager steps where
those measure faster on this machine); rows with nothing to draft keep the draft's cache in step
through a Backlog. `load_drafter` builds it for a job's `speculative` settings (drafters.DRAFTERS).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from .cache import BatchCache, RowStateCache
from .config import SpeculativeConfig
from .draft_chain import MAX_BACKLOG, Backlog, DraftChainBank, chain_seconds, draft_chain
from .drafters import _CachedDrafter
from .gdn import install_capture
from .models.loading import ModelBundle
from .recurrent import install_stepping


class DraftModelDrafter(_CachedDrafter):
    """A smaller model with the same tokenizer drafts K tokens autoregressively, K draft steps a
    round (draft_chain.py: its cache one token behind the target's, a backlog while rounds do
    not draft, the steps one compiled call when its cache is attention only).

    `measure`: each (width, depth, sampler kind) drafts through whichever of the compiled chain and
    the eager steps its first proposal timed faster here (`_compiled_pays`); the two give the same
    drafts, and which is faster depends on the device and the draft model (the H200 with a
    0.5B draft: eager 12.5 ms a depth-2 round, compiled 16.8; equal at depth 4)."""

    name = "draft"
    needs_hidden = False
    device_side = True
    clock = staticmethod(time.perf_counter)  # what the two chains are timed with (tests inject one)

    def __init__(self, draft_model, vocab_size: int, chunk_size: int = 512, compiled: bool = True,
                 measure: bool = False):
        install_capture(draft_model)  # a recurrent draft's states after every token fed (the rollback)
        install_stepping(draft_model)
        self.model = draft_model
        self.vocab = vocab_size
        self.chunk = chunk_size
        self.bank = DraftChainBank(draft_model, vocab_size) if compiled else None
        self.measure = measure
        self.compiled_pays: Dict[tuple, bool] = {}  # (width, K, sampler flags) -> the compiled chain was faster
        self.cache: Optional[BatchCache] = None
        self.extra: List[mx.array] = []  # [backlog tokens [W, MAX_BACKLOG]]
        self.backlog = Backlog()
        self._state_layers: List[RowStateCache] = []
        self._steps: Optional[list] = None  # per token fed this round: each recurrent layer's state

    def prefill_row(self, tokens, hidden, first_token, prefix=None, edge=0):
        """(cache of all prompt tokens but the last, [its backlog: the last], snapshot at `edge` or
        None). The prefill splits at the edge; a hybrid draft's recurrent state is copied there (it
        cannot be cut back to the edge afterwards)."""
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
            if e < end:  # the last part is evaluated with the round the row joins (no sync of its own)
                cache.eval()
            if cut and e == edge and any(isinstance(c, RowStateCache) for c in cache.layers):
                at_edge = cache.snapshot_row(0)
        return cache, [Backlog.row(tokens[-1])], at_edge

    def snapshot(self, state, length, hidden_at_edge=None):
        at_edge = state[2]
        if at_edge is not None and at_edge[0] == length:
            return at_edge
        return state[0].snapshot_row(0, length)

    def reset(self):
        super().reset()
        self.backlog = Backlog()

    # the backlog tokens are the row state `extra` the shared slot bookkeeping moves
    def extend(self, states):
        self.extra[:1] = [self.backlog.tokens] if self.extra else []
        super().extend(states)
        self.backlog.tokens = self.extra[0]
        self.backlog.size = np.concatenate([self.backlog.size, np.ones(len(states), dtype=np.int64)])

    def write(self, slot, state):
        self.extra[0] = self.backlog.tokens
        super().write(slot, state)
        self.backlog.tokens = self.extra[0]
        self.backlog.size[slot] = 1

    def take(self, keep):
        self.extra[0] = self.backlog.tokens
        super().take(keep)
        self.backlog.tokens = self.extra[0]
        self.backlog.size = self.backlog.size[np.asarray(keep, dtype=np.int64)]

    # -- feeding the draft model eagerly (the reference, and recurrent drafts) ------------------
    def _feed(self, tokens: mx.array, counts: np.ndarray):
        """The draft model over tokens [W, L]; each row keeps counts[i] of them. Recurrent layers
        capture their state after every position: kept in `_steps` while a round drafts."""
        self.cache.set_capturing(True)
        logits = self.model(tokens, cache=self.cache.layers)
        self.cache.set_capturing(False)
        if self._state_layers and self._steps is not None:
            for t in range(tokens.shape[1]):
                self._steps.append([[None if s is None else s[:, t] for s in c._steps] for c in self._state_layers])
        self.cache.advance(mx.array(counts.astype(np.int32)), counts, exact=True)
        return logits

    def _catch_up(self, keep: int):
        """Feed each row's backlog but its last `keep` tokens, in one forward."""
        m = np.maximum(self.backlog.size - keep, 0)
        if not m.any():
            return
        L = 1 << (int(m.max()) - 1).bit_length()  # few shapes
        self._steps = None
        self._feed(self.backlog.tokens[:, :L], m)
        self.backlog.drop(m)

    def _restore_states(self, counts: mx.array):
        """Each recurrent layer's state after each row's counts[i] tokens of the round."""
        for li, layer in enumerate(self._state_layers):
            for i in range(len(layer.cache)):
                steps = [s[li][i] for s in self._steps]
                if any(x is None for x in steps):
                    continue
                stacked = mx.stack(steps, axis=1)  # [W, fed + 1, ...]
                idx = counts.reshape((-1,) + (1,) * (stacked.ndim - 1))
                layer.cache[i] = mx.take_along_axis(stacked, idx, axis=1).squeeze(1)
        self._steps = None

    def propose(self, K, pending, sampler, u):
        self._state_layers = [c for c in self.cache.leaves if isinstance(c, RowStateCache)]
        self._steps = None
        self._catch_up(keep=1)
        feed = mx.concatenate([self.backlog.tokens[:, :1], pending[:, None].astype(mx.int32)], axis=1)
        self.start = self.cache.rows.mark()
        out = self.bank.propose(self.cache, feed, sampler, u, K) if self._compiled_pays(K, feed, sampler, u) else None
        return out if out is not None else self._eager_chain(K, feed, sampler, u)

    def _eager_chain(self, K, feed, sampler, u):
        # Recurrent (Gated DeltaNet) layers of a hybrid draft cannot rewind by length: keep their
        # state after every token of this round, and pick each row's at commit.
        self._steps = [[list(c.cache) for c in self._state_layers]] if self._state_layers else None
        W = self.cache.batch
        step = lambda tokens, j: self._feed(tokens, np.full(W, tokens.shape[1], dtype=np.int64))
        return draft_chain(step, feed, sampler, u, K, self.vocab)

    def _compiled_pays(self, K, feed, sampler, u) -> bool:
        """Whether this round drafts through the compiled chain: with `measure`, what the first
        proposal of its shape timed (`_seconds`: the same chain both ways, a few times each),
        else wherever there is a bank (it falls back to eager steps itself where it cannot compile)."""
        if self.bank is None:
            return False
        if not self.measure or self._state_layers:  # a recurrent draft drafts eagerly anyway
            return True
        key = (self.cache.batch, K, sampler.all_greedy, sampler.any_top_k, sampler.any_top_p)
        if key not in self.compiled_pays:
            compiled = self._seconds(K, feed, sampler, u, True)
            if compiled is None:  # not over this cache (an empty one): the bank drafts eagerly itself, for now
                return True
            eager = self._seconds(K, feed, sampler, u, False)
            self.compiled_pays[key] = compiled <= eager
            self.bank.stats["measured_ms"][f"width {key[0]} depth {K}"] = (round(1e3 * compiled, 3), round(1e3 * eager, 3))
        if not self.compiled_pays[key]:
            self.bank._eager("the eager steps measured faster at this width and depth")
        return self.compiled_pays[key]

    def _seconds(self, K, feed, sampler, u, compiled: bool) -> Optional[float]:
        """Seconds this round's chain takes here, compiled or eager (draft_chain.chain_seconds); the
        cache lengths are put back after each: what a chain wrote past them is never read."""
        def chain():
            out = self.bank.propose(self.cache, feed, sampler, u, K) if compiled else self._eager_chain(K, feed, sampler, u)
            self.cache.rows.restore(self.start)
            return None if out is None else out[0]  # None: the bank cannot compile this cache

        return chain_seconds(chain, self.clock)

    def commit(self, n_accept, next_tokens, drafts, active, verify_in=None, hidden=None):
        keep = np.where(active, n_accept + 1, 0)
        self.advance(mx.array(n_accept.astype(np.int32)), None, mx.array(keep.astype(np.int32)), keep,
                     verify_in, hidden, exact=True)

    def advance(self, n, nxt, counts, most, verify_in=None, hidden=None, exact=False):
        """The round's commit: the draft cache keeps each row's counts (the pending token and its
        accepted drafts, less the last of them, plus the token before: the round fed both)."""
        live = np.asarray(most) > 0
        if verify_in.shape[1] == 1:  # a round without drafts: the pending token joins the backlog
            self.backlog.append(verify_in[:, 0], live)
            W = self.cache.batch  # (nothing fed, but the engine corrects every advance it queued)
            self.cache.rows.advance(mx.zeros(W, mx.int32), np.zeros(W, dtype=np.int64), exact)
            if self.backlog.size.max() >= MAX_BACKLOG:
                self._state_layers = [c for c in self.cache.leaves if isinstance(c, RowStateCache)]
                self._catch_up(keep=1)
            return
        self.cache.rows.restore(self.start)
        self.cache.rows.advance(counts, most, exact)
        if self._steps is not None:
            self._restore_states(counts)
        n = mx.maximum(counts - 1, 0) if n is None else n
        last = mx.take_along_axis(verify_in, n.astype(mx.int32)[:, None], axis=1)[:, 0]
        self.backlog.after_round(last)


def check_draft_vocab(name, draft_tokenizer, draft_config: dict, tokenizer, config: dict) -> None:
    """Refuse a draft model whose tokenizer is not the target's; needs only the tokenizers and
    configs, so a job can be refused before any weights load."""
    if draft_tokenizer.vocab_size != tokenizer.vocab_size and abs(
        draft_config.get("vocab_size", 0) - config.get("vocab_size", 0)
    ) > 1024:
        raise ValueError(
            f"draft model {name} has a different tokenizer "
            f"(vocab {draft_config.get('vocab_size')} vs {config.get('vocab_size')})"
        )


def load_drafter(spec: SpeculativeConfig, bundle: ModelBundle) -> DraftModelDrafter:
    from .models.loading import load

    draft = load(spec.draft_model, gguf_mode=bundle.gguf_mode)
    check_draft_vocab(spec.draft_model, draft.tokenizer, draft.config, bundle.tokenizer, bundle.config)
    from .architectures import prepare

    prepare(draft.model, draft.model_type, bundle.vocab_size)  # batching adapters; refuses what it cannot batch
    from .fusion import decode_paths

    decode_paths(draft.model, spec.compiled_verify != "off")  # the target's CUDA decode paths (off CUDA: none)
    return DraftModelDrafter(draft.model, bundle.vocab_size, compiled=spec.compiled_verify != "off", measure=True)
