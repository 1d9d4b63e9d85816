"""Small device arrays where kernels read them well: the one module of this package the core imports.

MLX's CUDA allocator serves arrays of at most SMALL_POOL_BYTES from managed memory the host also
touches, so a kernel reading one waits on a page fault (an add + norm reading its eps: 8.1 us against
3.1 on the H200). On CUDA the small arrays kernels read are therefore made larger."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

SMALL_POOL_BYTES = 8
_constants = {}


@functools.cache
def cuda_ready() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and mx.default_device() == mx.gpu)


def pads() -> bool:
    """Whether small arrays are padded out of the pool (only CUDA has one)."""
    return cuda_ready()


def _past_pool(dtype) -> int:  # elements of `dtype` that make an array too large for the pool
    return -(-(SMALL_POOL_BYTES + 1) // dtype.size)


def constant(key, values: np.ndarray) -> mx.array:
    """`values` as an int32 device array made once per `key`: a view of an array too long for the pool."""
    if key not in _constants:
        n = len(values)
        longer = np.concatenate([values, np.zeros(max(0, _past_pool(mx.int32) - n), values.dtype)])
        _constants[key] = mx.array(longer, dtype=mx.int32)[:n]
        mx.eval(_constants[key])  # (a constant, not a slice a program would trace)
    return _constants[key]


def resident_constant(values, dtype=mx.float32) -> mx.array:
    """`values` as a device array, zero-padded out of the pool where `pads()`."""
    pad = max(0, _past_pool(dtype) - len(values)) if pads() else 0
    return mx.array(list(values) + [0] * pad, dtype=dtype)


def padded(a: mx.array):
    """A copy of 1-D `a` too large for the pool (one gather), or None where `a` needs none."""
    if not pads() or a.nbytes > SMALL_POOL_BYTES or a.ndim != 1:
        return None
    n = _past_pool(a.dtype)
    index = constant(("pad", a.size, n), np.concatenate([np.arange(a.size), np.zeros(n - a.size, np.int64)]))
    return mx.take(a, index)
