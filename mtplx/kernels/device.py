"""Small device arrays where kernels read them well: the one module of this package the core imports.

MLX's CUDA allocator gives arrays of at most SMALL_POOL_BYTES (a scalar, one row's lengths) managed memory
from a small pool the host also touches (mlx/backend/cuda/allocator.cpp): a kernel reading one waits on a
page that is not on the GPU (on the H200 an add + norm kernel reading its eps so took 8.1 us against 3.1).
So on CUDA the small arrays kernels read are made larger (`resident_constant`, `padded`), and a constant
made once (`constant`) is a view of a longer array.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

SMALL_POOL_BYTES = 8
_constants = {}


@functools.cache
def cuda_ready() -> bool:
    """Whether arrays run on MLX's CUDA backend (the custom kernels' only home)."""
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and mx.default_device() == mx.gpu)


def pads() -> bool:
    """Whether small arrays are padded out of the pool: on CUDA (the CPU backend has no such pool)."""
    return cuda_ready()


def _past_pool(dtype) -> int:  # elements of `dtype` that make an array too large for the pool
    return -(-(SMALL_POOL_BYTES + 1) // dtype.size)


def constant(key, values: np.ndarray) -> mx.array:
    """`values` as an int32 device array made once per `key` (a compiled program captures it: no kernel a
    call); a short one is a view of a longer array, out of the pool."""
    if key not in _constants:
        n = len(values)
        longer = np.concatenate([values, np.zeros(max(0, _past_pool(mx.int32) - n), values.dtype)])
        _constants[key] = mx.array(longer, dtype=mx.int32)[:n]
        mx.eval(_constants[key])  # (a constant, not a slice a program would trace)
    return _constants[key]


def resident_constant(values, dtype=mx.float32) -> mx.array:
    """`values` (a sequence) as a device array, where `pads()` padded with zeros out of the pool (kernels
    read the first len(values) elements)."""
    pad = max(0, _past_pool(dtype) - len(values)) if pads() else 0
    return mx.array(list(values) + [0] * pad, dtype=dtype)


def padded(a: mx.array):
    """A copy of `a` (1-D) large enough to stay out of the pool, or None where `a` is out of it already (or
    `pads()` is false): its first a.size elements are `a`, then copies of a[0], in one gather by a constant
    index (a fill and two copies would be three kernels, and a round pads the lengths of each forward)."""
    if not pads() or a.nbytes > SMALL_POOL_BYTES or a.ndim != 1:
        return None
    n = _past_pool(a.dtype)
    index = constant(("pad", a.size, n), np.concatenate([np.arange(a.size), np.zeros(n - a.size, np.int64)]))
    return mx.take(a, index)
