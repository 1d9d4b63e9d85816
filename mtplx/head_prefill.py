"""The MTP head's prefill for a group of rows at once (the rows the trunk prefilled together).

`MtpDrafter.prefill_row` runs the head over one row's prompt, a forward and a host sync per
chunk; admitting 32 rows so cost 32 small launch-bound forwards. Here the group's rows are
right-padded to the longest and run as one forward per chunk, with one eval per chunk for the
group (but the last: it is evaluated with the round the rows join). A row with a restored prefix (the prefix store's head snapshot and the trunk's hidden
state at the edge) starts from that snapshot and runs the head over its suffix only, as
`prefill_row` does with `prefix`, in the same forwards as the others. Each row writes its own span
at its own offset (BatchCache's per-row lengths), so padding never enters a row's entries, and
each row leaves with the state `prefill_row` gives it: a one-row head cache, [first-draft
logits, head hidden] and, with lookup, its context.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .cache import BatchCache, capacity_bucket
from .mtp_draft import project
from .prefill import prefill_width


def head_prefill_rows(drafter, prompts: Sequence[Sequence[int]], hiddens: Sequence[mx.array],
                      firsts, prefixes: Optional[Sequence[Optional[tuple]]] = None) -> List[tuple]:
    """Per row, the state `drafter.prefill_row(prompts[b], hiddens[b], firsts[b], prefixes[b])`
    gives (`firsts`: the rows' first tokens, ints or a [B] device array): `hiddens[b]` holds the
    trunk's hidden state at the prompt positions the trunk ran (all of them, or those after a
    restored prefix), `prefixes[b]` is None or the drafter's snapshot (head snapshot, trunk hidden
    at the edge) of the row's restored prefix."""
    B = len(prompts)
    prefixes = list(prefixes) if prefixes is not None else [None] * B
    hiddens = list(hiddens)
    cache = BatchCache(list(drafter.head.cache_kinds), [0] * B)
    starts = [0] * B
    for b, prefix in enumerate(prefixes):
        if prefix is not None:  # the head's entries of the prefix, and the trunk's h at its last position
            cache.write_row(b, prefix[0])
            starts[b] = prefix[0][0]
            hiddens[b] = mx.concatenate([prefix[1], hiddens[b]], axis=1)
    # the head at position i reads the trunk's h[i] and the token after it (the first token last).
    # `firsts` may be a device array not read yet (prefill.py reads an admission's first tokens
    # once, after every group's forwards are queued): it is placed in the grid on the device.
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
    for s in range(0, L, drafter.chunk):
        e = min(s + drafter.chunk, L)
        counts = np.clip(lengths - s, 0, e - s)
        h_out = drafter.head.hidden(hidden[:, s:e], grid[:, s:e], cache.layers)
        cache.commit(counts)
        if e < L:  # the last chunk is evaluated with the round the rows join (no sync of its own)
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
            state += (drafter.lookup.context(mx.concatenate([mx.array(list(prompts[b]), dtype=mx.int32), firsts[b : b + 1]])),)
        states.append(state)
    return states
