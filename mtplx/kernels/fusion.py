"""Sibling projections (q/k/v, gate/up) as one product at a few rows, a load-time model transform.

One matrix-vector product over the stacked weights replaces three (two) kernels, with the separate
products' values. `head_gemv` makes the MTP head's few-row products vector products: plain CUDA graph
nodes, not cuBLAS child graphs (1.65x against 1.47x plain decoding at one stream, H200)."""

from __future__ import annotations

import copy
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from .device import cuda_ready

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
QMV_ROWS = 7  # MLX CUDA's quantized matmul runs its vector kernel (qmv) below 8 rows (quantized.cpp)
GEMV_ROWS = 8  # a commit of up to 8 verified tokens (depth 7) at one stream
GEMV_MAX_BYTES = 16 << 20  # the vector kernel reads the weight once a row: it pays while it stays in L2


def stacking_pays() -> bool:
    """Stacked projections measured faster only in compiled CUDA decode steps (eagerly: slower)."""
    return cuda_ready()


def _like(layer: nn.Module, arrays) -> nn.Module:
    new = copy.copy(layer)
    for k, a in arrays.items():
        new[k] = a
    return new


class _Stacked:
    """Sibling layers as one stacked layer, a view per sibling, and the last product they share."""

    def __init__(self, layers: Sequence[nn.Module]):
        keys = [k for k, v in layers[0].items() if isinstance(v, mx.array)]
        self.layer = _like(layers[0], {k: mx.concatenate([m[k] for m in layers], axis=0) for k in keys})
        sizes = [m["weight"].shape[0] for m in layers]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.spans = list(zip(bounds[:-1], bounds[1:]))
        self.views = [_like(layers[0], {k: self.layer[k][a:b] for k in keys}) for a, b in self.spans]
        self.few_rows = few_rows(self.layer)
        self._x, self._parts, self._left = None, [], 0  # the last input, its parts, the parts not yet taken

    def part(self, x: mx.array, i: int) -> mx.array:
        if self._x is not x or self._left == 0:
            y = self.layer(x)
            self._parts = [y[..., a:b] for a, b in self.spans]
            self._x, self._left = x, len(self._parts)
        out = self._parts[i]
        self._left -= 1
        if self._left == 0:
            self._x, self._parts = None, []
        return out


class StackedPart(nn.Module):
    """One sibling projection; the first owns the stacked layer (so the parameter bytes are unchanged)."""

    def __init__(self, stacked: _Stacked, index: int):
        super().__init__()
        if index == 0:
            self.stacked = stacked.layer
        self._stacked = [stacked]  # a list: not a child module
        self._index = index

    def __call__(self, x):
        st = self._stacked[0]
        if x.size // x.shape[-1] > st.few_rows:
            return st.views[self._index](x)
        return st.part(x, self._index)


def few_rows(layer) -> int:
    """Up to how many rows a stacked product keeps each sibling's values: QMV_ROWS under MLX's CUDA qmv
    (unless qmm_sm90 takes a group as long as the input), GEMV_ROWS for a RowsLinear, else one."""
    if isinstance(layer, RowsLinear):
        return GEMV_ROWS if layer.weight.nbytes <= GEMV_MAX_BYTES else 1
    if isinstance(layer, nn.QuantizedLinear) and cuda_ready() and layer.group_size < layer.weight.shape[1] * 32 // layer.bits:
        return QMV_ROWS
    return 1


def _fusable(layers) -> bool:
    if not all(type(m) in (nn.Linear, nn.QuantizedLinear, RowsLinear) and "bias" not in m for m in layers):
        return False
    return len({(type(m), m["weight"].shape[1], m["weight"].dtype, getattr(m, "group_size", None),
                 getattr(m, "bits", None), getattr(m, "mode", None)) for m in layers}) == 1


def fuse_projections(model, groups: Sequence[Sequence[str]] = GROUPS) -> int:
    n = 0
    for _, module in list(model.named_modules()):
        for names in groups:
            if not all(k in module for k in names):
                continue
            layers = [module[k] for k in names]
            if not _fusable(layers):
                continue
            stacked = _Stacked(layers)
            mx.eval(stacked.layer.parameters())
            for i, k in enumerate(names):
                module[k] = StackedPart(stacked, i)
            n += len(names)
    return n


def unstack(model) -> int:
    """Undo `fuse_projections` (each part becomes its view, no copy); returns how many parts."""
    n = 0
    for _, module in list(model.named_modules()):
        for name in list(module.keys()):
            part = module[name]
            if isinstance(part, StackedPart):
                module[name] = part._stacked[0].views[part._index]
                n += 1
    return n


class RowsLinear(nn.Linear):
    """A float Linear whose product over 2..GEMV_ROWS rows is matrix-vector products, not a GEMM."""

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        if rows == 1 or rows > GEMV_ROWS or "bias" in self or self.weight.nbytes > GEMV_MAX_BYTES:
            return super().__call__(x)
        return (self.weight @ x[..., None]).squeeze(-1)


def head_gemv(head, vocab=None) -> int:
    if vocab is not None:
        vocab.as_vector_product()
    n = 0
    for path, m in head.named_modules():
        if type(m) is nn.Linear and "bias" not in m and (path.startswith("layers") or path == "fc"):
            m.__class__ = RowsLinear
            n += 1
    return n
