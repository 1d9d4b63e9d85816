"""The small index arrays of a round as fewer device kernels (a one-stream round is host-bound: each
kernel costs the host ~5-7 us on the H200). A range is a constant made once (captured: no kernel), and
a few [W] columns become [W, n] as a chain of selects over it, which compile fuses into one kernel.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from .kernels.device import constant


def arange(n: int) -> mx.array:
    """mx.arange(n, dtype=mx.int32), made once per n."""
    return constant(("arange", n), np.arange(n))


def columns(cols: Sequence[mx.array]) -> mx.array:
    """[W] arrays -> [W, len(cols)], column j cols[j] (mx.stack(cols, axis=1), dtypes promoted as it does)."""
    if len(cols) == 1:
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
    `rest`, as one fused select."""
    return columns(list(first) + rows_of(rest))
