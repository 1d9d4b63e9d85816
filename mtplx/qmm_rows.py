"""Quantized products of many rows as MLX CUDA runs them fast: one matrix of rows, stacked siblings whole.

MLX's CUDA quantized matmul (mlx/backend/cuda/quantized/quantized.cpp and qmm/qmm.cu, read at mlx v0.32.2,
846d176, the newest source we have; the 0.32.4 we run JIT-builds the same kernels: their sources sit in the
H200's kernel cache) picks its kernel by the product's rows and shape: below 8 rows (M x batch) qmv, a warp
per output; else qmm_sm80, the tensor-core kernel, where the output width N is a multiple of 128 and K of
max(64, group); else qmm_naive. Both qmm kernels take M = x.shape[-2] and run every other leading axis as
a batch of the grid: a width-32 plain step (x [32, 1, K]) and its depth-3 verify ([32, 4, K]) are 32
products of 1 and 4 rows, each in a tile of 16 (and more) rows, 32 x N / 128 blocks: two waves of the
H200's 132 SMs for SmolLM2's q/o (N 576), where one [32 or 128, K] matrix is one product of a few blocks.
H200 (h10d's probe, benchmarks/results/h200-s10-h10d-probe.log; wall us a product, launch-bound near 6):
q/o 12.4 -> 6.0 us at 32 rows, 12.3 -> 5.8 at 128; down 22 -> 7.9; gate/up stacked 28 -> 8.5; the 8-bit
vocabulary (49152) 279 -> 26 at 32 rows, 282 -> 50 at 128. Every layout gave the same bits (a row's value
does not depend on the tile or the batch), so plain decoding and the verify stay token-identical.
(Padding N to 128 for qmm_sm80, the first guess at session 9's 3.4 ms of qmm_naive a width-32 round, moved a
product by under 10% batched and not at all as one matrix: qmm_naive is not slower per block, the batch grid is.)

`install(model)` makes the model's quantized layers (QuantizedLinear; a QuantizedEmbedding's `as_linear`, the
tied vocabulary head) run a product of more than QMV_ROWS rows over x [..., L, K] as one [rows, K] matrix
(ONE_MATRIX), and the stacked siblings (fusion.StackedPart) take their stacked product there too, split as at
one row (WHOLE): one launch a group instead of three (two). Both switches are read when a product is called
(so when a program is traced); off, the layers run as before. The engine installs it on CUDA (fusion.decode_paths).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .rows_attention import cuda_ready

QMV_ROWS = 7  # MLX CUDA's quantized matmul runs its vector kernel (qmv) below 8 rows (quantized.cpp)
# many-row products over x [..., L, K] as one [rows, K] matrix (round_cost `@mtplx.qmm_rows.ONE_MATRIX=1`)
# Off until a whole run measures it on the H200 (session 10).
ONE_MATRIX = False
# stacked quantized siblings' one product past QMV_ROWS rows too (round_cost `@mtplx.qmm_rows.WHOLE=1`)
WHOLE = False


def pays() -> bool:
    """Where the engine installs it (fusion.decode_paths): MLX's CUDA backend (the CPU's quantized matmul
    has no such batch grid)."""
    return cuda_ready()


def many_rows(x: mx.array) -> bool:
    return x.size // x.shape[-1] > QMV_ROWS


def as_matrix(product, x: mx.array) -> mx.array:
    """product(x) with x's rows as one matrix where that applies (ONE_MATRIX, more than QMV_ROWS rows and
    more than one leading axis); the output takes x's leading shape back. Both reshapes are of contiguous
    arrays (no copy)."""
    if not (ONE_MATRIX and x.ndim > 2 and many_rows(x)):
        return product(x)
    y = product(x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], y.shape[-1])


class MatrixQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose product of many rows is one matrix (as_matrix)."""

    def __call__(self, x):
        return as_matrix(super().__call__, x)


class MatrixQuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding whose `as_linear` (a tied vocabulary head) of many rows is one matrix."""

    def as_linear(self, x):
        return as_matrix(super().as_linear, x)


_CLASSES = {nn.QuantizedLinear: MatrixQuantizedLinear, nn.QuantizedEmbedding: MatrixQuantizedEmbedding}


def whole(st, x: mx.array) -> bool:
    """Whether stacked siblings (fusion._Stacked) take their stacked product over `x`: past QMV_ROWS rows,
    where install marked them (quantized) and WHOLE is on."""
    return WHOLE and st.whole and many_rows(x)


def install(model) -> int:
    """Give `model`'s quantized layers (and its stacked siblings' layers and views) the classes above, and
    mark quantized stacked siblings to be taken whole. Returns how many layers changed class."""
    from .fusion import StackedPart

    n = 0

    def swap(m) -> int:
        cls = _CLASSES.get(type(m))
        if cls is not None:
            m.__class__ = cls
        return cls is not None

    for _, module in model.named_modules():
        n += swap(module)
        if isinstance(module, StackedPart) and module._index == 0:
            st = module._stacked[0]
            st.whole = isinstance(st.layer, nn.QuantizedLinear)
            n += sum(swap(v) for v in st.views)  # (the stacked layer is the part's child: swapped above)
    return n
