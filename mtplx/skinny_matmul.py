"""`x @ W.T` for a few rows of x (one-stream decoding and its verify), a CUDA kernel, each row on its own.

A one-stream decode step multiplies one row (a verify of depth d: d + 1 rows) by every weight
matrix of the model, so it reads every weight once and does almost no arithmetic: the time is the
weight bytes over the memory bandwidth. MLX's CUDA gemv (one warp per output) reaches ~70% of the
H200's HBM peak at one row over the 8B shape's matrices; with more rows MLX takes its general matmul
(~58% at four rows: benchmarks/gemv_bandwidth). This kernel streams each weight row once for all
M <= MAX_ROWS rows of x: every lane keeps several weight loads in flight (U chunks of R output
columns), marks them streaming (ld.global.cs: read once, keep the small x in L1), and accumulates M
fp32 dot products per load.

Each output is a function of its weight row and its x row alone, whatever M, R or U: lane l adds
chunks l, l + 32, l + 64, ... (NPT elements each, in order, by fused multiply-add into an fp32
sum), then the 32 lane sums are added in one fixed tree (xor shuffles 16, 8, 4, 2, 1), rounded once
to the output type (plus the bias, in fp32, before rounding). So a one-row step (M = 1) and a
verify of the same row (M = 4) give the same bits, and so do the stacked q/k/v and its parts: greedy
speculation stays token-identical to plain decoding. By default NPT = 8 (16-byte loads): close to
MLX's matmul, not equal. With MATCH_MLX, NPT is MLX's gemv's own split of K, so every row equals
MLX's one-row product bit for bit; one-row products then stay MLX's (as fast as this kernel there:
H200, session 6 window 2) and the kernel takes 2..8 rows, where it beat MLX's matmul by up to 1.75x
(BENCHMARKS.md, h6g).

`install(model)` turns the model's plain bf16/fp16 Linear layers (stacked siblings included, and
the tied vocabulary head: Embedding.as_linear) into ones that take this kernel for the inputs `fits`
accepts on CUDA (more rows, other dtypes, K not a multiple of 8: MLX's matmul, unchanged);
`uninstall(model)` puts them back. Quantized layers keep MLX's kernels. The engine installs it
where it compiles decode steps on CUDA when `Engine.use_skinny_matmul` is set (fusion.decode_paths;
off: it does not speed up one-row steps); benchmarks/skinny_check checks it on the GPU.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from . import kernel_cache
from .rows_attention import cuda_ready

MAX_ROWS = 8
# False: 16-byte chunks, every row's value the same whatever M (checked on the H200, session 6), but not
# MLX's. True: MLX's gemv's split (`chunk`), so rows equal MLX's one-row product, which one-row steps
# keep (MLX's gemv is as fast there); the kernel takes 2..8 rows (not yet checked on the GPU).
MATCH_MLX = False
DTYPES = (mx.bfloat16, mx.float16)
WARPS = 8  # warps a block (256 threads), unless `tiles` says otherwise

_HEADER = """
// element `hi` (0: the low half, 1: the high half) of a 32-bit word of two bf16 / fp16 values, as a float (exact)
__device__ __forceinline__ float mtplx_elem(uint32_t w, int hi, __nv_bfloat16*) {
  return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float mtplx_elem(uint32_t w, int hi, __half*) {
  return __half2float(__ushort_as_half((unsigned short)(hi ? (w >> 16) : (w & 0xffffu))));
}
// NPT 16-bit elements at p as (NPT + 1) / 2 words: one load of 2 * NPT bytes (p aligned to it), marked
// streaming for the weights (read once: x stays in L1), or element by element (p at any even address)
template <int NPT>
__device__ __forceinline__ void mtplx_load(const unsigned short* p, uint32_t* w, bool stream, bool aligned) {
  if (!aligned) {
#pragma unroll
    for (int j = 0; j < (NPT + 1) / 2; j++) {
      w[j] = (uint32_t)p[2 * j] | (2 * j + 1 < NPT ? (uint32_t)p[2 * j + 1] << 16 : 0u);
    }
  } else if constexpr (NPT == 8) {
    uint4 v;
    if (stream) {
      asm("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
      v = *reinterpret_cast<const uint4*>(p);
    }
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (NPT == 4) {
    uint2 v;
    if (stream) {
      asm("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    } else {
      v = *reinterpret_cast<const uint2*>(p);
    }
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (NPT == 2) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    w[0] = (uint32_t)p[0];
  }
}
"""

# T: element type; M: rows of x; R: output columns per warp; U: chunks per lane in flight; NPT: elements a
# chunk (8: 16-byte loads; 4 / 2 / 1: MLX's gemv's partition, see `chunk`).
# x [M, K], w [N, K] (row-major, K % NPT == 0), out [M, N]; ADD_BIAS: + bias[n] in fp32, or nothing.
_SOURCE = """
  constexpr int NW = (NPT + 1) / 2;  // 32-bit words a chunk
  const int N = w_shape[0];
  const int chunks = w_shape[1] / NPT;
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  if (n0 >= N) {
    return;  // the whole warp
  }
  const unsigned short* wp = reinterpret_cast<const unsigned short*>(w);
  const unsigned short* xp = reinterpret_cast<const unsigned short*>(x);
  const bool w_aligned = (reinterpret_cast<size_t>(w) & (2 * NPT - 1)) == 0;
  const bool x_aligned = (reinterpret_cast<size_t>(x) & (2 * NPT - 1)) == 0;
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int m = 0; m < M; m++) {
      acc[r][m] = 0.f;
    }
  }
  for (int c = lane; c < chunks; c += 32 * U) {
    uint32_t wc[U][R][NW];
#pragma unroll
    for (int u = 0; u < U; u++) {  // every load first, then the arithmetic
#pragma unroll
      for (int r = 0; r < R; r++) {
        const int cc = c + 32 * u;
        const int n = n0 + r < N ? n0 + r : N - 1;  // a column past N reads a real row, never written
        if (cc < chunks) {
          mtplx_load<NPT>(wp + ((size_t)n * chunks + cc) * NPT, wc[u][r], true, w_aligned);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int cc = c + 32 * u;
      if (cc < chunks) {  // chunks in increasing order, whatever U
#pragma unroll
        for (int m = 0; m < M; m++) {
          uint32_t xw[NW];
          mtplx_load<NPT>(xp + ((size_t)m * chunks + cc) * NPT, xw, false, x_aligned);
#pragma unroll
          for (int r = 0; r < R; r++) {
#pragma unroll
            for (int j = 0; j < NPT; j++) {  // element order, one fused multiply-add each
              acc[r][m] = fmaf(mtplx_elem(wc[u][r][j / 2], j % 2, (T*)nullptr),
                               mtplx_elem(xw[j / 2], j % 2, (T*)nullptr), acc[r][m]);
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
        _kernels[with_bias] = kernel_cache.cuda_kernel(name="mtplx_skinny_matmul" + ("_bias" if with_bias else ""),
                                                  input_names=names, output_names=["out"], source=src, header=_HEADER)
    return _kernels[with_bias]


def tile(n: int, m: int = 1, npt: int = 8) -> tuple:
    """(R, U): output columns per warp and chunks in flight per lane for an N-row weight, M rows of x
    and chunks of NPT elements. Only speed depends on them (never a value). From the H200's timings
    (session 6 window 2, 16-byte chunks): two columns a warp, four chunks in flight, but one column
    at one row and two chunks at several rows for the long matrices; chunks of fewer elements keep
    as many bytes in flight."""
    r, u = ((1, 4) if m == 1 else (2, 2)) if n >= 8192 else (2, 4)
    return r, u * (8 // npt) if npt < 8 else u


def chunk(k: int) -> int:
    """Elements a lane reads at a time (NPT) for K: 8 (16-byte loads), or with MATCH_MLX the split of
    MLX's own CUDA gemv (4 where K % 128 == 0, 2 where K % 64 == 0, else 1), so that each row's sum is
    MLX's one-row product's to the bit (the same lanes add the same elements in the same order by
    fused multiply-adds, then the same xor-shuffle tree as cooperative_groups::reduce)."""
    if not MATCH_MLX:
        return 8
    return 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1


def fits(x: mx.array, w: mx.array, bias: Optional[mx.array] = None) -> bool:
    """Whether `x @ w.T` is this kernel's: x of 1..MAX_ROWS rows of w's dtype (bf16 / fp16), K % 8 == 0.
    With MATCH_MLX: 2..MAX_ROWS rows and no bias (one row, and biased layers, keep MLX's kernels)."""
    k = w.shape[-1] if w.ndim == 2 else 0
    rows = x.size // k if k else 0
    return (w.ndim == 2 and w.dtype in DTYPES and x.dtype == w.dtype and x.ndim >= 1 and x.shape[-1] == k
            and k % 8 == 0 and (2 if MATCH_MLX else 1) <= rows <= MAX_ROWS and not (MATCH_MLX and bias is not None))


def skinny_matmul(x: mx.array, w: mx.array, bias: Optional[mx.array] = None, tiles: Optional[tuple] = None,
                  npt: Optional[int] = None) -> mx.array:
    """`x @ w.T (+ bias)` for x [..., K] of at most MAX_ROWS rows, w [N, K] (K % 8 == 0), on CUDA.
    `tiles`: (R, U) or (R, U, warps a block) instead of `tile`'s (benchmarks/skinny_check times them);
    `npt`: the chunk instead of `chunk`'s (K % npt == 0)."""
    n, k = w.shape
    m = x.size // k
    npt = npt or chunk(k)
    r, u, warps_a_block = (tuple(tiles or tile(n, m, npt)) + (WARPS,))[:3]
    inputs = [x.reshape(m, k), w] + ([bias] if bias is not None else [])
    warps = -(-n // r)
    (out,) = _kernel(bias is not None)(
        inputs=inputs, template=[("T", w.dtype), ("M", m), ("R", r), ("U", u), ("NPT", npt)],
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
        w, b = self["weight"], self.get("bias")
        if fits(x, w, b):
            return _matmul(x, w, b)
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
