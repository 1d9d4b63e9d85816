"""The draft source's interface: every method and attribute the engine uses, nothing else.

A drafter keeps per-slot state mirroring the batch's slots, built after a row's prefill and moved with
it. Each round the engine asks for K drafts per row (`propose`) and tells it what was kept: `commit`
with host arrays, or, where it drafts on the device (`device_side`), `advance` with device arrays it
never reads, so the next round queues before this one is read. A new draft method is one subclass and
one line in `drafting.DRAFTERS`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..cache import BatchCache, capacity_bucket
from ..counters import Counters
from ..graphbank import Programs
from ..sampling import SamplerBatch


class Drafter:
    name = ""  # the `speculative.method` it serves
    needs_hidden = False  # reads the trunk's hidden states (the engine computes them only then)
    device_side = False  # drafts on the device: `advance`, `correct` and `settle` are called, not `commit`
    drafts_ahead = False  # `advance(following=...)` drafts the next round too
    acceptance_prior: Optional[List[float]] = None  # P(draft j passes | j-1 passed), recorded: adaptive depth's start
    programs = 1  # compiled programs a drafting depth builds at a new width: the verify's, and the drafter's own
    chunk = 0  # tokens a row's prefill forward of its own takes at most (0: it runs none)

    def __init__(self, counters: Optional[Counters] = None):
        self.counters = counters if counters is not None else Counters()  # where its compiled programs count

    # -- rows in and out of the batch --------------------------------------------------------------
    def prefill_row(self, tokens: Sequence[int], hidden: Optional[mx.array], first_token: int,
                    prefix: Optional[object] = None, edge: int = 0) -> object:
        """One row's state after its prompt `tokens` and its first token. `hidden`: the trunk's hidden
        states at the prompt positions it ran (with `needs_hidden`); `prefix`: a `snapshot` to start
        from; `edge`: the stable-prefix edge, where `snapshot` may be asked for the state."""
        raise NotImplementedError

    def prefill_rows(self, prompts, hiddens, firsts, prefixes) -> Optional[List[object]]:
        """`prefill_row` for a group the trunk prefilled together (`firsts`: a device array, not read), or
        None where this drafter prefills row by row."""
        return None

    def snapshot(self, state: object, length: int, hidden_at_edge: Optional[mx.array]) -> object:
        """The state of the first `length` prompt tokens, kept with the target's prefix snapshot."""
        return None

    def reset(self) -> None:
        """No rows: a new `generate` call starts."""
        raise NotImplementedError

    def extend(self, states: Sequence[object]) -> None:
        """Append rows (only while a batch grows to its width)."""
        raise NotImplementedError

    def write(self, slot: int, state: object) -> None:
        raise NotImplementedError

    def take(self, keep: Sequence[int]) -> None:
        """Keep the rows of these slots, in this order (a drained batch narrows)."""
        raise NotImplementedError

    def vacate(self, slots: Sequence[int]) -> None:
        """These slots' rows finished: later rounds attend over none of their entries."""

    def reserve(self, entries: int) -> None:
        """Caches grown from now on hold `entries` per row at once, so a batch's programs have one capacity."""

    def state_arrays(self) -> List[mx.array]:
        """The arrays of the rows' state, queued for evaluation with the batch's cache."""
        return []

    def slot_bytes(self, reach: int) -> int:
        """Bytes one slot's state holds where the batch's rows reach `reach` tokens (for memory admission)."""
        return 0

    # -- rounds --------------------------------------------------------------------------------------
    def propose(self, K: int, pending: mx.array, sampler: SamplerBatch,
                u: mx.array) -> Tuple[mx.array, Optional[mx.array]]:
        """Drafts [W, K] after each row's `pending` token, and their proposal distribution q [W, K, V]
        (None where drafts are deterministic: a point mass); `u`: the rows' uniforms for them."""
        raise NotImplementedError

    def commit(self, n_accept: np.ndarray, next_tokens: np.ndarray, drafts: np.ndarray, active: np.ndarray,
               verify_in: Optional[mx.array] = None, hidden: Optional[mx.array] = None) -> None:
        """A round was read: each row kept `n_accept` drafts and then `next_tokens` (host arrays)."""
        raise NotImplementedError

    def advance(self, n: mx.array, nxt: mx.array, counts: mx.array, most: np.ndarray, verify_in: mx.array,
                hidden: Optional[mx.array], following: Optional[tuple] = None) -> None:
        """`commit` from device arrays it never reads (device-side drafters): `counts` each row's
        committed tokens, `most` a host upper bound of them; with `drafts_ahead`, `following` = (K,
        sampler, u) drafts the next round too, and `propose` with those returns the drafts."""
        raise NotImplementedError

    def correct(self, excess: np.ndarray) -> None:
        """A round's counts were read: the host lengths were `excess` too long."""

    def settle(self, done: bool = False) -> None:
        """Exact host lengths again (a call of rounds ends; `done`: its rows are all done, no round follows)."""

    @property
    def lag(self) -> int:
        """Rounds it must catch up on before it drafts again (rounds at depth 0 it put off)."""
        return 0

    def fuse_kernels(self, compiled: bool) -> Dict[str, int]:
        """The trunk's CUDA decode paths for the drafter's own modules; what was installed, by name."""
        return {}


class CachedDrafter(Drafter):
    """Slot bookkeeping for drafters that keep a BatchCache plus per-row arrays (`extra`)."""

    cache: Optional[BatchCache] = None
    extra: List[mx.array] = []
    margin = 0  # entries a round writes past a row's context: its cache grows (in buckets) to hold them
    _sizes: Optional[tuple] = None  # (bytes per entry, bytes per row) of a slot, measured once (`probe`)

    def probe(self) -> tuple:
        """A one-row state (`prefill_row`'s) after a token or two: what a slot holds is measured on it."""
        raise NotImplementedError

    def slot_bytes(self, reach):
        if self._sizes is None:
            state = self.probe()
            per_entry, per_row = state[0].row_bytes()
            self._sizes = (per_entry, per_row + sum(a.nbytes for a in state[1]))
        return int(self._sizes[0] * capacity_bucket(reach + self.margin) + self._sizes[1])

    def reset(self):
        self.cache, self.extra = None, []

    def extend(self, states):
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

    def vacate(self, slots):
        if self.cache is not None:
            self.cache.rows.place(slots, [0] * len(slots))

    def state_arrays(self):
        if self.cache is None:
            return []
        return [a for c in self.cache.leaves for a in c.state_arrays() if a is not None] + list(self.extra)

    def correct(self, excess):
        self.cache.rows.correct(excess)

    def settle(self, done=False):
        self.cache.rows.settle()


class DraftBank:
    """A drafter's compiled programs over a shadow of its KV cache (graphbank.py), with the calls that
    ran eagerly instead counted by reason (`stats`)."""

    def __init__(self, programs: Programs):
        self.programs = programs
        self.reserve = 0  # entries a row may reach: a cache grown here holds them at once (one capacity a batch)
        self.stats: Dict[str, object] = {"compiled_calls": 0, "eager_calls": 0, "fallback_reasons": {}}

    def eager(self, reason: str) -> None:
        self.stats["eager_calls"] += 1
        reasons = self.stats["fallback_reasons"]
        reasons[reason] = reasons.get(reason, 0) + 1

    def ready(self, cache: BatchCache, L: int) -> Optional[list]:
        """The cache's arrays with room for L more entries per row, or None where it cannot be compiled
        over (recurrent layers, or empty)."""
        if any(k != "kv" for k in cache.kinds) or any(c.keys is None for c in cache.layers):
            self.eager("cache not compilable (recurrent layers, or empty)")
            return None
        for c in cache.layers:
            c.ensure_capacity(cache.batch, c.keys, c.values, max(cache.rows.max, self.reserve) + L)
        return [a for c in cache.layers for a in c.state_arrays()]

    def call(self, key, build, *args):
        """The program's outputs, or None where it runs eagerly (counted, saying why)."""
        out = self.programs.call(key, build, *args)
        if out is None:
            self.eager(self.programs.broken[key])
            return None
        self.stats["compiled_calls"] += 1
        return out
