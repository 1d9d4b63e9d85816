"""Prompt lookup: match the last n tokens earlier in the row's prompt + output, propose what followed.

It drafts on the host from the tokens it has read, so a round that drafts is not queued ahead; its
rounds at depth 0 are plain ones, queued one ahead (rounds.py). MTP's fallback matches on the device."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .base import Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, ngram_size: int = 3, counters=None):
        super().__init__(counters)
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

    def propose(self, K, pending, sampler, u):
        drafts = np.zeros((len(self.rows), K), dtype=np.int32)
        for i, row in enumerate(self.rows):
            if row is not None:
                _, cont = self.match(row[0], row[1], K)
                drafts[i] = cont + [cont[-1]] * (K - len(cont)) if cont else [row[0][-1]] * K
        return mx.array(drafts), None

    def commit(self, n_accept, next_tokens, drafts, active, verify_in=None, hidden=None):
        for i, row in enumerate(self.rows):
            if row is None or not active[i]:
                continue
            history, index = row
            for tok in list(drafts[i, : n_accept[i]]) + [int(next_tokens[i])]:
                # index every n-gram that now ends just before the newest token
                end = len(history)
                for size in range(1, min(self.n, end) + 1):
                    index[(size,) + tuple(history[end - size : end])] = end
                history.append(int(tok))
