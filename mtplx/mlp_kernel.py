"""The MLP's gate/up product and its SwiGLU as one CUDA kernel at one row.

A one-row decode step runs, in every layer, MLX's gemv over the stacked gate/up weight (fusion.py)
and then one fused elementwise kernel for `silu(gate) * up` (mlx-lm's `swiglu`); at the 8B shape that
is 36 small kernels a step besides the products. `swiglu_gemv(x, w)` does both in one kernel: warp i
computes output i's gate row and up row (rows i and N + i of the stacked weight) against x, then
applies SwiGLU and writes one value. Each step reproduces MLX's own arithmetic:

- the products are MLX's gemv (mlx/backend/cuda/gemms/gemv.cu, `gemv_impl`): lane l of a warp adds
  elements NPT*l + 32*NPT*t (NPT = 4 where K % 128 == 0 and both pointers are 8-byte aligned, 2 where
  K % 64 == 0 and 4-byte aligned, else 1), each product added to an fp32 sum as `sum += w * x` in the
  same order, then `cooperative_groups::reduce` over the warp and one rounding to the element type;
- SwiGLU is `Multiply(Multiply(g, Sigmoid(g)), u)` in the element type, with MLX's own functors
  (unary_ops.cuh / binary_ops.cuh), which is what the fused kernel of `mx.compile`d `swiglu` runs
  (compiled.cpp keeps each intermediate in its array's type).

So the values are meant to be the unfused ops' bit for bit; `check()` compares them on the GPU
(benchmarks/step_overhead runs it), and the engine installs it only where that held
(`Engine.use_mlp_kernel`, fusion.decode_paths).

`install(model)` swaps the class of every Qwen3 MLP (Llama / Qwen2 with `modules=MODULES`) whose gate and
up projections are stacked (fusion.fuse_projections: the stacked weight is what the kernel reads); a one-row input takes
the kernel, anything else (prefill, a verify of several tokens, quantized weights) mlx-lm's code.
`install(model, reference=True)` runs the same plumbing with MLX's ops in the kernel's place (how the
CPU tests check it).
"""

from __future__ import annotations

import mlx.core as mx

from . import kernel_cache
from .fusion import StackedPart
from .rows_attention import cuda_ready

DTYPES = (mx.bfloat16, mx.float16)
WARPS = 8  # rows a block, as MLX's gemv (rows_per_block = 8)

# MLX's gemv loop (gemv.cu, gemv_impl) for R weight rows at once, NPT elements a lane at a time: each row's
# sum gets its own products in gemv's order; R rows in one loop keep R load streams in flight. Also used
# by o_norm_kernel.py.
GEMV_ROWS = """
namespace mlx::core::cu {
template <int NPT, int R, typename T>
__device__ __forceinline__ void mtplx_dot_rows(const T* const* rows, const T* vec, int cols, int lane, float* sums) {
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    acc[r] = 0.f;
  }
  for (int col = NPT * lane; col < cols; col += 32 * NPT) {
    AlignedVector<T, NPT> local_mat[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      local_mat[r] = unsafe_load_vector<NPT>(rows[r] + col, 0);
    }
    auto local_vec = unsafe_load_vector<NPT>(vec + col, 0);
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
#pragma unroll
      for (int r = 0; r < R; r++) {
        acc[r] += static_cast<float>(local_mat[r][j]) * static_cast<float>(local_vec[j]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
    sums[r] = acc[r];
  }
}

// gemv.cu's choice of elements a lane: its `mat` is the weight's start, its `vec` the input row
template <int R, typename T>
__device__ __forceinline__ void mtplx_gemv_rows(const T* w, const T* const* rows, const T* vec, int cols, int lane, float* sums) {
  if (cols % 128 == 0 && is_aligned<4>(w) && is_aligned<4>(vec)) {
    mtplx_dot_rows<4, R>(rows, vec, cols, lane, sums);
  } else if (cols % 64 == 0 && is_aligned<2>(w) && is_aligned<2>(vec)) {
    mtplx_dot_rows<2, R>(rows, vec, cols, lane, sums);
  } else {
    mtplx_dot_rows<1, R>(rows, vec, cols, lane, sums);
  }
}
}  // namespace mlx::core::cu
"""

_HEADER = """
#include "mlx/backend/cuda/device/unary_ops.cuh"
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include <cooperative_groups/reduce.h>
""" + GEMV_ROWS

# x [K] (one row), w [2N, K]: gate rows then up rows (fusion's stacked gate/up weight), out [N]
_SOURCE = """
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int K = w_shape[1];
  const int N = w_shape[0] / 2;
  const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (n >= N) {
    return;
  }
  const int lane = warp.thread_rank();
  const T* rows[2] = {w + (size_t)n * K, w + (size_t)(n + N) * K};  // gate row n, up row N + n
  float sums[2];
  mtplx_gemv_rows<2>(w, rows, x, K, lane, sums);
  float g = sums[0], u = sums[1];
  g = cg::reduce(warp, g, cg::plus<float>{});
  u = cg::reduce(warp, u, cg::plus<float>{});
  if (lane == 0) {
    T gt = static_cast<T>(g);
    T ut = static_cast<T>(u);
    T s = Sigmoid{}(gt);
    T gs = Multiply{}(gt, s);
    out[n] = Multiply{}(gs, ut);
  }
"""

_kernel = None


def swiglu_gemv(x: mx.array, w: mx.array) -> mx.array:
    """`swiglu(x @ w[:N].T, x @ w[N:].T)` for one row x [..., K] and the stacked gate/up weight w [2N, K]
    (bf16 / fp16), as one CUDA kernel; shape [..., N]."""
    global _kernel
    if _kernel is None:
        _kernel = kernel_cache.cuda_kernel(name="mtplx_swiglu_gemv", input_names=["x", "w"], output_names=["out"],
                                      source=_SOURCE, header=_HEADER)
    two_n, k = w.shape
    n = two_n // 2
    (out,) = _kernel(inputs=[x.reshape(k), w], template=[("T", w.dtype)],
                     grid=(-(-n // WARPS) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
                     output_shapes=[(n,)], output_dtypes=[w.dtype])
    return out.reshape(*x.shape[:-1], n)


def reference(x: mx.array, w: mx.array) -> mx.array:
    """The same with MLX's ops: the stacked product, its two halves, mlx-lm's swiglu."""
    from mlx_lm.models.activations import swiglu

    y = x @ w.T
    n = w.shape[0] // 2
    return swiglu(y[..., :n], y[..., n:])


class _State:
    reference = False  # install(reference=True): MLX's ops in the kernel's place (CPU tests)
    product = None  # the last one-row MLP's (output, down_proj's input, down_proj)


def _stacked_weight(mlp):
    """The stacked gate/up weight when this MLP's gate and up are fusion's parts of one plain bf16/fp16
    stack (gate first), else None."""
    g, u = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not (isinstance(g, StackedPart) and isinstance(u, StackedPart) and g._stacked[0] is u._stacked[0]):
        return None
    st = g._stacked[0]
    if (g._index, u._index, len(st.spans)) != (0, 1, 2) or type(st.layer).__name__ != "Linear" or "bias" in st.layer:
        return None
    w = st.layer["weight"]
    return w if w.dtype in DTYPES and st.spans[0][1] * 2 == w.shape[0] else None


def _mlp_call(self, x):
    w = _stacked_weight(self)
    if w is not None and x.size == x.shape[-1] and x.dtype == w.dtype:
        h = (reference if _State.reference else swiglu_gemv)(x, w)
        out = self.down_proj(h)
        _State.product = (out, h, self.down_proj)  # layer_kernels' o_norm may take down_proj with the next norm
        return out
    return _base(self).__call__(self, x)


MODULES = ("mlx_lm.models.qwen3", "mlx_lm.models.llama", "mlx_lm.models.qwen2")
# what install patches unless told: where it is measured (the Qwen3 8B shape), as layer_kernels.DEFAULT_FAMILIES
DEFAULT_MODULES = ("mlx_lm.models.qwen3",)
_patched = {}


def _base(module):
    return type(module).__mro__[1]


def _is_mlp(m, modules) -> bool:
    cls = _base(m) if type(m) in _patched.values() else type(m)
    return cls.__name__ == "MLP" and cls.__module__ in modules and cls.__module__ in MODULES


def install(model, reference: bool = False, modules=None) -> int:
    """Patch every MLP of `model` from `modules` (default DEFAULT_MODULES; MODULES are known) whose gate/up
    are stacked; returns how many (0 off CUDA unless `reference`)."""
    if not (cuda_ready() or reference):
        return 0
    _State.reference = reference
    n = 0
    for _, m in model.named_modules():
        if not _is_mlp(m, DEFAULT_MODULES if modules is None else modules) or _stacked_weight(m) is None:
            continue
        cls = _base(m) if type(m) in _patched.values() else type(m)
        if cls not in _patched:
            _patched[cls] = type(f"Fused{cls.__name__}", (cls,), {"__call__": _mlp_call})
        m.__class__ = _patched[cls]
        n += 1
    return n


def uninstall(model) -> int:
    """Give the patched MLPs their classes back; returns how many."""
    n = 0
    for _, m in model.named_modules():
        if type(m) in _patched.values():
            m.__class__ = _base(m)
            n += 1
    return n


def check(dtypes=("bfloat16", "float16")) -> list:
    """On CUDA: the kernel against MLX's ops (the stacked product + swiglu), eagerly and inside
    mx.compile, for the MLP widths of Qwen3-8B / 0.6B, SmolLM2 and odd ones (each K picks another
    gemv split); one dict per case."""
    rows = []
    for dtype in dtypes:
        dt = getattr(mx, dtype)
        for k, n in ((4096, 12288), (1024, 3072), (576, 1536), (200, 40)):
            x = mx.random.normal((1, 1, k)).astype(dt)
            w = (0.05 * mx.random.normal((2 * n, k))).astype(dt)
            for how, f, ref in (("eager", swiglu_gemv, reference),
                                ("compiled", mx.compile(swiglu_gemv), mx.compile(reference))):
                got, want = f(x, w), ref(x, w)
                d = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
                rows.append({"check": f"swiglu_gemv {dtype} K={k} N={n} {how}", "bit-identical": bool(mx.array_equal(got, want).item()),
                             "max abs diff": d})
                print("mlp_kernel", rows[-1], flush=True)
    return rows


def time_it(repeats: int = 50) -> dict:
    """us a call at the 8B shape (K 4096, N 12288), the kernel against MLX's product + swiglu, chained
    over 36 layers' weights (each layer's output feeds the next layer's input) inside one compiled call."""
    import time

    k, n, layers = 4096, 12288, 36
    ws = [(0.02 * mx.random.normal((2 * n, k))).astype(mx.bfloat16) for _ in range(layers)]
    down = [(0.02 * mx.random.normal((k, n))).astype(mx.bfloat16) for _ in range(layers)]
    mx.eval(ws, down)
    x = mx.random.normal((1, 1, k)).astype(mx.bfloat16)
    out = {}
    for name, f in (("kernel", swiglu_gemv), ("mlx", reference)):
        def chain(h, f=f):
            for w, d in zip(ws, down):
                h = f(h, w) @ d.T
            return h
        c = mx.compile(chain)
        mx.eval(c(x))
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(c(x))
            ts.append(time.perf_counter() - t)
        ts.sort()
        out[name + " us/layer"] = 1e6 * ts[len(ts) // 2] / layers
    print("mlp_kernel timing (gate/up + swiglu + down, per layer)", out, flush=True)
    return out
