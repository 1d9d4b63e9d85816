"""One-row matrix-vector products on CUDA with more loads in flight than MLX's own gemv.

A decode step at one stream is a chain of `x @ W.T` with one row of x: MLX's CUDA gemv gives
each output row a warp whose lanes load 4 elements at a time and add them into a float sum, one
load in flight per lane. On a large GPU that leaves HBM idle between loads. This kernel keeps
MLX's arithmetic exactly (same lane-to-column assignment, the same float accumulation order,
the same warp reduction), so its output is bit-identical, but issues UNROLL loads per lane before
adding any of them. `decode_anatomy` checks the bit-identity on the device before timing it.

`matvec(x, w)` uses it for one row of a bf16/fp16 x on CUDA when the columns are a multiple of
128 (MLX's own condition for its widest gemv); everything else is `x @ w.T`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

LANE_ELEMS = 4  # MLX gemv's n_per_thread for K % 128 == 0
ROWS_PER_BLOCK = 4
UNROLL = 8

_HEADER = "#include <cooperative_groups/reduce.h>\n"
_SOURCE = """
  constexpr int STEP = 32 * NPT;
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int N = w_shape[0];
  const int K = w_shape[1];
  const int row = blockIdx.x * ROWS + threadIdx.y;
  if (row < N) {
    const T* wr = w + (size_t)row * K;
    float sum = 0.0f;
    int col = NPT * (int)warp.thread_rank();
    for (; col + (UNROLL - 1) * STEP < K; col += UNROLL * STEP) {
      AlignedVector<T, NPT> a[UNROLL];
      AlignedVector<T, NPT> b[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        a[u] = unsafe_load_vector<NPT>(wr + col + u * STEP, 0);
        b[u] = unsafe_load_vector<NPT>(x + col + u * STEP, 0);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int j = 0; j < NPT; ++j) {
          sum += static_cast<float>(a[u][j]) * static_cast<float>(b[u][j]);
        }
      }
    }
    for (; col < K; col += STEP) {
      auto a = unsafe_load_vector<NPT>(wr + col, 0);
      auto b = unsafe_load_vector<NPT>(x + col, 0);
#pragma unroll
      for (int j = 0; j < NPT; ++j) {
        sum += static_cast<float>(a[j]) * static_cast<float>(b[j]);
      }
    }
    sum = cg::reduce(warp, sum, cg::plus<float>{});
    if (warp.thread_rank() == 0) {
      out[row] = static_cast<T>(sum);
    }
  }
"""

_kernel = None
_on_cuda = None


def cuda_ready() -> bool:
    global _on_cuda
    if _on_cuda is None:
        _on_cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and mx.default_device() == mx.gpu)
    return _on_cuda


def usable(x: mx.array, w: mx.array) -> bool:
    """Whether `matvec` runs the kernel for x [..., K] against w [N, K]."""
    K = w.shape[-1]
    return (cuda_ready() and w.ndim == 2 and x.shape[-1] == K and x.size == K and K % (32 * LANE_ELEMS) == 0
            and x.dtype == w.dtype and w.dtype in (mx.bfloat16, mx.float16))


def matvec(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T, with the kernel when x has one row (see `usable`)."""
    if not usable(x, w):
        return x @ w.T
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mtplx_gemv", input_names=["w", "x"], output_names=["out"],
                                      source=_SOURCE, header=_HEADER)
    N = w.shape[0]
    blocks = -(-N // ROWS_PER_BLOCK)
    (out,) = _kernel(inputs=[w, x.reshape(-1)], template=[("T", w.dtype), ("NPT", LANE_ELEMS), ("ROWS", ROWS_PER_BLOCK), ("UNROLL", UNROLL)],
                     grid=(32 * blocks, ROWS_PER_BLOCK, 1), threadgroup=(32, ROWS_PER_BLOCK, 1),
                     output_shapes=[(N,)], output_dtypes=[w.dtype])
    return out.reshape(x.shape[:-1] + (N,))


class GemvLinear(nn.Linear):
    """nn.Linear without bias whose one-row products go through `matvec` (the class is swapped onto
    an existing instance; its weight stays where it was)."""

    def __call__(self, x):
        return matvec(x, self["weight"])


class GemvEmbedding(nn.Embedding):
    """nn.Embedding whose `as_linear` (a tied output head) goes through `matvec`."""

    def as_linear(self, x):
        return matvec(x, self.weight)


SWAPS = {nn.Linear: GemvLinear, nn.Embedding: GemvEmbedding}


def _swappable(m) -> bool:
    return type(m) in SWAPS and "bias" not in m


def mismatch(model):
    """The first weight (name) whose kernel product differs from MLX's matmul by one bit, else None."""
    seen = set()
    for name, m in model.named_modules():
        if not _swappable(m) or m.weight.shape in seen:
            continue
        w = m.weight
        seen.add(w.shape)
        x = mx.random.normal((1, 1, w.shape[1]), key=mx.random.key(len(seen))).astype(w.dtype)
        if usable(x, w) and not mx.array_equal(matvec(x, w), x @ w.T).item():
            return name
    return None


def install_gemv(model, check: bool = True) -> int:
    """Swap unquantized bias-free Linear layers (and embeddings, for a tied head) to the kernel;
    returns how many (0 off CUDA). With `check`, first compare the kernel with MLX's matmul on one
    weight of each shape and install nothing if any result differs or the kernel does not build."""
    if not cuda_ready():
        return 0
    if check:
        try:
            if mismatch(model) is not None:
                return 0
        except Exception:  # noqa: BLE001 (a kernel that does not build: MLX's own gemv stays)
            return 0
    n = 0
    for _, m in model.named_modules():
        if _swappable(m):
            m.__class__ = SWAPS[type(m)]
            n += 1
    return n


def uninstall_gemv(model) -> None:
    back = {v: k for k, v in SWAPS.items()}
    for _, m in model.named_modules():
        if type(m) in back:
            m.__class__ = back[type(m)]
