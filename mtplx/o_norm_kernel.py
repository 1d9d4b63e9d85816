"""A one-row product, the residual add and the RMSNorm that reads the sum as one CUDA kernel: the attention's
o_proj with the post-attention norm, and (with mlp_kernel) the MLP's down_proj with the next layer's input norm
or the final norm.

With layer_kernels.py a one-row decode step runs, after the attention, MLX's gemv for o_proj and then
layer_kernels' add + RMSNorm kernel (one block over the row). `o_add_norm(a, w_o, x, w_norm, eps)` does
both in one launch: each warp computes one output of `a @ w_o.T` with MLX's gemv arithmetic (mlp_kernel's
GEMV_ROWS: gemv.cu's lanes, order and reduction) and stores it; the block that finishes last (an atomic
ticket, the pattern of CUDA's threadFenceReduction sample) then runs layer_kernels' add + RMSNorm over the
row exactly as that kernel does (its version-2 source, every load first, the arithmetic of both versions, with a block of as many threads as MLX's rms_norm takes for
the width: 128 at the Qwen3-8B / 0.6B and SmolLM2 hidden sizes, so 4 warps, i.e. 4 outputs, a block),
reading the stored products from L2. So the values are the
unfused ops' (o_proj, then x + o, then rms_norm) bit for bit by construction; `check()` compares them on
the GPU. The ticket is an int device array (16 of them: a 4-byte array would sit in MLX's managed small-array pool,
where the atomics cost ~1 ms a call on the H200) whose first element the last block resets to zero; calls are serialized by
their data (each layer's call reads the previous layer's output), so one ticket serves them all.

layer_kernels' attention records its o_proj input, mlp_kernel's MLP its down_proj input; layer_kernels'
block (post-attention norm) and its next consumer of the block's lazy sum (the next block's input norm, or
the final norm) take this kernel for that product when `usable` and the engine enables it (`Engine.use_o_norm_kernel`, fusion.decode_paths; without mlp_kernel,
fusion installs mlp_kernel's MLP with MLX's ops so that down_proj's input is handed over). Off by default: on
the H200 every case is bit-identical and the engine's tokens are the default path's (session 7, both windows),
but a call took 28 us on average (the CUPTI trace) where o_proj's and down_proj's gemvs alone average 17.8 (the
serial add + norm tail in one block after the grid, and the ticket), so the 8B one-stream step ran 187 tok/s
against 191 without it (final window). Off CUDA,
and with `layer_kernels.install(reference=True)`, MLX's ops.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import kernel_cache, layer_kernels
from .mlp_kernel import GEMV_ROWS
from .rows_attention import cuda_ready

DTYPES = (mx.bfloat16, mx.float16)

# inputs a [K] (the attention's output, one row), wo [N, K] (o_proj's weight), x [N] (the residual), w [N]
# (the norm's weight), eps, ticket (int32, its first element zero between calls); outputs o [N] (the product),
# h = x + o, y = rms_norm(h) * w. The add + norm part is layer_kernels' _ADD_NORM_V2 (row 0), reading o through L2.
_SOURCE = """
  auto block_ = cg::this_thread_block();
  auto warp_ = cg::tiled_partition<32>(block_);
  const int NO = wo_shape[0];
  const int KO = wo_shape[1];
  const int n_ = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (n_ < NO) {
    const T* rows[1] = {wo + (size_t)n_ * KO};
    float sums[1];
    mtplx_gemv_rows<1>(wo, rows, a, KO, warp_.thread_rank(), sums);
    float s_ = cg::reduce(warp_, sums[0], cg::plus<float>{});
    if (warp_.thread_rank() == 0) {
      o[n_] = static_cast<T>(s_);
    }
  }
  __shared__ bool last_;
  __threadfence();
  block_.sync();
  if (threadIdx.x == 0) {
    last_ = atomicAdd(const_cast<int*>(ticket), 1) == (int)gridDim.x - 1;
  }
  block_.sync();
  if (!last_) {
    return;
  }
  __threadfence();
  {
    const T* r = o;
ADD_NORM
  }
  if (threadIdx.x == 0) {
    *const_cast<int*>(ticket) = 0;
  }
"""

_kernel = None
_ticket = None


# load_vector's semantics (mlx/backend/cuda/device/utils.cuh) through L2 only (ld.global.cg): the products
# the other blocks stored are read where they are, never from a stale L1 line
_LOAD_CG = """
namespace mlx::core::cu {
template <int N, typename T>
__device__ __forceinline__ AlignedVector<T, N> mtplx_load_cg(const T* ptr, uint32_t offset, uint32_t size, T fallback) {
  AlignedVector<T, N> v;
  if (sizeof(T) * N == 16 && is_aligned<N>(ptr) && (offset + 1) * N <= size) {
    uint4 raw = __ldcg(reinterpret_cast<const uint4*>(ptr) + offset);
    memcpy(&v, &raw, 16);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      v[i] = (N * offset + i) < size ? __ldcg(ptr + N * offset + i) : fallback;
    }
  }
  return v;
}
}  // namespace mlx::core::cu
"""


def _source() -> str:
    """layer_kernels' add + norm (version 2: every load first, the same arithmetic as version 1) for row 0,
    reading the products through L2."""
    body = (layer_kernels._ADD_NORM_V2.replace("const size_t row = blockIdx.x;", "const size_t row = 0;")
            .replace("auto ra = load_vector<NR>(r + row * D, vi, D, T(0));", "auto ra = mtplx_load_cg<NR>(r + row * D, vi, D, T(0));"))
    assert "mtplx_load_cg" in body and "row = 0" in body, "layer_kernels' add + norm source changed: update o_norm_kernel"
    return _SOURCE.replace("ADD_NORM", body)


def usable(a: mx.array, o_proj, x: mx.array, norm) -> bool:
    """One row, plain bf16 / fp16 weights without bias, the norm over o_proj's outputs."""
    if not (cuda_ready() and type(o_proj) is nn.Linear and "bias" not in o_proj and isinstance(norm, nn.RMSNorm)):
        return False
    w = o_proj.weight
    n = w.shape[0]
    return (a.dtype in DTYPES and w.dtype == a.dtype and x.dtype == a.dtype and norm.weight.dtype == a.dtype
            and a.size == a.shape[-1] == w.shape[1] and x.size == x.shape[-1] == n and norm.weight.shape == (n,))


def o_add_norm(a: mx.array, wo: mx.array, x: mx.array, w: mx.array, eps: float):
    """(x + a @ wo.T, rms_norm(x + a @ wo.T, w, eps)) for one row, as one kernel; shapes of x."""
    global _kernel, _ticket
    if _kernel is None:
        _kernel = kernel_cache.cuda_kernel(name="mtplx_o_add_norm", input_names=["a", "wo", "x", "w", "eps", "ticket"],
                                      output_names=["o", "h", "y"], source=_source(),
                                      header=layer_kernels._HEADER + GEMV_ROWS + _LOAD_CG)
        _ticket = mx.zeros((16,), dtype=mx.int32)  # past MLX's managed small-array pool: atomics there cost ~1 ms a call
        mx.eval(_ticket)
    n, k = wo.shape
    block, chunks, nr = layer_kernels._norm_layout(n, x.dtype.size)  # the gemv takes block / 32 rows a block
    _, h, y = _kernel(inputs=[a.reshape(k), wo, x.reshape(n), w, layer_kernels._const(float(eps)), _ticket],
                      template=[("T", x.dtype), ("D", n), ("BLOCK", block), ("CHUNKS", chunks), ("NR", nr),
                                ("ACC", layer_kernels.SQUARES)],
                      grid=(-(-n // (block // 32)) * block, 1, 1), threadgroup=(block, 1, 1),
                      output_shapes=[(n,), (n,), (n,)], output_dtypes=[x.dtype] * 3)
    return h.reshape(x.shape), y.reshape(x.shape)


def reference(a, wo, x, w, eps):
    """The same with MLX's ops: the product, then layer_kernels' add + norm reference."""
    return layer_kernels.add_rms_norm_reference(x, a @ wo.T, w, eps)


def check(dtypes=("bfloat16", "float16")) -> list:
    """On CUDA: the kernel against MLX's ops (the product, the add, rms_norm), eagerly and inside mx.compile, for
    the 8B / 0.6B o_proj and down_proj shapes, SmolLM2's and two other widths (64- and 1024-thread norm blocks),
    three calls in a row each (the ticket must come back to zero); one dict a case."""
    rows = []
    for dtype in dtypes:
        dt = getattr(mx, dtype)
        for n, k in ((4096, 4096), (4096, 12288), (1024, 2048), (1024, 3072), (576, 576), (64, 256), (12288, 512)):
            wo = (0.05 * mx.random.normal((n, k))).astype(dt)
            w = (1 + 0.1 * mx.random.normal((n,))).astype(dt)
            for how, f, ref in (("eager", o_add_norm, reference), ("compiled", mx.compile(o_add_norm), mx.compile(reference))):
                same, worst = True, 0.0
                for _ in range(3):
                    a = mx.random.normal((1, 1, k)).astype(dt)
                    x = mx.random.normal((1, 1, n)).astype(dt)
                    got, want = f(a, wo, x, w, 1e-6), ref(a, wo, x, w, 1e-6)
                    for g_, w_ in zip(got, want):
                        worst = max(worst, mx.abs(g_.astype(mx.float32) - w_.astype(mx.float32)).max().item())
                        same = same and bool(mx.array_equal(g_, w_).item())
                rows.append({"check": f"o_add_norm {dtype} N={n} K={k} {how} x3", "bit-identical": same, "max abs diff": worst})
                print("o_norm_kernel", rows[-1], flush=True)
    return rows
