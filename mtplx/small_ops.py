"""The small index arrays of a round as fewer device kernels (a one-stream round is host-bound: each
kernel it hands the device costs the host ~5-7 us on the H200, whatever it computes).

Inside a compiled program `mx.arange(n)` is a kernel at every call (MLX does not fold constants), and
`mx.concatenate` / `mx.stack` of a few columns is a copy kernel per part. Here a range is a constant
array made once (a compiled program captures it: no kernel), and a few [W] columns become [W, n] as a
chain of selects over that range, which compile fuses into one kernel; a row's lengths are padded out of
MLX's managed pool by one gather by a constant index (`pad_index`, rows_attention.padded), and the greedy
acceptance casts only the next token (sampling.accept_greedy). The values are the same. `FEWER` switches
all of it (read when a program is traced; round_trace `:mtplx.small_ops.FEWER=0`).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

FEWER = True
_ranges = {}


def _constant(key, values: np.ndarray, dtype=mx.int32) -> mx.array:
    """`values` as a device array made once per key; one of at most 8 bytes is a view of a longer one
    (MLX keeps arrays of <= 8 bytes in a managed pool the host touches: rows_attention.SMALL_POOL_BYTES)."""
    if key not in _ranges:
        n = len(values)
        longer = np.concatenate([values, np.zeros(max(0, 3 - n), values.dtype)])
        _ranges[key] = mx.array(longer, dtype=dtype)[:n]
        mx.eval(_ranges[key])  # (a constant, not a slice a program would trace)
    return _ranges[key]


def arange(n: int, dtype=mx.int32) -> mx.array:
    """mx.arange(n, dtype=dtype): with FEWER a constant made once per (n, dtype)."""
    if not FEWER:
        return mx.arange(n, dtype=dtype)
    return _constant((n, dtype), np.arange(n), dtype)


def pad_index(size: int, n: int) -> mx.array:
    """The constant [0, 1, .., size - 1, 0, .., 0] of n entries (int32): taking it pads an array of `size`
    to n with copies of its first element, in one gather."""
    return _constant(("pad", size, n), np.concatenate([np.arange(size), np.zeros(n - size, np.int64)]))


def columns(cols: Sequence[mx.array]) -> mx.array:
    """[W] arrays -> [W, len(cols)], column j cols[j] (mx.stack(cols, axis=1), dtypes promoted as it does)."""
    if not FEWER or len(cols) == 1:
        return mx.stack(cols, axis=1)
    at = arange(len(cols))[None]
    out = cols[-1][:, None]
    for j in range(len(cols) - 2, -1, -1):
        out = mx.where(at == j, cols[j][:, None], out)
    return out


def rows_of(a: mx.array) -> list:
    """The columns of a [W, n] array, as views ([W] each), for `columns`."""
    return [a[:, j] for j in range(a.shape[1])]


def joined(first: Sequence[mx.array], rest: mx.array) -> mx.array:
    """mx.concatenate([c[:, None] for c in first] + [rest], axis=1) for [W] columns `first` and [W, n]
    `rest`: with FEWER one fused select, not a copy kernel per part."""
    if not FEWER:
        return mx.concatenate([c[:, None] for c in first] + [rest], axis=1)
    return columns(list(first) + rows_of(rest))
