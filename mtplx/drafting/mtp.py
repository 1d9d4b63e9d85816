"""MTP drafting: the model's multi-token-prediction head drafts from the trunk's hidden state.

`MtpDrafter` keeps the head's cache per row and drafts K tokens a round, recursively (each step
feeds back its own hidden state and draft): among a `DraftVocab`'s tokens where the head has one,
through a `CompiledDraftBank` (both mtp_bank.py: a commit and the next round's proposal are one
program; the eager code here is the reference it must match). With a `LookupFallback` a row
whose context has its suffix earlier drafts that continuation instead, chosen on the device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import small_ops
from ..cache import BatchCache, RowKVCache, capacity_bucket
from ..config import SpeculativeConfig
from ..graphbank import Programs
from ..models.loading import ModelBundle
from ..models.mtp import SIDECAR_META, MTPHead, load_head
from ..prefill import prefill_width
from .base import CachedDrafter
from .mtp_bank import (CompiledDraftBank, at_accepted, commit_inputs, draft_step, history_append, lookup_drafts, pick,
                       project, stack_drafts)
from .mtp_bank import DraftVocab, load_draft_vocab

HEAD_BEHIND = 64  # rounds without drafts the MTP head may fall behind by before it catches up


class MtpDrafter(CachedDrafter):
    """A round without drafts followed by another is not committed: the head falls behind by it
    (`behind`, at most HEAD_BEHIND rounds) and catches up with the next round it commits, or before rows
    move, a call ends or it proposes (`_catch_up`), so a round at depth 0 costs what a plain round does.
    The catch-up runs the commit programs adaptive depth has built (depth + 1 rounds a call), else the
    same ops eagerly: a run that never drafts builds no head program."""

    name = "mtp"
    needs_hidden = True
    device_side = True
    drafts_ahead = True  # advance(following=...) drafts the next round in the commit's program
    programs = 2  # the round's verify, the head's commit with the next round's drafts

    def __init__(self, head: MTPHead, chunk_size: int = 512, vocab: Optional[DraftVocab] = None,
                 compiled: bool = True, lookup: Optional["LookupFallback"] = None, catch_up_len: int = 4,
                 counters=None):
        super().__init__(counters)
        self.head = head
        self.catch_up_len = catch_up_len  # rounds a compiled catch-up commits at once (the engine's depth + 1)
        self.chunk = chunk_size
        self.vocab = vocab
        self.bank = CompiledDraftBank(head, vocab, Programs(self.counters)) if compiled else None
        self.lookup = lookup
        self.extra: List[mx.array] = []  # [first-draft logits [W, S], head hidden [W, D]]
        self.ready: Optional[tuple] = None  # (K, sampler, u, drafts, q, lookup rows): drafted ahead by advance
        self.history: Optional[mx.array] = None  # [W, C] each row's prompt + output (lookup only)
        self.behind: list = []  # rounds not committed yet: (verify_in, hidden, n, nxt, counts, most)

    def fuse_kernels(self, compiled):
        """The head's blocks take the trunk's paths: its few-row float products as vector products and
        its stacked one-row products (its draft steps)."""
        from ..kernels import install_head

        return install_head(self.head, self.vocab, compiled) if isinstance(self.head, nn.Module) else {}

    def reserve(self, entries):
        if self.bank is not None:
            self.bank.reserve = entries

    @property
    def margin(self):  # a commit and the next round's drafts; the lookup history's lead
        return 2 * self.catch_up_len + (self.lookup.lead + 1 if self.lookup is not None else 0)

    def probe(self):
        norm = self.head.norm.weight  # the trunk's hidden states at two positions: its width, its dtype
        return self.prefill_row([0, 0], mx.zeros((1, 2, norm.shape[0]), norm.dtype), 0)

    def slot_bytes(self, reach):  # the lookup history: an int32 column per entry, as long as the head cache
        history = 4 * capacity_bucket(reach + self.margin) if self.lookup is not None else 0
        return super().slot_bytes(reach) + history

    # -- prefill -------------------------------------------------------------------------------------
    def prefill_row(self, tokens, hidden, first_token, prefix=None, edge=0):
        """`hidden` holds the trunk's hidden states for positions start..n-1 of `tokens`."""
        cache = BatchCache(list(self.head.cache_kinds), [0])
        start = 0
        if prefix is not None:
            snap, h_edge = prefix
            cache.write_row(0, snap)
            start = snap[0]
            hidden = mx.concatenate([h_edge, hidden], axis=1)
        nxt = list(tokens[start + 1 :]) + [int(first_token)]
        h_out = None
        for s in range(0, len(nxt), self.chunk):
            toks = mx.array(nxt[s : s + self.chunk], dtype=mx.int32)[None]
            h_out = self.head.hidden(hidden[:, s : s + self.chunk], toks, cache.layers)
            cache.commit([toks.shape[1]])
            if s + self.chunk < len(nxt):  # the last chunk is evaluated with the round the row joins
                cache.eval()
        h_last = h_out[:, -1]
        state = (cache, [project(self.head, self.vocab, h_last), h_last])
        # the row's context: one token longer than its head cache (the head's entry for the last
        # token comes with the next commit)
        return state if self.lookup is None else state + (self.lookup.context(mx.array(list(tokens) + [int(first_token)], dtype=mx.int32)),)

    def prefill_rows(self, prompts: Sequence[Sequence[int]], hiddens: Sequence[mx.array], firsts,
                     prefixes: Optional[Sequence[Optional[tuple]]] = None) -> List[tuple]:
        """`prefill_row` for a group at once, right-padded to the longest: one head forward and one eval
        per chunk. Each row writes at its own offset, so padding never enters its entries. `firsts`:
        ints, or a [B] device array (placed in the grid unread)."""
        B = len(prompts)
        prefixes = list(prefixes) if prefixes is not None else [None] * B
        hiddens = list(hiddens)
        cache = BatchCache(list(self.head.cache_kinds), [0] * B)
        starts = [0] * B
        for b, prefix in enumerate(prefixes):
            if prefix is not None:  # the head's entries of the prefix, and the trunk's h at its last position
                cache.write_row(b, prefix[0])
                starts[b] = prefix[0][0]
                hiddens[b] = mx.concatenate([prefix[1], hiddens[b]], axis=1)
        # the head at position i reads the trunk's h[i] and the token after it (the first token last)
        firsts = firsts.astype(mx.int32) if isinstance(firsts, mx.array) else mx.array(np.asarray(firsts, dtype=np.int32))
        tails = [list(p[s + 1 :]) for p, s in zip(prompts, starts)]
        lengths = np.array([len(t) + 1 for t in tails], dtype=np.int64)
        most = int(max(s + n for s, n in zip(starts, lengths)))  # padded queries stay in the rows' capacity bucket
        L = prefill_width(int(lengths.max()), capacity_bucket(most + 1) - max(starts))
        grid = np.zeros((B, L), dtype=np.int32)
        for b, t in enumerate(tails):
            grid[b, : len(t)] = t
        at_first = mx.arange(L, dtype=mx.int32)[None] == mx.array((lengths - 1).astype(np.int32))[:, None]
        grid = mx.where(at_first, firsts[:, None], mx.array(grid))
        hidden = mx.concatenate([mx.pad(h, [(0, 0), (0, L - h.shape[1]), (0, 0)]) for h in hiddens])
        last = [None] * B
        for s in range(0, L, self.chunk):
            e = min(s + self.chunk, L)
            counts = np.clip(lengths - s, 0, e - s)
            h_out = self.head.hidden(hidden[:, s:e], grid[:, s:e], cache.layers)
            cache.commit(counts)
            if e < L:
                cache.eval()
            for b in np.flatnonzero((lengths > s) & (lengths <= e)):  # rows whose last position is here
                last[b] = h_out[b, counts[b] - 1]
        h_last = mx.stack(last)
        logits = project(self.head, self.vocab, h_last)
        states = []
        for b in range(B):
            row = BatchCache(cache.kinds, [0])
            row.write_row(0, cache.snapshot_row(b))
            state = (row, [logits[b : b + 1], h_last[b : b + 1]])
            if self.lookup is not None:  # the row's context: one token longer than its head cache
                state += (self.lookup.context(mx.concatenate([mx.array(list(prompts[b]), dtype=mx.int32), firsts[b : b + 1]])),)
            states.append(state)
        return states

    def snapshot(self, state, length, hidden_at_edge):
        """A prefix of `length` trunk positions: the head has length-1 entries plus h[length-1]."""
        return state[0].snapshot_row(0, length - 1), hidden_at_edge

    # -- rows in and out -------------------------------------------------------------------------------
    def reset(self):
        super().reset()
        self.ready, self.history, self.behind = None, None, []

    def _history_room(self, need: int):  # at least `need` columns, in capacity buckets (few programs)
        have = self.history.shape[1]
        if need > have:
            self.history = mx.pad(self.history, [(0, 0), (0, capacity_bucket(need) - have)])

    def extend(self, states):
        self._catch_up()
        self.ready = None
        super().extend(states)
        if self.lookup is not None:
            rows = [s[2] for s in states] if self.history is None else [self.history] + [s[2] for s in states]
            cap = capacity_bucket(max(r.shape[1] for r in rows))
            self.history = mx.concatenate([mx.pad(r, [(0, 0), (0, cap - r.shape[1])]) for r in rows])

    def write(self, slot, state):
        self._catch_up()
        self.ready = None
        super().write(slot, state)
        if self.lookup is not None:
            row = state[2]
            self._history_room(row.shape[1])
            self.history[slot : slot + 1] = mx.pad(row, [(0, 0), (0, self.history.shape[1] - row.shape[1])])

    def take(self, keep):
        self._catch_up()
        self.ready = None
        super().take(keep)
        if self.lookup is not None:
            self.history = self.history[mx.array(np.asarray(keep, dtype=np.int32))]

    def settle(self, done=False):
        if done:  # nothing drafts again in this call: what was put off is dropped
            self.behind = []
        self._catch_up()
        super().settle()

    # -- rounds ----------------------------------------------------------------------------------------
    def _lookup_arg(self, extra: int):
        """(lookup, history) with room for `extra` more tokens per row, or None without lookup."""
        if self.lookup is None:
            return None
        # The head cache and the history (one token longer) grow to one capacity together: the head's
        # programs are keyed by both (one crossing a bucket alone would compile a program of its own)
        layers = [c for c in self.cache.leaves if isinstance(c, RowKVCache) and c.keys is not None]
        most = max(self.cache.rows.max, self.bank.reserve if self.bank is not None else 0)  # (the bank grows to its reserve)
        self._history_room(max([self.lookup.lead + most + 1 + extra] + [c.keys.shape[2] for c in layers]))
        for c in layers:
            c.ensure_capacity(self.cache.batch, c.keys, c.values, self.history.shape[1])
        return self.lookup, self.history

    def propose(self, K, pending, sampler, u):
        ready, self.ready = self.ready, None
        if ready is not None and ready[0] == K and ready[1] is sampler and ready[2] is u:
            return ready[3], ready[4]  # drafted with the last commit (advance's `following`)
        self._catch_up()
        first_logits, h = self.extra
        if self.bank is not None:
            out = self.bank.propose(self.cache, first_logits, h, sampler, u, K, self._lookup_arg(K))
            if out is not None:
                return out[0], out[1]
        return self._propose_eager(K, sampler, u)[:2]

    def _propose_eager(self, K, sampler, u):
        first_logits, h = self.extra
        start = self.cache.rows.mark()
        ones = np.ones(self.cache.batch, dtype=np.int64)
        idx, q = pick(first_logits, sampler, u[:, 0])
        idxs, qs = [idx], [q]
        for j in range(1, K):
            h = draft_step(self.head, self.vocab, h, idx, self.cache.layers, j)
            self.cache.commit(ones)
            idx, q = pick(project(self.head, self.vocab, h, j), sampler, u[:, j])
            idxs.append(idx)
            qs.append(q)
        self.cache.rows.restore(start)
        drafts, q = stack_drafts(self.vocab, idxs, qs)
        if self.lookup is None:
            return drafts, q, None
        use, looked = self.lookup.drafts(self._lookup_arg(K)[1], self.cache.rows.device, K, extra=1)
        return self.lookup.mix(use, looked, drafts, q) + (use,)

    def commit(self, n_accept, next_tokens, drafts, active, verify_in=None, hidden=None):
        keep = np.where(active, n_accept + 1, 0)
        self._commit(mx.array(n_accept.astype(np.int32)), mx.array(next_tokens.astype(np.int32)),
                     mx.array(keep.astype(np.int32)), keep, verify_in, hidden, exact=True)

    def advance(self, n, nxt, counts, most, verify_in, hidden, following=None):
        """A round without drafts and nothing drafted after it waits in `behind` (the class docstring)."""
        if following is None and verify_in.shape[1] == 1 and len(self.behind) < HEAD_BEHIND:
            self.ready = None
            self.behind.append((verify_in, hidden, n, nxt, counts, np.asarray(most)))
            self.cache.rows.expect(1)  # its counts are unread until it is read (corrected) and committed
            return
        self._commit(n, nxt, counts, most, verify_in, hidden, following=following)

    @property
    def lag(self):
        return len(self.behind)

    def _catch_up(self):
        """Commit the rounds the head is behind by (`_commit_behind`)."""
        if self.behind:
            behind, self.behind, self.ready = self.behind, [], None
            self._commit_behind(behind)

    def _commit_eager(self, verify_in, n, nxt, hidden, lookup):
        """The commit's (first logits, head hidden[, history]) by eager ops (the reference)."""
        committed = commit_inputs(verify_in, n, nxt)
        h_at = at_accepted(self.head.hidden(hidden, committed, self.cache.layers), n)
        out = (project(self.head, self.vocab, h_at), h_at)
        if lookup is not None:
            out += (self.lookup.append(self.history, self.cache.rows.device, committed, extra=1),)
        return out

    def _commit_through(self, verify_in, n, nxt, hidden, counts, most, plan, lookup, exact=False, built_only=False):
        """Commit by its program where one serves (`built_only`: one built already), else by the eager
        ops, and advance the head's cache by `counts`; returns the commit's outputs."""
        out = None if self.bank is None else self.bank.commit(self.cache, hidden, verify_in, n, nxt, plan, lookup,
                                                              built_only)
        out = out if out is not None else self._commit_eager(verify_in, n, nxt, hidden, lookup)
        self.cache.advance(counts, most, exact)
        self.extra = list(out[:2])
        if lookup is not None:
            self.history = out[2]
        return out

    def _commit_behind(self, behind) -> None:
        """Commit the rounds left behind (each one verified token, all kept), `catch_up_len` rounds a
        call: the verified lengths adaptive depth builds anyway, so a catch-up meets no new shape."""
        for at in range(0, len(behind), self.catch_up_len):
            part = behind[at : at + self.catch_up_len]
            verify_in, hidden = self._padded(mx.concatenate([b[0] for b in part], axis=1),
                                             mx.concatenate([b[1] for b in part], axis=1))
            n, nxt = part[-1][2] + (len(part) - 1), part[-1][3]
            counts = sum((b[4] for b in part[1:]), part[0][4])
            most = sum((b[5] for b in part[1:]), part[0][5])
            self.cache.rows.expect(-1)  # (one of its rounds is counted again by the advance below)
            self._commit_through(verify_in, n, nxt, hidden, counts, most, None, self._lookup_arg(len(part)),
                                 built_only=True)

    def _padded(self, verify_in, hidden):
        """A commit's verified tokens and hidden states padded to `catch_up_len`, so it runs in the deepest
        round's program (the padding sits past each row's kept tokens, like a rejected draft's)."""
        pad = self.catch_up_len - verify_in.shape[1]
        if pad <= 0 or self.bank is None:
            return verify_in, hidden
        return mx.pad(verify_in, [(0, 0), (0, pad)]), mx.pad(hidden, [(0, 0), (0, pad), (0, 0)])

    def _commit(self, n, nxt, counts, most, verify_in, hidden, exact=False, following=None):
        self.ready = None
        behind, self.behind = self.behind, []
        if behind:  # the rounds before this one first, all their tokens kept
            self._commit_behind(behind)
        plan = None if following is None else (counts,) + tuple(following)
        if verify_in.shape[1] == 1:  # a round that drafted nothing
            verify_in, hidden = self._padded(verify_in, hidden)
        lookup = self._lookup_arg(verify_in.shape[1] + (following[0] if following else 0))
        out = self._commit_through(verify_in, n, nxt, hidden, counts, most, plan, lookup, exact)
        if plan is not None:
            K, sampler, u = following
            drafted = out[2 + (lookup is not None):] or self._propose_eager(K, sampler, u)
            self.ready = (K, sampler, u) + tuple(drafted)
            if self.lookup is not None:
                self.lookup.record(drafted[2], counts)


class LookupFallback:
    """Prompt lookup inside MTP drafting (`speculative.mtp_lookup`), on the device: a row whose context
    (`MtpDrafter.history`) has a suffix of at least `min_match` tokens seen before, followed there by the
    round's depth of tokens, drafts that continuation (mtp_bank.lookup_drafts); the others draft with
    the head. A lookup draft's q is the point mass on it, so the output stays exact; nothing is read.
    A row's history is its context after `lead` columns of -1 (`context`)."""

    FOLD_EVERY = 256  # rounds whose choices wait before they are added up (`record`)

    def __init__(self, ngram_size: int, min_match: int):
        self.n = max(ngram_size, min_match)
        self.min_match = min_match
        self.lead = self.n
        self._tally = mx.zeros((2,), mx.int32)  # row-rounds drafted (by lookup, in all), on the device
        self._rounds: List[tuple] = []  # (rows that looked up, counts) of rounds not added up yet

    def context(self, tokens: mx.array) -> mx.array:
        """A row's history [1, lead + L] from its context `tokens` [L] (or [1, L])."""
        return mx.pad(tokens.reshape(1, -1).astype(mx.int32), [(0, 0), (self.lead, 0)], constant_values=-1)

    def append(self, history: mx.array, lengths: mx.array, committed: mx.array, extra: int = 0) -> mx.array:
        """`history` with each row's committed tokens written after its `lengths + extra` tokens."""
        return history_append(history, lengths, committed, self.lead + extra)

    def drafts(self, history: mx.array, lengths: mx.array, K: int, extra: int = 0):
        """(rows that draft from their context [W], nonzero where so, those drafts [W, K]) of contexts
        `lengths + extra` tokens long."""
        return lookup_drafts(history, lengths, K, self.n, self.min_match, self.lead, extra)

    @staticmethod
    def mix(use: mx.array, looked: mx.array, drafts: mx.array, q: Optional[mx.array]):
        """The head's drafts and q, with the lookup rows' drafts and point masses in their place."""
        drafts = mx.where(use[:, None], looked, drafts.astype(mx.int32))  # (an int `use`: cast inside the select)
        if q is not None:
            point = (small_ops.arange(q.shape[-1])[None, None] == looked[..., None]).astype(q.dtype)
            q = mx.where(use[:, None, None], point, q)
        return drafts, q

    def record(self, use: mx.array, counts: mx.array):
        """Count a round's choices among its live rows: kept as they are and added up in a few ops
        every FOLD_EVERY rounds and when `counts` is read, no op of a round's or a call's own."""
        self._rounds.append((use, counts))
        if len(self._rounds) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self):  # a few ops for each run of rounds of one width
        rounds, self._rounds = self._rounds, []
        while rounds:
            W = rounds[0][0].shape[0]
            same = next((i for i, r in enumerate(rounds) if r[0].shape[0] != W), len(rounds))
            use, live = mx.stack([r[0] for r in rounds[:same]]) != 0, mx.stack([r[1] for r in rounds[:same]]) > 0
            self._tally = self._tally + mx.stack([(use & live).sum(), live.sum()]).astype(mx.int32)
            rounds = rounds[same:]
        mx.async_eval(self._tally)  # (so the rounds' arrays are let go)

    @property
    def counts(self) -> Dict[str, int]:
        """Row-rounds drafted each way (one read)."""
        self._fold()
        used, rows = np.array(self._tally).tolist()
        return {"lookup": used, "head": rows - used}


def head_acceptance(sidecar: Optional[str]) -> Optional[List[float]]:
    """The head's held-out acceptance per draft position (its training run's mtp_head.json), or None."""
    try:
        got = json.loads((Path(sidecar) / SIDECAR_META).read_text()).get("heldout_acceptance_by_depth")
    except (TypeError, OSError, ValueError):
        return None
    ok = isinstance(got, list) and got and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in got)
    return [float(a) for a in got] if ok else None


def load(spec: SpeculativeConfig, bundle: ModelBundle, counters=None) -> MtpDrafter:
    """The drafter for the model's MTP head (or `speculative.mtp_head`'s sidecar)."""
    head = load_head(bundle, spec.mtp_head)
    lookup = LookupFallback(spec.ngram_size, spec.mtp_lookup) if spec.mtp_lookup else None
    drafter = MtpDrafter(head, vocab=load_draft_vocab(head, spec.mtp_head, bundle.vocab_size),
                         compiled=spec.compiled_verify != "off", lookup=lookup, catch_up_len=spec.depth + 1,
                         counters=counters)
    drafter.acceptance_prior = head_acceptance(spec.mtp_head)
    return drafter
