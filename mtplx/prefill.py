"""Prefill: prompt tokens into cache, in chunk spans, reusing prefixes shared with earlier rows (the
steps: docs/architecture.md). Rows prefilled together write at their own offsets: padding never enters a
row's cache."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .cache import BatchCache, CacheRow, capacity_bucket
from .config import prefill_chunk_env, sustained_prefill_env
from .counters import Counters
from .models.mtp import project_logits, trunk_hidden
from .sampling import SamplerBatch, sample_from, shaped_probs, uniforms

MIN_PREFIX_TOKENS = 8  # shorter shared prefixes are not worth a snapshot
PREFIX_STORE_SIZE = 4  # rows arrive grouped by prefix, so a few recent prefixes suffice


def _prefill_chunk_size(config: Optional[dict] = None, memory_budget: Optional[int] = None) -> int:
    """Tokens per prefill span: `MTPLX_PREFILL_CHUNK_SIZE` (0: off), else a span's activations within ~2% of
    the memory budget, in [128, 2048] (past that the matmuls are full; below, launches are wasted)."""
    env = prefill_chunk_env()
    if env is not None:
        return env
    if not config or not memory_budget:
        return 512
    chunk = int(0.02 * memory_budget) // max(activation_bytes(config), 1)
    return int(min(2048, max(128, chunk // 128 * 128)))


def activation_bytes(config: dict) -> int:
    """A forward's activations per token, about 4 bytes x (8 x hidden + 3 x intermediate)."""
    hidden = int(config.get("hidden_size", 1024))
    inter = int(config.get("intermediate_size", 4 * hidden) or 4 * hidden)
    return 4 * (8 * hidden + 3 * inter)


def _split_spans_at(spans: Iterable[Tuple[int, int]], edges: Sequence[int]) -> List[Tuple[int, int]]:
    out = []
    cuts = sorted(set(edges))
    for start, end in spans:
        for e in cuts:
            if start < e < end:
                out.append((start, e))
                start = e
        out.append((start, end))
    return out


def _iter_prefill_chunk_spans(token_count: int, chunk_size: Optional[int], mandatory_edges: Sequence[int] = (),
                              sustained: Optional[bool] = None):
    """Spans of `chunk_size` tokens split at the edges; one unless `sustained` (MTPLX_SUSTAINED_PREFILL_LAYOUT)."""
    if token_count <= 0:
        return
    if not (sustained_prefill_env() if sustained is None else sustained):
        yield (0, token_count)
        return
    step = chunk_size if chunk_size and chunk_size > 0 else token_count
    spans = [(s, min(s + step, token_count)) for s in range(0, token_count, step)]
    yield from _split_spans_at(spans, [e for e in mandatory_edges if 0 < e < token_count])


class PrefixStore:
    """The last few shared prefixes: (target prefix as a one-row cache, drafter snapshot) by tokens."""

    def __init__(self, size: int = PREFIX_STORE_SIZE):
        self.size = size
        self._items: "OrderedDict[str, tuple]" = OrderedDict()

    @staticmethod
    def key(tokens: Sequence[int], edge: int) -> Optional[str]:
        if edge < MIN_PREFIX_TOKENS:
            return None
        return hashlib.sha1(np.asarray(tokens[:edge], dtype=np.int64).tobytes()).hexdigest()

    def get(self, key):
        hit = self._items.get(key) if key else None
        if hit is not None:
            self._items.move_to_end(key)
        return hit

    def put(self, key, value):
        self._items[key] = value
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def values(self):
        return list(self._items.values())

    def clear(self) -> None:
        self._items.clear()


PADDING_WASTE = 0.25  # a padded prefill batch spends at most this fraction more than its real tokens
GPU_PADDING_WASTE = 3.0  # a GPU group costs its launches whatever its padding (128 rows: 14.6 ms a round, 17.5)


def pads_queries() -> bool:
    """On a GPU MLX builds an attention plan per exact query shape, so batched prefills round their
    query length up (at most 1/8 more work past 256 tokens): few shapes. Elsewhere padding only costs."""
    return mx.default_device().type == mx.DeviceType.gpu


def prefill_width(n: int, room: Optional[int] = None) -> int:
    """The query length a batched prefill forward of `n` tokens runs at (at most `room`)."""
    if n <= 0 or not pads_queries():
        return n
    step = max(32, 1 << max(0, n.bit_length() - 4))
    width = -(-n // step) * step
    return max(n, width if room is None else min(width, room))


def length_groups(lengths: Sequence[int], max_waste: float = PADDING_WASTE) -> List[List[int]]:
    """Indices into `lengths`, shortest first, cut into groups prefilled as one padded batch: a row
    joins while the group's padded slots stay within (1 + max_waste) x its real tokens."""
    groups: List[List[int]] = []
    current: List[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (len(current) + 1) * lengths[i] > (1 + max_waste) * (real + lengths[i]):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        groups.append(current)
    return groups


class Prefiller:
    """Prompts into caches (and the drafter's state). `hybrid`: recurrent layers, so rows prefill one by
    one; `progress(kind, tokens)`: told of every span."""

    def __init__(self, runtime, chunk: int, hybrid: bool, counters: Counters,
                 progress: Callable[[str, int], None] = lambda kind, tokens: None, sustained: bool = True):
        self.runtime = runtime
        self.model = runtime.model
        self.chunk = chunk
        self.hybrid = hybrid
        self.counters = counters
        self.progress = progress
        self.sustained = sustained
        self.store = PrefixStore()
        self.padding_waste = GPU_PADDING_WASTE if mx.default_device().type == mx.DeviceType.gpu else PADDING_WASTE

    def edge(self, row) -> int:
        return min(max(int(row.req.stable_prefix_len or 0), 0), len(row.req.prompt_tokens) - 1)

    def hidden(self, tokens: mx.array, cache: BatchCache) -> mx.array:
        """The trunk over `tokens`: its hidden states (MTP), or the logits (only the last is used)."""
        if self.runtime.split:
            return trunk_hidden(self.model, tokens, cache.layers)
        return self.model(tokens, cache=cache.layers)

    def _first_tokens(self, rows, last: mx.array) -> mx.array:
        """The rows' first tokens [B] on the device (not read)."""
        logits = project_logits(self.model, last) if self.runtime.split else last
        sampler = SamplerBatch.from_params([r.req.params for r in rows])
        u = mx.array(np.array([uniforms(r.rng) for r in rows], dtype=np.float32))
        return sample_from(shaped_probs(logits, sampler)[:, 0], u).astype(mx.int32)

    def run(self, rows, drafter=None, read: bool = True):
        """(cache row, drafter state, first token) per row; `read` False: (that list, the first tokens on
        the device), a row's own token None unless it was read anyway."""
        out = [None] * len(rows)
        keys = [PrefixStore.key(r.req.prompt_tokens, self.edge(r)) for r in rows]
        seen = set()
        alone, together = [], []
        for i, (row, key) in enumerate(zip(rows, keys)):
            leader = key is not None and self.store.get(key) is None and key not in seen
            seen.add(key)
            (alone if leader or self.hybrid else together).append(i)
        for i in alone:  # leaders first: their prefixes are stored for the rows after them
            out[i] = self._drafter_prefill(drafter, rows[i], keys[i], *self.alone(rows[i], keys[i]))
        todo = [len(rows[i].req.prompt_tokens) - (self.edge(rows[i]) if self.store.get(keys[i]) else 0)
                for i in together]
        # every group's forwards are queued before one read of all first tokens (the device never idles)
        groups = []
        for group in length_groups(todo, self.padding_waste):
            members = [together[g] for g in group]
            results, firsts = self.group([rows[i] for i in members], [keys[i] for i in members])
            states = self._head_states(drafter, [rows[i] for i in members], results, firsts)
            groups.append((members, results, firsts, states))
        # a drafter without a batched prefill takes each row's first token on the host (prefill_row)
        host = read or (drafter is not None and any(st is None for g in groups for st in g[3]))
        device = None if read else self._firsts_in_row_order(out, alone, groups)
        got = iter(np.array(mx.concatenate([g[2] for g in groups])).tolist()) if groups and host else None
        for members, results, _, states in groups:
            for i, res, state in zip(members, results, states):
                first = next(got) if got is not None else None
                out[i] = self._drafter_prefill(drafter, rows[i], keys[i], res[0], res[1], first, *res[2:], state=state)
        for row in rows:
            row.stats.prompt_tokens = len(row.req.prompt_tokens)
        return out if read else (out, device)

    @staticmethod
    def _firsts_in_row_order(out, alone, groups) -> mx.array:
        parts = ([mx.array([out[i][2] for i in alone], dtype=mx.int32)] if alone else []) + [g[2] for g in groups]
        if not parts:
            return mx.zeros((0,), mx.int32)
        order = alone + [i for g in groups for i in g[0]]
        return mx.take(mx.concatenate(parts), mx.array(np.argsort(np.asarray(order)).astype(np.int32)))

    def _restore(self, cache: BatchCache, rows, keys, reserve: int = 0) -> Tuple[List[int], List[Optional[tuple]]]:
        hits = [self.store.get(key) for key in keys]
        at = [b for b, hit in enumerate(hits) if hit is not None]
        if at:
            cache.put_rows(at, [CacheRow(hits[b][0], 0) for b in at], reserve)
        starts = [int(n) for n in cache.rows.host]
        for row, hit, start in zip(rows, hits, starts):
            if hit is not None:
                row.stats.cached_prompt_tokens = start
        return starts, hits

    def alone(self, row, key):
        """Prefill one row, snapshotting it at its stable-prefix edge: (cache row, hidden, first, hit, snap)."""
        toks = row.req.prompt_tokens
        n, edge = len(toks), self.edge(row)
        cache = BatchCache.for_model(self.model, 1)
        (start,), (hit,) = self._restore(cache, [row], [key], reserve=n + 1)
        snap, hiddens, h = None, [], None
        for s, e in _iter_prefill_chunk_spans(n, self.chunk, (edge,) if key else (), self.sustained):
            if e <= start:
                continue
            s = max(s, start)
            h = self.hidden(mx.array(toks[s:e], dtype=mx.int32)[None], cache)
            cache.commit([e - s])
            if self.runtime.want_hidden:
                hiddens.append(h)
            if e < n:  # the last span is read with the first token
                mx.eval(h, [a for c in cache.leaves for a in c.state_arrays() if a is not None])
            self.progress("prefill", e - s)
            row.stats.prefill_chunks += 1
            if key and hit is None and e == edge:
                snap = cache.snapshot_row(0)
        self._count(n, start)
        first = int(np.array(self._first_tokens([row], h[:, -1:]))[0])
        hidden = mx.concatenate(hiddens, axis=1) if hiddens else None
        return CacheRow(cache, 0), hidden, first, hit, snap

    def group(self, rows, keys):
        """Prefill rows' suffixes together, padded: ((cache row, hidden, hit, snapshot) each, first tokens)."""
        B = len(rows)
        cache = BatchCache.for_model(self.model, B)
        starts, hits = self._restore(cache, rows, keys, reserve=max(len(r.req.prompt_tokens) for r in rows) + 1)
        todo = [len(r.req.prompt_tokens) - s for r, s in zip(rows, starts)]
        chunk = (self.chunk if self.sustained else 0) or max(todo)
        last = [None] * B
        hiddens = [[] for _ in range(B)]
        cap = capacity_bucket(max(len(r.req.prompt_tokens) for r in rows) + 1)  # padding stays in the bucket
        for c in range(0, max(todo), chunk):
            width = min(chunk, max(todo) - c)
            grid = np.zeros((B, prefill_width(int(width), cap - int(cache.rows.max))), dtype=np.int32)
            counts = np.zeros(B, dtype=np.int64)
            for b, row in enumerate(rows):
                part = row.req.prompt_tokens[starts[b] + c : starts[b] + c + width]
                grid[b, : len(part)] = part
                counts[b] = len(part)
            h = self.hidden(mx.array(grid), cache)
            cache.commit(counts)
            if c + width < max(todo):  # the last chunk is read with the first tokens
                mx.eval(h, [a for layer in cache.leaves for a in layer.state_arrays() if a is not None])
            self.progress("prefill", int(counts.sum()))
            for b in range(B):
                if counts[b]:
                    rows[b].stats.prefill_chunks += 1
                    last[b] = h[b : b + 1, counts[b] - 1 : counts[b]]
                    if self.runtime.want_hidden:
                        hiddens[b].append(h[b : b + 1, : counts[b]])
        for row, s in zip(rows, starts):
            self._count(len(row.req.prompt_tokens), s)
        firsts = self._first_tokens(rows, mx.concatenate(last, axis=0))
        out = []
        for b, row in enumerate(rows):
            hidden = mx.concatenate(hiddens[b], axis=1) if hiddens[b] else None
            snap = cache.snapshot_row(b, self.edge(row)) if keys[b] and hits[b] is None else None
            out.append((CacheRow(cache, b), hidden, hits[b], snap))
        return out, firsts

    def _count(self, n, start):
        self.counters.prefill_tokens += n - start
        self.counters.cached_prompt_tokens += start

    @staticmethod
    def _head_states(drafter, rows, results, firsts) -> List[Optional[tuple]]:
        """The drafter's states from one batched `prefill_rows`; None where it prefills row by row."""
        at = [b for b, res in enumerate(results) if res[1] is not None]
        states = [None] * len(rows)
        if drafter is not None and at:
            pick = firsts[mx.array(at)] if len(at) < len(rows) else firsts
            got = drafter.prefill_rows([rows[b].req.prompt_tokens for b in at], [results[b][1] for b in at],
                                       pick, [results[b][2][1] if results[b][2] is not None else None for b in at])
            for b, state in zip(at, got or ()):
                states[b] = state
        return states

    def _drafter_prefill(self, drafter, row, key, cache, hidden, first, hit, target_snap, state=None):
        """(cache, drafter state, first token), storing the prefix snapshot where this row leads."""
        toks, edge = row.req.prompt_tokens, self.edge(row)
        drafter_snap = None
        if drafter is not None:
            if state is None:
                state = drafter.prefill_row(toks, hidden, first, hit[1] if hit is not None else None, edge=edge)
            if target_snap is not None:
                at_edge = hidden[:, edge - 1 : edge] if hidden is not None else None
                drafter_snap = drafter.snapshot(state, edge, at_edge)
        if target_snap is not None:  # kept as a one-row cache: restoring it is a gather per layer
            prefix = BatchCache(cache.cache.kinds, [0])
            prefix.write_row(0, target_snap)
            self.store.put(key, (prefix, drafter_snap))
        return cache, state, first
