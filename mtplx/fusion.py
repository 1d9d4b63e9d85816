"""Sibling projections (q/k/v, gate/up) as one matmul at one row, a load-time model transform.

A one-token decode step at one stream reads every weight once; q_proj, k_proj and v_proj (and
gate_proj, up_proj) read the same input, so one matrix-vector product over their stacked weights
does the work of three (two) with fewer, larger kernels. The model's own forward is kept: each
projection is replaced by a part that, for the first sibling called on an input, computes the
stacked product and hands each sibling its slice. A row of a matrix-vector product does not
depend on the other rows (MLX's gemv gives each output row its own warp), so the values are
the ones the separate products give (checked on the H200 by benchmarks/decode_anatomy's token
comparison); with more than one row (prefill, a wide batch) each part
multiplies by its own rows of the stacked weight (a view: the same values and layout as before).
The stacked weight replaces the originals, so memory does not grow once the originals are freed.

The engine stacks them where its decode steps are compiled on CUDA (`decode_paths`); there the
graph has no per-projection overhead left to pay for the slices, and eagerly it measured slower.
`fuse_projections(model)` stacks them; `unstack(model)` puts the layers back (views of the stacked
arrays: no copy). Quantized layers
stack the same way (packed weights, scales and biases are all indexed by output row).
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import layer_kernels, qmm_rows, rows_attention, skinny_matmul
from .qmm_rows import QMV_ROWS


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# the groups by a short name (benchmarks/decode_anatomy stacks one kind at a time)
NAMED = {"qkv": GROUPS[0], "mlp": GROUPS[1]}
DECODE_GROUPS = GROUPS  # what the engine stacks for compiled CUDA decoding (decode_paths)


def _like(layer: nn.Module, arrays) -> nn.Module:
    """A copy of `layer` (its class and settings: bits, group size, mode) holding `arrays`."""
    new = copy.copy(layer)
    for k, a in arrays.items():
        new[k] = a
    return new


class _Stacked:
    """Sibling layers as one layer of the same kind over their stacked arrays (weight, and for a
    quantized layer scales and biases: all indexed by output row first), each sibling's own layer
    as a view of its rows, and the last one-row product, shared by the siblings' parts."""

    def __init__(self, layers: Sequence[nn.Module]):
        keys = [k for k, v in layers[0].items() if isinstance(v, mx.array)]
        self.layer = _like(layers[0], {k: mx.concatenate([m[k] for m in layers], axis=0) for k in keys})
        sizes = [m["weight"].shape[0] for m in layers]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.spans = list(zip(bounds[:-1], bounds[1:]))
        self.views = [_like(layers[0], {k: self.layer[k][a:b] for k in keys}) for a, b in self.spans]
        # rows whose stacked product gives each sibling the bits of its own: see `few_rows`
        self.few_rows = few_rows(self.layer)
        self.whole = False  # the stacked product taken past QMV_ROWS rows too (qmm_rows: quantized, on CUDA)
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
        rows = x.size // x.shape[-1]
        if rows > (st.few_rows if STACK_FEW_ROWS else 1) and not qmm_rows.whole(st, x):
            return st.views[self._index](x)  # more rows: each sibling's own product
        return st.part(x, self._index)


# few-row products stacked where `few_rows` allows (read when a program is traced); benchmarks turn it off
# for one engine's warm-up (round_trace `:mtplx.fusion.STACK_FEW_ROWS=0`) to measure the path before
STACK_FEW_ROWS = True


def few_rows(layer) -> int:
    """Up to how many rows (the product's M) a stacked product keeps each sibling's values: one row
    for every layer (a row of a vector product does not depend on the others); up to QMV_ROWS for a
    quantized layer under MLX's CUDA qmv, which gives each output row of each of the M rows its own
    warp whatever N is (quantized.cpp: below 8 rows qmv, unless the layer is one qmm_sm90 takes,
    a group as long as the input). So a verify of up to 7 tokens a row at one stream stacks too.
    Up to GEMV_ROWS for a RowsLinear (its few rows are vector products each)."""
    if isinstance(layer, RowsLinear):
        return GEMV_ROWS if layer.weight.nbytes <= GEMV_MAX_BYTES else 1
    if isinstance(layer, nn.QuantizedLinear) and rows_attention.cuda_ready() and layer.group_size < layer.weight.shape[1] * 32 // layer.bits:
        return QMV_ROWS
    return 1


def _settings(m) -> tuple:
    return (type(m), m["weight"].shape[1], m["weight"].dtype, getattr(m, "group_size", None), getattr(m, "bits", None),
            getattr(m, "mode", None))


def _fusable(layers) -> bool:
    return (all(type(m) in (nn.Linear, nn.QuantizedLinear, RowsLinear) and "bias" not in m for m in layers)
            and len({_settings(m) for m in layers}) == 1)


def fuse_projections(model, groups: Sequence[Sequence[str]] = GROUPS) -> int:
    """Replace each bias-free group of `groups` in `model` (plain or quantized Linear layers of one
    kind) by StackedParts (a group already stacked is left alone); returns how many parts. Each
    group's originals are dropped as it is stacked, so memory grows by one group at most."""
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
    """Undo `fuse_projections` without its undo function: each part becomes its own layer again
    (a view of its rows of the stacked arrays: no copy). Returns how many parts."""
    n = 0
    for _, module in list(model.named_modules()):
        for name in list(module.keys()):
            part = module[name]
            if isinstance(part, StackedPart):
                module[name] = part._stacked[0].views[part._index]
                n += 1
    return n


# the MTP head's blocks quantized where the trunk is (quantize_head), read when the Engine is made (round_trace
# `:mtplx.fusion.QUANTIZE_HEAD=1`). Off: on the H200 (session 8, final window) it ran 1.43x plain against 1.38x off at
# one stream (faster in 7 of 7 interleaved repeats), but a fresh host built ~60 s of new kernels, and adaptive depth's
# catch-up of the head over 8+ tokens meets 8-bit qmm kernels no warm-up built (a measured run at 278 ms a round)
QUANTIZE_HEAD = False
HEAD_BITS, HEAD_GROUP = 8, 64


def quantize_head(head, trunk) -> int:
    """Quantize the Linear layers of the MTP head's blocks (HEAD_BITS, HEAD_GROUP) where the trunk's
    are quantized: on CUDA a float product of the commit's few rows (the verified tokens) is a cuBLAS
    GEMM that MLX records by stream capture, a child graph of its own each (H200, window 1: ~11 a
    one-stream round), where a quantized one is the trunk's qmv kernel, a plain graph node. Drafts
    change by the rounding, the output does not (verification is exact). fc stays as it is: draft steps
    read its embedding half off DraftVocab.step_table. Returns how many layers."""
    if not QUANTIZE_HEAD or not any(isinstance(m, nn.QuantizedLinear) for _, m in trunk.named_modules()):
        return 0
    count = [0]

    def pick(path, m):
        ok = type(m) is nn.Linear and path.startswith("layers") and m.weight.shape[1] % HEAD_GROUP == 0
        count[0] += ok
        return ok

    nn.quantize(head, group_size=HEAD_GROUP, bits=HEAD_BITS, class_predicate=pick)
    return count[0]


# the MTP head's float products over a few rows as MLX's matrix-vector kernel (RowsLinear), read when the
# Engine is made (round_trace `:mtplx.fusion.HEAD_GEMV=0` measures without)
# On: H200, session 9 window 1 (with rows_attention.STRIDED): 1.65x plain against 1.47x at one stream; the trace: no
# cuBLAS GEMM a round (10.6 before), child graphs 12.5 -> 1.9, graph destroys 17.4 -> 6.8 a round
HEAD_GEMV = True
GEMV_ROWS = 8  # a commit of up to 8 verified tokens (depth 7) at one stream
# a weight the vector kernel reads once a row: only where it stays in the GPU's L2 cache (H200: 50 MB) between
# rows; larger (an 8B model's head) is read once by the GEMM
GEMV_MAX_BYTES = 16 << 20


class RowsLinear(nn.Linear):
    """A float Linear whose product over 2..GEMV_ROWS rows is MLX's matrix-vector kernel over a batch of
    vectors (W @ x[..., None]) instead of a GEMM. On CUDA MLX takes cuBLAS for a product of several rows,
    which its CUDA graphs record by stream capture, a child graph each (H200, session 8: ~11 a one-stream
    MTP round, the head's commit over the verified tokens), where the batched gemv is one plain node. A
    warp per output row, as the one-row product (gemv) computes it: each row gets the bits a one-row product
    of it gives, so a stacked product (few_rows) keeps each sibling's values. Past GEMV_ROWS (wide
    batches, prefill) and at one row it is nn.Linear's product."""

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        if rows == 1 or rows > GEMV_ROWS or "bias" in self or self.weight.nbytes > GEMV_MAX_BYTES:
            return super().__call__(x)
        return (self.weight @ x[..., None]).squeeze(-1)


def head_gemv(head, vocab=None) -> int:
    """Make the float Linear layers of the MTP head's blocks and its fc RowsLinear (HEAD_GEMV; before
    fuse_projections, whose stacked layers keep the class), and the drafting vocabulary's projection
    (mtp_draft.DraftVocab) a matrix-vector product at one row. Returns how many layers."""
    if not HEAD_GEMV:
        return 0
    if vocab is not None:
        vocab.as_vector_product()
    n = 0
    for path, m in head.named_modules():
        if type(m) is nn.Linear and "bias" not in m and (path.startswith("layers") or path == "fc"):
            m.__class__ = RowsLinear
            n += 1
    return n


def stacking_pays() -> bool:
    """Stacked projections measured faster only in compiled CUDA decode steps (BENCHMARKS.md, h22d)."""
    return rows_attention.cuda_ready()


def decode_paths(model, compiled: bool, stack: bool = True, rows: bool = True, skinny: bool = False,
                 layer: bool = False, mlp: bool = False, o_norm: bool = False) -> dict:
    """The engine's CUDA decode paths: per-row attention for masked attention (rows_attention.py)
    and, when decode steps are compiled, stacked projections and (`skinny`) the few-row matmul kernel
    (skinny_matmul.py); quantized products of many rows as one matrix, stacked siblings' whole (qmm_rows.py,
    on CUDA whether compiled or not); (`layer`) a layer's small ops as fewer kernels (layer_kernels.py); (`mlp`) the
    stacked gate/up product and its SwiGLU as one kernel at one row (mlp_kernel.py); (`o_norm`, with
    `layer`) o_proj, the residual add and the norm as one kernel at one row (o_norm_kernel.py). All but the
    skinny kernel keep the values exactly, the kernel keeps each row's value whatever the row
    count; off CUDA nothing changes. Returns what was installed (counts)."""
    from . import mlp_kernel  # (it builds on this module's stacked parts)

    return {"rows_attention": rows_attention.install(model) if rows else 0,
            "stacked_projections": fuse_projections(model, DECODE_GROUPS) if stack and compiled and stacking_pays() else 0,
            # quantized products of many rows as one matrix, stacked ones whole (qmm_rows; after the stacking)
            "quantized_rows": qmm_rows.install(model) if qmm_rows.pays() else 0,
            "skinny_matmul": skinny_matmul.install(model) if skinny and compiled else 0,
            "layer_kernels": layer_kernels.install(model, o_norm=o_norm) if layer else 0,
            "o_norm_kernel": int(o_norm and layer and layer_kernels._State.o_norm),
            # the stacked MLPs only; for o_norm alone with MLX's ops (it hands o_norm its down_proj's input)
            "mlp_kernel": mlp_kernel.install(model, reference=not mlp) if (mlp or o_norm) and compiled
            and mlp_kernel.cuda_ready() and (mlp or layer_kernels._State.o_norm) else 0}
