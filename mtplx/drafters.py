"""Draft sources behind one small interface (`Drafter`): prompt lookup, a draft model, MTP heads.

A drafter keeps per-slot state that mirrors the engine's batch slots:
- `prefill_row(tokens, hidden, first_token, prefix, edge)` builds one row's state after its prompt
  (`prefix`: a snapshot to start from; `edge`: the stable-prefix edge, where `snapshot` may be asked
  for the state: a drafter with recurrent state keeps a copy there, it cannot be cut back later);
- `snapshot(state, length, hidden_at_edge)` the state of the first `length` prompt tokens, kept
  with the target's snapshot for rows that share the prefix;
- `reset()`, `extend(states)` / `write(slot, state)` / `take(keep)` move rows in and out of the batch;
- `propose(K, pending, sampler, u)` returns drafts [W, K] and their proposal distribution q
  ([W, K, V], or None when drafts are deterministic, i.e. a point mass);
- `commit(...)` tells it how many drafts each row kept and the token that followed (host arrays).
`needs_hidden`: the drafter reads the trunk's hidden states (`hidden` above; the engine computes
them only then). `device_side`: the drafter also has `advance(n, nxt, counts, most, verify_in,
hidden)`, `commit` with device arrays it never reads (`counts`: each row's committed tokens,
`most`: a host upper bound of them), so the engine can queue the next round before it reads
this one (spec_rounds.py); its cache lengths on the host are then upper bounds until the engine
corrects them (`cache.rows`, cache.py RowLengths). The ngram method drafts on the host: not device-side
(MTP's prompt-lookup fallback matches on the device: LookupFallback).
`drafts_ahead`: `advance(..., following=(K, sampler, u))` also drafts the next round (MTP: in the
commit's compiled program), and `propose` with that K, sampler and u returns those drafts.
Optional `warm(depths)`: build the compiled programs of every one of these depths when a batch
shape is first met (adaptive depth tries them all; a program built inside a timed round is a
compile, not what the depth costs).

A new draft method is one class with this interface and one line in `DRAFTERS` (the draft-model
method lives in draft_model.py).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .cache import BatchCache, capacity_bucket
from .config import SPEC_METHODS, SpeculativeConfig
from .models.loading import ModelBundle
from .models.mtp import MTPHead
from .head_prefill import head_prefill_rows
from . import mtp_draft, small_ops
from .mtp_draft import (CompiledDraftBank, DraftVocab, at_accepted, commit_inputs, draft_step, history_append,
                        lookup_drafts, pick, project, stack_drafts)
from .sampling import SamplerBatch


class Drafter(Protocol):
    name: str
    needs_hidden: bool
    device_side: bool

    def prefill_row(self, tokens: Sequence[int], hidden: Optional[mx.array], first_token: int,
                    prefix: Optional[object] = None, edge: int = 0) -> object: ...
    # optional: prefill_rows(prompts, hiddens, firsts, prefixes) -> states, several rows at once (prefixes[b]:
    # prefill_row's `prefix`, or None)


    def snapshot(self, state: object, length: int, hidden_at_edge: Optional[mx.array]) -> object: ...

    def reset(self) -> None: ...

    def extend(self, states: Sequence[object]) -> None: ...

    def write(self, slot: int, state: object) -> None: ...

    def take(self, keep: Sequence[int]) -> None: ...

    def propose(self, K: int, pending: mx.array, sampler: SamplerBatch,
                u: mx.array) -> Tuple[mx.array, Optional[mx.array]]: ...

    def commit(self, n_accept: np.ndarray, next_tokens: np.ndarray, drafts: np.ndarray, active: np.ndarray,
               verify_in: Optional[mx.array] = None, hidden: Optional[mx.array] = None) -> None: ...


class NgramDrafter:
    """Prompt lookup: match the last n tokens earlier in prompt + output, propose what followed."""

    name = "ngram"
    needs_hidden = False
    device_side = False

    def __init__(self, ngram_size: int = 3):
        self.n = ngram_size
        self.rows: List[Optional[Tuple[list, Dict[tuple, int]]]] = []

    def _index(self, tokens: list) -> Dict[tuple, int]:
        index: Dict[tuple, int] = {}
        for size in range(1, self.n + 1):
            for end in range(size, len(tokens)):
                index[(size,) + tuple(tokens[end - size : end])] = end
        return index

    def prefill_row(self, tokens, hidden, first_token, prefix=None, edge=0):
        history = list(tokens) + [int(first_token)]
        return history, self._index(history)

    def snapshot(self, state, length, hidden_at_edge=None):
        return None

    def reset(self):
        self.rows = []

    def extend(self, states):
        self.rows += list(states)

    def write(self, slot, state):
        self.rows[slot] = state

    def take(self, keep):
        self.rows = [self.rows[i] for i in keep]

    def match(self, history: list, index: Dict[tuple, int], K: int) -> Tuple[int, list]:
        """(length of the longest suffix of `history` seen before, up to K tokens that followed it);
        (0, []) when no suffix was."""
        for size in range(min(self.n, len(history)), 0, -1):
            start = index.get((size,) + tuple(history[-size:]))
            if start is not None:
                cont = history[start : start + K]
                if cont:
                    return size, cont
        return 0, []

    def _lookup(self, history: list, index: Dict[tuple, int], K: int) -> list:
        _, cont = self.match(history, index, K)
        if cont:
            return cont + [cont[-1]] * (K - len(cont))
        return [history[-1]] * K

    def propose(self, K, pending, sampler, u):
        drafts = np.zeros((len(self.rows), K), dtype=np.int32)
        for i, row in enumerate(self.rows):
            if row is not None:
                drafts[i] = self._lookup(row[0], row[1], K)
        return mx.array(drafts), None

    def commit(self, n_accept, next_tokens, drafts, active, verify_in=None, hidden=None):
        for i, row in enumerate(self.rows):
            if row is None or not active[i]:
                continue
            history, index = row
            new = list(drafts[i, : n_accept[i]]) + [int(next_tokens[i])]
            for tok in new:
                # index every n-gram that now ends just before the newest token
                for size in range(1, self.n + 1):
                    end = len(history)
                    if end - size >= 0:
                        index[(size,) + tuple(history[end - size : end])] = end
                history.append(int(tok))


class _CachedDrafter:
    """Shared slot bookkeeping for drafters that keep a BatchCache plus per-row arrays."""

    def reset(self):
        self.cache, self.extra = None, []

    def extend(self, states):
        """Append rows (copies the batch: only while a batch grows to its width)."""
        new = BatchCache.stack([s[0] for s in states])
        extra = [mx.concatenate([s[1][j] for s in states]) for j in range(len(states[0][1]))]
        if self.cache is None:
            self.cache, self.extra = new, extra
        else:
            self.cache.extend(new)
            self.extra = [mx.concatenate([a, b]) for a, b in zip(self.extra, extra)]

    def write(self, slot, state):
        cache, extra = state[0], state[1]
        self.cache.write_row(slot, cache.snapshot_row(0))
        for j, a in enumerate(extra):
            self.extra[j][slot : slot + 1] = a

    def take(self, keep):
        self.cache.take_rows(keep)
        idx = mx.array(np.asarray(keep, dtype=np.int32))
        self.extra = [a[idx] for a in self.extra]

    def correct(self, excess):
        """A round's counts were read: the host lengths were `excess` too long (RowLengths)."""
        self.cache.rows.correct(excess)

    def settle(self):
        self.cache.rows.settle()


HEAD_BEHIND = 64  # rounds without drafts the MTP head may fall behind by before it catches up


class MtpDrafter(_CachedDrafter):
    """The model's multi-token-prediction head drafts from the trunk's hidden state, recursively.

    With a `DraftVocab` it drafts only among those tokens (q is zero elsewhere: verification is
    unchanged); with a `CompiledDraftBank` a commit and the next round's proposal are one
    compiled call (mtp_draft.py), and the eager code below is the reference it must match. With a
    `LookupFallback` each row's context lives on the device too (`history`), so rounds still run
    one ahead.

    A round without drafts followed by another (adaptive depth at 0) is not committed: the head
    falls behind by it (`behind`, at most HEAD_BEHIND rounds) and catches up with the next round it
    commits, or before rows move, a call ends or it proposes (`_catch_up`), so a round at depth 0
    costs what a plain decoding round does. The catch-up runs the compiled commit programs over
    depth + 1 rounds a call (`_commit_behind`): shapes adaptive depth has built, whatever its length.
    """

    name = "mtp"
    needs_hidden = True
    device_side = True
    drafts_ahead = True  # advance(following=...) drafts the next round in the commit's program

    def __init__(self, head: MTPHead, chunk_size: int = 512, vocab: Optional[DraftVocab] = None,
                 compiled: bool = True, lookup: Optional["LookupFallback"] = None, catch_up_len: int = 4):
        self.head = head
        self.catch_up_len = catch_up_len  # rounds a compiled catch-up commits at once (the engine's depth + 1)
        self.chunk = chunk_size
        self.vocab = vocab
        self.bank = CompiledDraftBank(head, vocab) if compiled else None
        self.lookup = lookup
        self.cache: Optional[BatchCache] = None
        self.extra: List[mx.array] = []  # [first-draft logits [W, S], head hidden [W, D]]
        self.ready: Optional[tuple] = None  # (K, sampler, u, drafts, q, lookup rows): drafted ahead by advance
        self.history: Optional[mx.array] = None  # [W, C] each row's prompt + output (lookup only)
        self.behind: list = []  # rounds not committed yet: (verify_in, hidden, n, nxt, counts, most)
        self.acceptance_prior: Optional[List[float]] = None  # recorded a_j (depth.DepthController's start)

    def _new_cache(self):
        return BatchCache(list(self.head.cache_kinds), [0])

    def prefill_rows(self, prompts, hiddens, firsts, prefixes=None):
        """`prefill_row` for several rows (with or without a restored prefix) at once: one head
        forward and one eval per chunk for the group (head_prefill.py)."""
        return head_prefill_rows(self, prompts, hiddens, firsts, prefixes)

    def prefill_row(self, tokens, hidden, first_token, prefix=None, edge=0):
        """`hidden` holds the trunk's hidden states for positions start..n-1 of `tokens`."""
        cache = self._new_cache()
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

    def reset(self):
        super().reset()
        self.ready, self.history, self.behind = None, None, []

    def _history_room(self, need: int):
        """At least `need` history columns, in capacity buckets (few compiled programs)."""
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

    def snapshot(self, state, length, hidden_at_edge):
        """A prefix of `length` trunk positions: the head has length-1 entries plus h[length-1]."""
        return state[0].snapshot_row(0, length - 1), hidden_at_edge

    def settle(self):
        self._catch_up()
        super().settle()

    def _lookup_arg(self, extra: int):
        """(lookup, history) with room for `extra` more tokens per row, or None without lookup."""
        if self.lookup is None:
            return None
        # The head cache and the history (one token longer) grow to one capacity together: the
        # head's programs are keyed by both, and a round where only one had crossed a bucket
        # would compile a program of its own.
        layers = [c for c in self.cache.layers if c.keys is not None]
        most = max(self.cache.rows.max, self.bank.reserve if self.bank is not None else 0)  # (the bank grows to its reserve)
        self._history_room(max([self.lookup.lead + most + 1 + extra] + [c.keys.shape[2] for c in layers]))
        for c in layers:
            c._ensure_capacity(self.cache.batch, c.keys, c.values, self.history.shape[1])
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
        self.advance(mx.array(n_accept.astype(np.int32)), mx.array(next_tokens.astype(np.int32)),
                     mx.array(keep.astype(np.int32)), keep, verify_in, hidden, exact=True)

    def advance(self, n, nxt, counts, most, verify_in=None, hidden=None, exact=False, following=None):
        """Commit a verified round; with `following` = (K, sampler, u), also draft the next round
        from the state after it, in the same compiled program where one serves (`propose` with
        that K, sampler and u then returns those drafts). A round without drafts and nothing
        drafted after it waits in `behind` (the class docstring)."""
        if following is None and not exact and verify_in.shape[1] == 1 and len(self.behind) < HEAD_BEHIND:
            self.ready = None
            self.behind.append((verify_in, hidden, n, nxt, counts, np.asarray(most)))
            self.cache.rows.expect(1)  # its counts are unread until it is read (corrected) and committed
            return
        self._commit(n, nxt, counts, most, verify_in, hidden, exact, following)

    def _catch_up(self):
        """Commit the rounds the head is behind by (`_commit_behind`)."""
        if self.behind:
            verify_in, hidden, n, nxt, counts, most = self.behind.pop()
            self.cache.rows.expect(-1)  # (the commit's advance counts it again)
            self._commit(n, nxt, counts, most, verify_in, hidden)

    def _commit_eager(self, verify_in, n, nxt, hidden, lookup):
        """The commit's (first logits, head hidden[, history]) by eager ops (the reference)."""
        committed = commit_inputs(verify_in, n, nxt)
        h_at = at_accepted(self.head.hidden(hidden, committed, self.cache.layers), n)
        out = (project(self.head, self.vocab, h_at), h_at)
        if lookup is not None:
            out += (self.lookup.append(self.history, self.cache.rows.device, committed, extra=1),)
        return out

    def _commit_behind(self, behind) -> None:
        """Commit the rounds left behind (each one verified token, all kept) through the compiled
        commit program, `catch_up_len` rounds a call: the verified lengths adaptive depth builds
        anyway, so a catch-up meets no new shape, whatever its length."""
        for at in range(0, len(behind), self.catch_up_len):
            part = behind[at : at + self.catch_up_len]
            verify_in, hidden = self._padded(mx.concatenate([b[0] for b in part], axis=1),
                                             mx.concatenate([b[1] for b in part], axis=1))
            n, nxt = part[-1][2] + (len(part) - 1), part[-1][3]
            counts = sum((b[4] for b in part[1:]), part[0][4])
            most = sum((b[5] for b in part[1:]), part[0][5])
            self.cache.rows.expect(-1)  # (one of its rounds is counted again by the advance below)
            lookup = self._lookup_arg(len(part))
            out = self.bank.commit(self.cache, hidden, verify_in, n, nxt, None, lookup)
            if out is None:  # this shape runs eagerly
                out = self._commit_eager(verify_in, n, nxt, hidden, lookup)
            self.cache.advance(counts, most)
            self.extra = list(out[:2])
            if self.lookup is not None:
                self.history = out[2]

    def _padded(self, verify_in, hidden):
        """A commit's verified tokens and hidden states padded to `catch_up_len`: a commit of rounds that
        drafted nothing runs in the deepest round's program (the padding sits past each row's kept
        tokens, where a rejected draft's entries sit: written, never attended, overwritten later)."""
        pad = self.catch_up_len - verify_in.shape[1]
        if pad <= 0 or self.bank is None:
            return verify_in, hidden
        return mx.pad(verify_in, [(0, 0), (0, pad)]), mx.pad(hidden, [(0, 0), (0, pad), (0, 0)])

    def _commit(self, n, nxt, counts, most, verify_in, hidden, exact=False, following=None):
        out, self.ready = None, None
        behind, self.behind = self.behind, []
        if behind and self.bank is not None:
            self._commit_behind(behind)
            behind = []
        if behind:  # the rounds before this one, all their tokens kept: one commit of them all (each
            # counted unread when it was put off, `expect`, and corrected when the engine reads it)
            verify_in = mx.concatenate([b[0] for b in behind] + [verify_in], axis=1)
            hidden = mx.concatenate([b[1] for b in behind] + [hidden], axis=1)
            n = n + len(behind)
            counts = sum((b[4] for b in behind), counts)
            most = sum((b[5] for b in behind), np.asarray(most))
        plan = None if following is None else (counts,) + tuple(following)
        if verify_in.shape[1] == 1 and not behind:  # a round that drafted nothing (its catch-up is committed)
            verify_in, hidden = self._padded(verify_in, hidden)
        K1 = verify_in.shape[1]
        lookup = self._lookup_arg(K1 + (following[0] if following else 0))
        if self.bank is not None and not behind:  # (a catch-up's length varies: eager, not a program per length)
            out = self.bank.commit(self.cache, hidden, verify_in, n, nxt, plan, lookup)
        if out is None:
            out = self._commit_eager(verify_in, n, nxt, hidden, lookup)
        self.cache.advance(counts, most, exact)
        self.extra = list(out[:2])
        if lookup is not None:
            self.history = out[2]
        if plan is not None:
            K, sampler, u = following
            drafted = out[2 + (lookup is not None):] or self._propose_eager(K, sampler, u)
            self.ready = (K, sampler, u) + tuple(drafted)
            if self.lookup is not None:
                self.lookup.record(drafted[2], counts)


class LookupFallback:
    """Prompt lookup inside MTP drafting (`speculative.mtp_lookup`), on the device: each round, a
    row whose own context (prompt + output, `MtpDrafter.history`) has a suffix of at least
    `min_match` tokens seen before, followed there by at least the round's depth of tokens,
    drafts that continuation (mtp_draft.lookup_drafts: what NgramDrafter.match finds on the
    host); the others draft with the head. The choice is made from the context before the round,
    and a lookup draft's proposal distribution is the point mass on it, so acceptance (and the
    output) stays exact. Nothing is read for it: rounds stay one ahead.

    A row's history is its context after `lead` columns of -1 (`context`), so the match pads
    nothing per round."""

    FOLD_EVERY = 256  # rounds whose choices wait before they are added up (`record`)

    def __init__(self, ngram_size: int, min_match: int):
        self.n = max(ngram_size, min_match)
        self.min_match = min_match
        self.lead = self.n
        self._tally = mx.zeros((2,), mx.int32)  # row-rounds drafted (by lookup, in all), on the device
        self._rounds: List[tuple] = []  # (rows that looked up, counts) of rounds not added up yet

    def context(self, tokens: mx.array) -> mx.array:
        """A row's history [1, lead + L] from its context `tokens` [L] (or [1, L])."""
        row = tokens.reshape(1, -1).astype(mx.int32)
        return mx.pad(row, [(0, 0), (self.lead, 0)], constant_values=-1) if self.lead else row

    def append(self, history: mx.array, lengths: mx.array, committed: mx.array, extra: int = 0) -> mx.array:
        """`history` with each row's committed tokens written after its `lengths + extra` tokens (history_append)."""
        return history_append(history, lengths, committed, self.lead + extra)

    def drafts(self, history: mx.array, lengths: mx.array, K: int, extra: int = 0):
        """(rows that draft from their context [W], nonzero where so, those drafts [W, K]); the contexts
        are `lengths + extra` tokens long (the head's lengths and 1: the history is a token ahead)."""
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

    def _fold(self):
        """Add up the rounds waiting, a few ops for each run of rounds of one width."""
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


def _draft_model(spec: SpeculativeConfig, bundle: ModelBundle) -> "Drafter":
    from .draft_model import load_drafter  # (it builds on _CachedDrafter above)

    return load_drafter(spec, bundle)


def _mtp(spec: SpeculativeConfig, bundle: ModelBundle) -> MtpDrafter:
    from .models.mtp import load_head
    from .mtp_draft import load_draft_vocab

    head = load_head(bundle, spec.mtp_head)
    vocab = load_draft_vocab(head, spec.mtp_head, bundle.vocab_size)
    lookup = LookupFallback(spec.ngram_size, spec.mtp_lookup) if spec.mtp_lookup else None
    drafter = MtpDrafter(head, vocab=vocab, compiled=spec.compiled_verify != "off", lookup=lookup,
                         catch_up_len=spec.depth + 1)
    drafter.acceptance_prior = head_acceptance(spec.mtp_head)
    return drafter


def head_acceptance(sidecar: Optional[str]) -> Optional[List[float]]:
    """The head's held-out acceptance per draft position (P(draft j passes | draft j-1 passed), from
    its training run's mtp_head.json), or None where it has none: adaptive depth starts from it."""
    import json
    from pathlib import Path

    from .models.mtp import SIDECAR_META

    try:
        got = json.loads((Path(sidecar) / SIDECAR_META).read_text()).get("heldout_acceptance_by_depth")
    except (TypeError, OSError, ValueError):
        return None
    ok = isinstance(got, list) and got and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in got)
    return [float(a) for a in got] if ok else None


# speculative.method -> the drafter for a job's settings and the target model
DRAFTERS: Dict[str, Callable[[SpeculativeConfig, ModelBundle], Drafter]] = {
    "ngram": lambda spec, bundle: NgramDrafter(spec.ngram_size),
    "draft": _draft_model,
    "mtp": _mtp,
}


if set(DRAFTERS) != set(SPEC_METHODS) - {"none"}:  # the job schema checks methods without loading this module
    raise ImportError(f"mtplx.config.SPEC_METHODS {SPEC_METHODS} and DRAFTERS {sorted(DRAFTERS)} disagree")


def make_drafter(spec: SpeculativeConfig, bundle: ModelBundle) -> Optional[Drafter]:
    """The drafter `spec.method` names; None for plain decoding (`none`)."""
    if spec.method == "none":
        return None
    if spec.method not in DRAFTERS:
        raise ValueError(f"unknown speculative method {spec.method!r}")
    return DRAFTERS[spec.method](spec, bundle)
