"""Sibling projections (q/k/v, gate/up) as one product at a few rows, a load-time model transform.

q_proj, k_proj and v_proj (gate_proj, up_proj) read the same input: at a decode step one matrix-vector
product over their stacked weights does the work of three (two) in fewer kernels. The first sibling
called on an input computes the stacked product and each takes its slice; past `few_rows` rows each
multiplies by its own rows of the stacked weight (a view). A row of a matrix-vector product does not
depend on the others (a warp per output row): the values are the separate products'. The stacked arrays
(quantized ones too) replace the originals. The engine stacks where its decode steps are compiled on CUDA
(`stacking_pays`; eagerly it measured slower); `unstack(model)` puts the layers back (views: no copy).

On CUDA MLX takes cuBLAS for a float product of several rows, which its CUDA graphs record by stream
capture, a child graph each (~11 a one-stream MTP round on the H200: the head's commit over the verified
tokens); `head_gemv` makes the MTP head's products of a few rows matrix-vector products (`RowsLinear`),
one plain graph node each (1.65x plain against 1.47x at one stream, with rows_attention's strided kernel).
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import mlx.core as mx
import mlx.nn as nn

from .device import cuda_ready

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
QMV_ROWS = 7  # MLX CUDA's quantized matmul runs its vector kernel (qmv) below 8 rows (quantized.cpp)
GEMV_ROWS = 8  # a commit of up to 8 verified tokens (depth 7) at one stream
# a weight the vector kernel reads once a row: only where it stays in the GPU's L2 cache (H200: 50 MB) between
# rows; larger (an 8B model's head) is read once by the GEMM
GEMV_MAX_BYTES = 16 << 20


def stacking_pays() -> bool:
    """Stacked projections measured faster only in compiled CUDA decode steps."""
    return cuda_ready()


def _like(layer: nn.Module, arrays) -> nn.Module:
    """A copy of `layer` (its class and settings: bits, group size, mode) holding `arrays`."""
    new = copy.copy(layer)
    for k, a in arrays.items():
        new[k] = a
    return new


class _Stacked:
    """Sibling layers as one layer of the same kind over their stacked arrays, each sibling's own layer as
    a view of its rows, and the last stacked product, shared by the siblings' parts."""

    def __init__(self, layers: Sequence[nn.Module]):
        keys = [k for k, v in layers[0].items() if isinstance(v, mx.array)]
        self.layer = _like(layers[0], {k: mx.concatenate([m[k] for m in layers], axis=0) for k in keys})
        sizes = [m["weight"].shape[0] for m in layers]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.spans = list(zip(bounds[:-1], bounds[1:]))
        self.views = [_like(layers[0], {k: self.layer[k][a:b] for k in keys}) for a, b in self.spans]
        self.few_rows = few_rows(self.layer)
        self._x = None
        self._parts: List[mx.array] = []
        self._left = 0

    def part(self, x: mx.array, i: int) -> mx.array:
        if self._x is not x or self._left == 0:
            y = self.layer(x)
            self._parts = [y[..., a:b] for a, b in self.spans]
            self._x, self._left = x, len(self._parts)
        out = self._parts[i]
        self._left -= 1
        if self._left == 0:  # every sibling has its slice: drop the references
            self._x, self._parts = None, []
        return out


class StackedPart(nn.Module):
    """One sibling projection. The first holds the stacked layer as its child `stacked` (so the
    model's parameter bytes are unchanged); the others hold no parameters."""

    def __init__(self, stacked: _Stacked, index: int):
        super().__init__()
        if index == 0:
            self.stacked = stacked.layer
        self._stacked = [stacked]  # a list: a plain attribute, not a child module or parameter
        self._index = index

    def __call__(self, x):
        st = self._stacked[0]
        if x.size // x.shape[-1] > st.few_rows:
            return st.views[self._index](x)  # more rows: each sibling's own product
        return st.part(x, self._index)


def few_rows(layer) -> int:
    """Up to how many rows (the product's M) a stacked product keeps each sibling's values: one for every
    layer; QMV_ROWS for a quantized layer under MLX's CUDA qmv, a warp per output row of each row whatever N
    is (unless qmm_sm90 takes it: a group as long as the input), so a one-stream verify of up to 7 tokens
    stacks too; GEMV_ROWS for a RowsLinear (a vector product a row)."""
    if isinstance(layer, RowsLinear):
        return GEMV_ROWS if layer.weight.nbytes <= GEMV_MAX_BYTES else 1
    if isinstance(layer, nn.QuantizedLinear) and cuda_ready() and layer.group_size < layer.weight.shape[1] * 32 // layer.bits:
        return QMV_ROWS
    return 1


def _settings(m) -> tuple:
    return (type(m), m["weight"].shape[1], m["weight"].dtype, getattr(m, "group_size", None), getattr(m, "bits", None),
            getattr(m, "mode", None))


def _fusable(layers) -> bool:
    return (all(type(m) in (nn.Linear, nn.QuantizedLinear, RowsLinear) and "bias" not in m for m in layers)
            and len({_settings(m) for m in layers}) == 1)


def fuse_projections(model, groups: Sequence[Sequence[str]] = GROUPS) -> int:
    """Replace each bias-free group of `groups` in `model` (Linear layers of one kind, plain or quantized)
    by StackedParts; returns how many parts. Memory grows by one group at most (its originals are dropped)."""
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
    """Undo `fuse_projections`: each part becomes its own layer again (a view of its rows of the
    stacked arrays: no copy). Returns how many parts."""
    n = 0
    for _, module in list(model.named_modules()):
        for name in list(module.keys()):
            part = module[name]
            if isinstance(part, StackedPart):
                module[name] = part._stacked[0].views[part._index]
                n += 1
    return n


class RowsLinear(nn.Linear):
    """A float Linear whose product over 2..GEMV_ROWS rows is MLX's matrix-vector kernel over a batch of
    vectors (W @ x[..., None]), not a GEMM: each row the bits of its one-row product (gemv). Past GEMV_ROWS
    and at one row it is nn.Linear's product."""

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        if rows == 1 or rows > GEMV_ROWS or "bias" in self or self.weight.nbytes > GEMV_MAX_BYTES:
            return super().__call__(x)
        return (self.weight @ x[..., None]).squeeze(-1)


def head_gemv(head, vocab=None) -> int:
    """Make the MTP head's float Linear layers (its blocks' and fc) RowsLinear, before fuse_projections (whose
    stacked layers keep the class), and the drafting vocabulary's projection (drafting.mtp_bank.DraftVocab) a
    matrix-vector product at one row. Returns how many layers."""
    if vocab is not None:
        vocab.as_vector_product()
    n = 0
    for path, m in head.named_modules():
        if type(m) is nn.Linear and "bias" not in m and (path.startswith("layers") or path == "fc"):
            m.__class__ = RowsLinear
            n += 1
    return n
