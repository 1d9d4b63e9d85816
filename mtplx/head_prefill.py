"""The MTP head's prefill for a group of rows at once (the rows the trunk prefilled together).

`MtpDrafter.prefill_row` runs the head over one row's prompt, a forward and a host sync per
chunk; admitting 32 rows so cost 32 small launch-bound forwards. Here the group's rows are
right-padded to the longest and run as one forward per chunk, with one eval per chunk for the
group. Each row writes its own span at its own offset (BatchCache's per-row lengths), so padding
never enters a row's entries, and each row leaves with the state `prefill_row` gives it: a
one-row head cache, [first-draft logits, head hidden] and, with lookup, its context.
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
import numpy as np

from .cache import BatchCache
from .mtp_draft import project


def head_prefill_rows(drafter, prompts: Sequence[Sequence[int]], hiddens: Sequence[mx.array],
                      firsts: Sequence[int]) -> List[tuple]:
    """Per row, the state `drafter.prefill_row(prompts[b], hiddens[b], firsts[b])` gives (rows
    without a restored prefix: `hiddens[b]` holds the trunk's hidden state at every prompt
    position)."""
    B = len(prompts)
    # the head at position i reads the trunk's h[i] and the token after it (the first token last)
    nxt = [list(p[1:]) + [int(f)] for p, f in zip(prompts, firsts)]
    lengths = np.array([len(t) for t in nxt], dtype=np.int64)
    L = int(lengths.max())
    grid = np.zeros((B, L), dtype=np.int32)
    for b, t in enumerate(nxt):
        grid[b, : len(t)] = t
    hidden = mx.concatenate([mx.pad(h, [(0, 0), (0, L - h.shape[1]), (0, 0)]) for h in hiddens])
    cache = BatchCache(list(drafter.head.cache_kinds), [0] * B)
    last = [None] * B
    for s in range(0, L, drafter.chunk):
        e = min(s + drafter.chunk, L)
        counts = np.clip(lengths - s, 0, e - s)
        h_out = drafter.head.hidden(hidden[:, s:e], mx.array(grid[:, s:e]), cache.layers)
        cache.commit(counts)
        cache.eval()
        for b in np.flatnonzero((lengths > s) & (lengths <= e)):  # rows whose last position is here
            last[b] = h_out[b, counts[b] - 1]
    h_last = mx.stack(last)
    logits = project(drafter.head, drafter.vocab, h_last)
    states = []
    for b in range(B):
        row = BatchCache(cache.kinds, [0])
        row.write_row(0, cache.snapshot_row(b))
        state = (row, [logits[b : b + 1], h_last[b : b + 1]])
        if drafter.lookup is not None:  # the row's context: one token longer than its head cache
            state += (mx.array(list(prompts[b]) + [int(firsts[b])], dtype=mx.int32)[None],)
        states.append(state)
    return states
