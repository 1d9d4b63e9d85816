"""A batch cache where every row has its own length, so rows can commit different token counts.

A forward writes each row's entries at its own offset, attention masks out everything past a row's
length, and `commit(counts)` moves each row's length by what it accepted: rejected entries stay past
it until overwritten, so rollback of attention KV is free. Recurrent layers capture their state after
every position during a verify (gdn.py, recurrent.py); `commit` keeps each row's accepted one.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .row_lengths import RowLengths

CAPACITY_STEP = 256


def capacity_bucket(n: int) -> int:
    """Cache capacity for `n` entries: powers of two from 256 up to 4096, then multiples of 4096.
    Compiled programs are keyed by capacity, so buckets must be few; attention over the unused part
    of a bucket is masked and costs little next to the weights."""
    if n <= 4096:
        return max(CAPACITY_STEP, 1 << (n - 1).bit_length())
    return -(-n // 4096) * 4096


class RowKVCache:
    """Attention KV for a batch of rows of different lengths (one layer).

    When every row has the same length n (`RowLengths.shared`: always at width 1) and the forward
    is eager, the cache writes by slice at n with an int rope offset, and for one token does what
    mlx-lm's KVCache does: attention over exactly n + 1 keys with no mask, which keeps the fused
    attention kernels (CUDA has none for a boolean mask at one query). Otherwise every row writes
    at its own offset and attention reads the whole capacity bucket under a [B, 1, N, cap] mask.
    """

    def __init__(self, lengths: RowLengths):
        self.rows = lengths
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        # How many key positions attention reads; None: the whole capacity bucket, masked, so shapes
        # change only when a bucket fills (on a GPU each new shape costs kernel builds)
        self.attend_len: Optional[int] = None

    # -- what mlx-lm model code calls ---------------------------------------------------------
    def _shared(self) -> Optional[int]:
        """The one length all rows have, when this forward may use it (eager), else None."""
        return self.rows.shared if self.attend_len is None else None

    @property
    def offset(self):
        n = self._shared()
        return self.rows.resident() if n is None else n

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, L, _ = keys.shape
        if self.attend_len is None:
            self.ensure_capacity(B, keys, values, self.rows.max + L)
        n = self._shared()
        if n is not None:
            self.keys[..., n : n + L, :] = keys
            self.values[..., n : n + L, :] = values
            if L == 1:
                return self.keys[..., : n + 1, :], self.values[..., : n + 1, :]
            return self.keys, self.values  # several tokens: the bucket under make_mask's mask (see there)
        pos = self.rows.positions(L)
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(pos, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(pos, values.shape), values, axis=2)
        n = self.attend_len or self.keys.shape[2]
        return self.keys[..., :n, :], self.values[..., :n, :]

    def capacity_after(self, N: int) -> int:
        """The capacity this cache will have once a forward of N more tokens has written them."""
        need = self.rows.max + N
        if self.keys is None:
            return capacity_bucket(need)
        return self.keys.shape[2] if need <= self.keys.shape[2] else capacity_bucket(need)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        shared = self._shared()
        if shared is not None and N == 1:  # mlx-lm's own KVCache mask over exactly shared + 1 keys
            # (one token only: exact key counts for several would give CUDA a new attention shape,
            # and so a new cuDNN graph, every step)
            from mlx_lm.models.cache import create_attention_mask

            return create_attention_mask(N, shared, return_array, window_size)
        n = self.attend_len or self.capacity_after(N)
        query_pos = self.rows.device[:, None] + mx.arange(N, dtype=mx.int32)  # [B, N]
        key_pos = mx.arange(n, dtype=mx.int32)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        if window_size is not None:
            mask = mask & (key_pos[None, None, :] > query_pos[:, :, None] - window_size)
            return mask[:, None]  # [B, 1, N, n]
        self.rows.mask = mask[:, None]  # RowLengths.mask
        return self.rows.mask

    # -- batch bookkeeping ----------------------------------------------------------------------
    def ensure_capacity(self, B, keys, values, need):
        """Room for `need` entries a row, in capacity buckets (`keys`, `values`: the shapes to make)."""
        if self.keys is None:
            cap = capacity_bucket(need)
            self.keys, self.values = (mx.zeros((B, a.shape[1], cap, a.shape[3]), a.dtype) for a in (keys, values))
        elif need > self.keys.shape[2]:
            grow = [(0, 0), (0, 0), (0, capacity_bucket(need) - self.keys.shape[2]), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, grow), mx.pad(self.values, grow)

    def state_arrays(self):
        return [self.keys, self.values]

    def take_rows(self, idx: mx.array):
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]

    def row_slice(self, row: int, length: int):
        """A copy of one row's first `length` entries (for prefix snapshots)."""
        if self.keys is None:
            return None
        return (mx.array(self.keys[row : row + 1, :, :length]), mx.array(self.values[row : row + 1, :, :length]))

    def write_row(self, row: int, kv, batch: int):
        """Place one row's entries (from `row_slice` of another cache) at row `row`."""
        if kv is None:
            return
        k, v = kv
        self.ensure_capacity(batch, k, v, k.shape[2])
        self.keys[row : row + 1, :, : k.shape[2]] = k
        self.values[row : row + 1, :, : v.shape[2]] = v

    def put_rows(self, slots: Sequence[int], src: "RowKVCache", rows: Sequence[int], length: int, batch: int,
                 reserve: int = 0):
        """Rows `rows` of `src` (their first `length` entries) at `slots`: one gather and one
        write, whatever the number of rows (a slice write where the slots are consecutive)."""
        if src.keys is None:
            return
        k, v = _take_rows(src.keys, rows, length), _take_rows(src.values, rows, length)
        if self.keys is None and list(slots) == list(range(batch)):  # a new cache of exactly these rows
            cap = capacity_bucket(max(length, reserve))
            pad = [(0, 0), (0, 0), (0, cap - length), (0, 0)]
            self.keys, self.values = mx.pad(k, pad), mx.pad(v, pad)
            return
        self.ensure_capacity(batch, k, v, max(length, reserve))
        at = _slot_index(slots)
        self.keys[at, :, :length] = k
        self.values[at, :, :length] = v

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _take_rows(a: mx.array, rows: Sequence[int], length: Optional[int] = None) -> mx.array:
    """a[rows] (with axis 2 cut to `length`), without a gather when `rows` are all of `a`'s rows."""
    rows = list(rows)
    whole = rows == list(range(a.shape[0]))
    if length is not None and length < a.shape[2]:
        a = a[:, :, :length]
    return a if whole else a[mx.array(np.asarray(rows, dtype=np.int32))]


def _slot_index(slots: Sequence[int]):
    """A slice for consecutive slots (a plain copy), else an index array (a scatter)."""
    slots = list(slots)
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return mx.array(np.asarray(slots, dtype=np.int32))


class ArraysSurface:
    """mlx-lm's ArraysCache surface over `self.cache`, a list of slots: what a recurrent layer calls."""

    lengths = None  # mlx-lm's right-padding hook; rows' lengths live in RowLengths here

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, v):
        self.cache[i] = v

    def __bool__(self):
        return True

    def advance(self, n):
        pass  # lengths move on commit, not per forward

    def make_mask(self, N: int, **kwargs):
        return None


class RowStateCache(ArraysSurface):
    """Recurrent state (conv window, SSM / Gated DeltaNet state) for a batch of rows (one layer), with
    `size` slots. While `capturing`, the layer's capture (gdn.py, recurrent.py) records every slot's
    value after each position of the forward; `commit(counts)` keeps, per row, the value after its
    last accepted position (a row with count 0 keeps its state)."""

    def __init__(self, lengths: RowLengths, size: int = 2):
        self.rows = lengths
        self.cache: List[Optional[mx.array]] = [None] * size
        self.capturing = False
        self._steps: Optional[List[mx.array]] = None  # per slot: [B, L, ...] value after each position

    def record(self, conv_input: mx.array, states: mx.array):
        """Gated DeltaNet capture: the conv input [B, k-1+L, C] and the state after each position."""
        L = states.shape[1]
        n_keep = conv_input.shape[1] - L
        windows = mx.stack([conv_input[:, t + 1 : t + 1 + n_keep] for t in range(L)], axis=1)
        self._steps = [windows, states]

    def record_steps(self, steps: List[mx.array]):
        """Every slot's value after each position: one [B, L, ...] array per slot."""
        self._steps = list(steps)

    def commit(self, counts: mx.array):
        """Keep each row's state after `counts[b]` positions of the captured forward."""
        if self._steps is None:
            return
        for i, steps in enumerate(self._steps):
            B = steps.shape[0]
            at = mx.maximum(counts - 1, 0).reshape((B,) + (1,) * (steps.ndim - 1))
            chosen = mx.take_along_axis(steps, at, axis=1).squeeze(1)
            prev = self.cache[i]
            if prev is not None:
                chosen = mx.where((counts == 0).reshape((B,) + (1,) * (chosen.ndim - 1)), prev, chosen)
            self.cache[i] = chosen
        self._steps = None

    def state_arrays(self):
        return list(self.cache)

    def take_rows(self, idx: mx.array):
        self.cache = [c[idx] if c is not None else None for c in self.cache]

    def row_slice(self, row: int, length: int):
        """A copy of one row's state. Recurrent state exists only after the row's last token: it
        cannot be cut back to an earlier `length` (copy it when the row is at that length)."""
        if length != int(self.rows.host[row]):
            raise ValueError(f"recurrent state of row {row} is at position {int(self.rows.host[row])}, not {length}: "
                             "snapshot it when the row is at that length")
        return [mx.array(c[row : row + 1]) if c is not None else None for c in self.cache]

    def write_row(self, row: int, arrays, batch: int):
        for i, a in enumerate(arrays):
            if a is None:  # no state yet (no tokens): mlx-lm's layers start from zeros
                if self.cache[i] is not None:
                    self.cache[i][row : row + 1] = 0
                continue
            if self.cache[i] is None:
                self.cache[i] = mx.zeros((batch,) + a.shape[1:], a.dtype)
            self.cache[i][row : row + 1] = a

    def put_rows(self, slots: Sequence[int], src: "RowStateCache", rows: Sequence[int], length: int, batch: int,
                 reserve: int = 0):
        """Rows `rows` of `src` (their state now) at `slots`."""
        at = _slot_index(slots)
        for i, a in enumerate(src.cache):
            if a is None:  # no state yet: zeros, not what a slot's last row left there
                if self.cache[i] is not None:
                    self.cache[i][at] = 0
                continue
            if self.cache[i] is None:
                self.cache[i] = mx.zeros((batch,) + a.shape[1:], a.dtype)
            self.cache[i][at] = _take_rows(a, rows)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)


class RowCacheList:
    """mlx-lm's CacheList (several caches for one layer, e.g. falcon_h1's mamba + attention)."""

    def __init__(self, caches):
        self.caches = list(caches)

    def __getitem__(self, i):
        return self.caches[i]

    def __len__(self):
        return len(self.caches)


# Layer kinds: "kv" (attention), "state<n>" (recurrent, n slots; plain "state" is 2), or a tuple
# of those (a CacheList).
def state_size(kind: str) -> int:
    return int(kind[len("state"):] or 2)


def flat_kinds(kinds) -> List[str]:
    return [k for kind in kinds for k in (kind if isinstance(kind, tuple) else (kind,))]


def new_leaf(kind: str, rows: RowLengths):
    return RowKVCache(rows) if kind == "kv" else RowStateCache(rows, state_size(kind))


class CacheRow(NamedTuple):
    """One row of a batch cache, by reference: where a prefilled row waits until it is placed."""

    cache: "BatchCache"
    row: int


class BatchCache:
    """All layers' caches for a batch of rows, plus their shared per-row lengths. `layers` is what
    the model reads (a RowCacheList where mlx-lm has a CacheList); `leaves` are the caches, flat."""

    def __init__(self, layer_kinds: Sequence, lengths: Sequence[int] = (), rows: Optional[RowLengths] = None):
        self.rows = RowLengths(lengths) if rows is None else rows
        self.kinds = list(layer_kinds)
        self.leaves = [new_leaf(k, self.rows) for k in flat_kinds(self.kinds)]
        self.layers = self.leaves
        if any(isinstance(k, tuple) for k in self.kinds):
            it = iter(self.leaves)
            self.layers = [RowCacheList([next(it) for _ in k]) if isinstance(k, tuple) else next(it) for k in self.kinds]

    @classmethod
    def for_model(cls, model, batch: int = 1) -> "BatchCache":
        return cls(layer_kinds(model), [0] * batch)

    @property
    def batch(self) -> int:
        return int(self.rows.host.size)

    @property
    def lengths(self) -> np.ndarray:
        return self.rows.host

    def set_capturing(self, on: bool):
        for c in self.leaves:
            if isinstance(c, RowStateCache):
                c.capturing = on

    def commit(self, counts: np.ndarray):
        """Advance each row by counts[b] tokens of the last forward."""
        counts = np.asarray(counts, dtype=np.int64)
        self.advance(mx.array(counts, dtype=mx.int32), counts, exact=True)

    def advance(self, counts: mx.array, most: np.ndarray, exact: bool = False, after: Optional[mx.array] = None):
        """`commit` with device counts the host does not read: its lengths become upper bounds
        (`most` per row) until `rows.correct` / `rows.settle` (RowLengths). `after`: the device
        lengths plus `counts`, where a program computed them already."""
        for c in self.leaves:
            if isinstance(c, RowStateCache):
                c.commit(counts)
        self.rows.advance(counts, most, exact, after)

    def take_rows(self, keep: Sequence[int]):
        idx = mx.array(np.asarray(keep, dtype=np.int32))
        for c in self.leaves:
            c.take_rows(idx)
        self.rows.set(self.rows.host[np.asarray(keep, dtype=np.int64)])

    def snapshot_row(self, row: int, length: Optional[int] = None):
        """A copy of one row's state (its first `length` entries): a prefix to reuse later."""
        n = int(self.rows.host[row]) if length is None else length
        return n, [c.row_slice(row, n) for c in self.leaves]

    def write_row(self, row: int, snapshot):
        n, parts = snapshot
        for c, p in zip(self.leaves, parts):
            c.write_row(row, p, self.batch)
        self.rows.place([row], [n])

    def put_rows(self, slots: Sequence[int], refs: Sequence[CacheRow], reserve: int = 0):
        """Place the rows `refs` at `slots`, each with its length: per source cache and layer one
        gather and one write (not one copy per row). `reserve`: capacity to make room for."""
        groups = {}
        for slot, (src, row) in zip(slots, refs):
            groups.setdefault(id(src), (src, [], []))
            groups[id(src)][1].append(slot)
            groups[id(src)][2].append(row)
        for src, to, rows in groups.values():
            length = int(src.rows.host[rows].max())
            for leaf, src_leaf in zip(self.leaves, src.leaves):
                leaf.put_rows(to, src_leaf, rows, length, self.batch, reserve)
        self.rows.place(list(slots), [int(src.rows.host[row]) for src, row in refs])

    @classmethod
    def gather(cls, refs: Sequence[CacheRow], reserve: int = 0) -> "BatchCache":
        """A new batch cache of the rows `refs`, with room for one more token each, or `reserve`."""
        out = cls(refs[0].cache.kinds, [0] * len(refs))
        reserve = max([reserve] + [int(src.rows.host[row]) + 1 for src, row in refs])
        out.put_rows(range(len(refs)), refs, reserve)
        return out

    @classmethod
    def stack(cls, caches: List["BatchCache"]) -> "BatchCache":
        """One batch cache from single-row caches."""
        return cls.gather([CacheRow(c, 0) for c in caches])

    def extend(self, other: "BatchCache"):
        """Append the rows of `other` (copies both caches: used only while a batch ramps up)."""
        merged = BatchCache.gather([CacheRow(self, i) for i in range(self.batch)] +
                                   [CacheRow(other, i) for i in range(other.batch)])
        self.rows, self.leaves, self.layers = merged.rows, merged.leaves, merged.layers

    def eval(self):
        mx.eval([a for c in self.leaves for a in c.state_arrays() if a is not None])

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.leaves)

    def row_bytes(self) -> Tuple[float, float]:
        """(bytes per entry of capacity, bytes of state) of one of its rows: what one more row costs."""
        per_entry = sum(c.nbytes / c.keys.shape[2] for c in self.leaves if isinstance(c, RowKVCache) and c.keys is not None)
        state = sum(c.nbytes for c in self.leaves if not isinstance(c, RowKVCache))
        return per_entry / self.batch, state / self.batch


def layer_kinds(model) -> List:
    """Each cache's kind, from mlx-lm's `make_cache`: KVCache and RotatingKVCache -> "kv" (every entry
    is kept and the window mask hides what falls out, so rollback stays an index move); ArraysCache of
    n slots -> "state<n>"; CacheList -> a tuple. Any other cache class is refused: it could give
    wrong text without an error."""
    if not hasattr(model, "make_cache"):
        return ["kv"] * len(model.layers)
    return [_kind(c, model) for c in model.make_cache()]


def _kind(c, model):
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    if type(c) is KVCache or (type(c) is RotatingKVCache and c.keep == 0):
        return "kv"
    if isinstance(c, ArraysCache) and type(c).__name__ in ("ArraysCache", "MambaCache"):
        return "state" if len(c.cache) == 2 else f"state{len(c.cache)}"
    if type(c) is CacheList:
        return tuple(_kind(sub, model) for sub in c.caches)
    arch = getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]
    detail = f" (keep={c.keep})" if isinstance(c, RotatingKVCache) else ""
    raise UnsupportedArchitecture(
        f"architecture {arch!r}: cache type {type(c).__name__}{detail} is not supported by the batched "
        "engine, so the model is refused rather than run (it could give wrong text): use mlx-lm directly, "
        "or file an issue naming the architecture")


class UnsupportedArchitecture(ValueError):
    """A model whose layer or cache kind the engine does not know: refused before any row runs."""

    exit_code = 2  # like an invalid job: the model, not the run, is the problem
