"""`x @ W.T` for a few rows of x (one-stream decoding and its verify), a CUDA kernel, each row on its own.

A one-stream decode step multiplies one row (a verify of depth d: d + 1 rows) by every weight
matrix of the model, so it reads every weight once and does almost no arithmetic: the time is the
weight bytes over the memory bandwidth. MLX's CUDA gemv (one warp per output, the 16-byte loads
consumed as they arrive) reaches ~70% of the H200's HBM peak at one row, and with more rows MLX
takes its general matmul (~58% at four rows: benchmarks/gemv_bandwidth). This kernel streams each
weight row once for all M <= MAX_ROWS rows of x: every lane keeps several 16-byte weight loads in
flight (U chunks of R output rows), marks them streaming (ld.global.cs: read once, keep the small x
in L1), and accumulates M fp32 dot products per load.

Each output is a function of its weight row and its x row alone, whatever M, R or U: lane l adds
chunks l, l + 32, l + 64, ... (8 elements each, in order, by fused multiply-add into an fp32
sum), then the 32 lane sums are added in one fixed tree (xor shuffles 16, 8, 4, 2, 1), rounded once
to the output type (plus the bias, in fp32, before rounding). So a one-row step (M = 1) and a
verify of the same row (M = 4) give the same bits, and so do the stacked q/k/v and its parts: greedy
speculation stays token-identical to plain decoding. Against MLX's own matmul it is only close
(another summation order).

`install(model)` turns the model's plain bf16/fp16 Linear layers (stacked siblings included, and
the tied vocabulary head: Embedding.as_linear) into ones that take this kernel for inputs of at
most MAX_ROWS rows on CUDA (more rows, other dtypes, K not a multiple of 8: MLX's matmul, unchanged);
`uninstall(model)` puts them back. Quantized layers keep MLX's kernels. The engine installs it
where it compiles one-stream decode steps on CUDA when `Engine.use_skinny_matmul` is set
(fusion.decode_paths); benchmarks/skinny_check checks it against MLX on the GPU.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .rows_attention import cuda_ready

MAX_ROWS = 8
DTYPES = (mx.bfloat16, mx.float16)
WARPS = 8  # warps a block (256 threads), unless `tiles` says otherwise

_HEADER = """
// bf16 / fp16 pairs (one 32-bit word, element 0 in the low half) as two floats, exactly
__device__ __forceinline__ float2 mtplx_pair(uint32_t u, __nv_bfloat16*) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
__device__ __forceinline__ float2 mtplx_pair(uint32_t u, __half*) {
  __half2 h = *reinterpret_cast<__half2*>(&u);
  return __half22float2(h);
}
// a 16-byte load marked streaming (evict first): weights are read once, x stays in L1
__device__ __forceinline__ uint4 mtplx_stream_load(const uint4* p) {
  uint4 v;
  asm("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""

# T: element type; M: rows of x; R: output columns per warp; U: chunks per lane in flight.
# x [M, K], w [N, K] (row-major, K % 8 == 0), out [M, N]; ADD_BIAS: + bias[n] in fp32, or nothing.
_SOURCE = """
  const int N = w_shape[0];
  const int chunks = w_shape[1] / 8;  // 16-byte chunks per row
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  if (n0 >= N) {
    return;  // the whole warp
  }
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const bool x_aligned = (reinterpret_cast<size_t>(x) & 15) == 0;
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int m = 0; m < M; m++) {
      acc[r][m] = 0.f;
    }
  }
  for (int c = lane; c < chunks; c += 32 * U) {
    uint4 wc[U][R];
#pragma unroll
    for (int u = 0; u < U; u++) {  // every load first, then the arithmetic
#pragma unroll
      for (int r = 0; r < R; r++) {
        const int cc = c + 32 * u;
        const int n = n0 + r < N ? n0 + r : N - 1;  // a column past N reads a real row, never written
        wc[u][r] = cc < chunks ? mtplx_stream_load(wv + (size_t)n * chunks + cc) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int cc = c + 32 * u;
      if (cc < chunks) {  // chunks in increasing order, whatever U
#pragma unroll
        for (int m = 0; m < M; m++) {
          uint32_t xw[4];
          if (x_aligned) {
            const uint4 xc = xv[(size_t)m * chunks + cc];
            xw[0] = xc.x, xw[1] = xc.y, xw[2] = xc.z, xw[3] = xc.w;
          } else {  // x a view at an odd offset: the same words, two bytes at a time
            const unsigned short* xs = reinterpret_cast<const unsigned short*>(x) + ((size_t)m * chunks + cc) * 8;
#pragma unroll
            for (int j = 0; j < 4; j++) {
              xw[j] = (uint32_t)xs[2 * j] | ((uint32_t)xs[2 * j + 1] << 16);
            }
          }
#pragma unroll
          for (int r = 0; r < R; r++) {
            const uint32_t ww[4] = {wc[u][r].x, wc[u][r].y, wc[u][r].z, wc[u][r].w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
              const float2 a = mtplx_pair(ww[j], (T*)nullptr);
              const float2 b = mtplx_pair(xw[j], (T*)nullptr);
              acc[r][m] = fmaf(a.x, b.x, acc[r][m]);
              acc[r][m] = fmaf(a.y, b.y, acc[r][m]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int m = 0; m < M; m++) {
      float s = acc[r][m];
      s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 16));
      s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 8));
      s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 4));
      s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
      s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
      acc[r][m] = s;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; r++) {
      const int n = n0 + r;
      if (n < N) {
#pragma unroll
        for (int m = 0; m < M; m++) {
          out[(size_t)m * N + n] = static_cast<T>(ADD_BIAS(acc[r][m]));
        }
      }
    }
  }
"""

_kernels = {}


def _kernel(with_bias: bool):
    if with_bias not in _kernels:
        names = ["x", "w", "bias"] if with_bias else ["x", "w"]
        total = "__fadd_rn(acc[r][m], static_cast<float>(bias[n]))" if with_bias else "acc[r][m]"
        src = _SOURCE.replace("ADD_BIAS(acc[r][m])", total)
        _kernels[with_bias] = mx.fast.cuda_kernel(name="mtplx_skinny_matmul" + ("_bias" if with_bias else ""),
                                                  input_names=names, output_names=["out"], source=src, header=_HEADER)
    return _kernels[with_bias]


def tile(n: int, m: int = 1) -> tuple:
    """(R, U): output columns per warp and chunks in flight per lane for an N-row weight and M rows of
    x. Only speed depends on them (never a value): more columns per warp for long matrices (fewer x
    reads per weight byte), one per warp for short ones (enough warps to fill 132 SMs)."""
    return (2, 2) if n >= 8192 else (1, 4)


def fits(x: mx.array, w: mx.array) -> bool:
    """Whether `x @ w.T` is this kernel's: x of 1..MAX_ROWS rows of w's dtype (bf16 / fp16), K % 8 == 0."""
    k = w.shape[-1] if w.ndim == 2 else 0
    return (w.ndim == 2 and w.dtype in DTYPES and x.dtype == w.dtype and x.ndim >= 1 and x.shape[-1] == k
            and k % 8 == 0 and 0 < x.size // k <= MAX_ROWS)


def skinny_matmul(x: mx.array, w: mx.array, bias: Optional[mx.array] = None, tiles: Optional[tuple] = None) -> mx.array:
    """`x @ w.T (+ bias)` for x [..., K] of at most MAX_ROWS rows, w [N, K] (see `fits`), on CUDA.
    `tiles`: (R, U) or (R, U, warps a block) instead of `tile`'s (benchmarks/skinny_check times them)."""
    n, k = w.shape
    m = x.size // k
    r, u, warps_a_block = (tuple(tiles or tile(n, m)) + (WARPS,))[:3]
    inputs = [x.reshape(m, k), w] + ([bias] if bias is not None else [])
    warps = -(-n // r)
    (out,) = _kernel(bias is not None)(
        inputs=inputs, template=[("T", w.dtype), ("M", m), ("R", r), ("U", u)],
        grid=(-(-warps // warps_a_block) * warps_a_block * 32, 1, 1), threadgroup=(warps_a_block * 32, 1, 1),
        output_shapes=[(m, n)], output_dtypes=[w.dtype])
    return out.reshape(*x.shape[:-1], n)


# -- plugging it into mlx-lm model code ------------------------------------------------------------
# the product the patched layers call for the inputs that fit (install's `matmul`; tests give another)
_matmul: Callable = skinny_matmul


class SkinnyLinear(nn.Linear):
    """nn.Linear whose few-row products take the kernel (the layer's class swapped in place: same
    arrays, same parameters, so stacked views and copies made later keep it)."""

    def __call__(self, x):
        w = self["weight"]
        if fits(x, w):
            return _matmul(x, w, self.get("bias"))
        return super().__call__(x)


class SkinnyEmbedding(nn.Embedding):
    """nn.Embedding whose `as_linear` (the tied vocabulary head) takes the kernel for a few rows."""

    def as_linear(self, x):
        if fits(x, self.weight):
            return _matmul(x, self.weight, None)
        return super().as_linear(x)


_SWAPS = {nn.Linear: SkinnyLinear, nn.Embedding: SkinnyEmbedding}


def _layers(model):
    """Every module of `model`, and the layers fusion's stacked parts hold outside the module tree."""
    from .fusion import StackedPart

    for _, m in model.named_modules():
        yield m
        if isinstance(m, StackedPart):
            st = m._stacked[0]
            yield st.layer
            yield from st.views


def install(model, matmul: Optional[Callable] = None) -> int:
    """Swap the model's bf16/fp16 nn.Linear / nn.Embedding layers for SkinnyLinear / SkinnyEmbedding
    (in place); returns how many layers were swapped. Only on CUDA, unless `matmul` (x, w, bias) is
    given to stand in for the kernel (tests off CUDA)."""
    global _matmul
    if matmul is None and not cuda_ready():
        return 0
    _matmul = matmul or skinny_matmul
    n = 0
    seen = set()
    for m in _layers(model):
        if id(m) in seen:
            continue
        seen.add(id(m))
        new = _SWAPS.get(type(m))
        if new is not None and m["weight"].dtype in DTYPES:
            m.__class__ = new
            n += 1
    return n


def uninstall(model) -> int:
    """Put every swapped layer of `model` back to its MLX class; returns how many."""
    back = {v: k for k, v in _SWAPS.items()}
    n = 0
    seen = set()
    for m in _layers(model):
        if id(m) not in seen and type(m) in back:
            m.__class__ = back[type(m)]
            n += 1
        seen.add(id(m))
    return n
