"""MLX's one-row matmul (its CUDA gemv) with more loads in flight: same bits, faster on the small matrices?

The 8B shape's q/k/v (6144 x 4096) and o (4096 x 4096) products run at ~40-50% of the H200's HBM peak in
MLX's gemv (benchmarks/gemv_bandwidth, BENCHMARKS.md h6g). This kernel keeps MLX's arithmetic exactly
(mlx/backend/cuda/gemms/gemv.cu: a warp per output row, lane l adding elements NPT*l + 32*NPT*t in
order into an fp32 sum, then cooperative_groups::reduce and one rounding), so each output is MLX's bit
for bit, and changes only when loads are issued: U chunks of each of R rows a warp are loaded before
any of them is added. `run()` checks it against `x @ w.T` and times it in a chain of 36 products of
each 8B matrix shape (36 distinct weights, so they come from HBM, each output feeding the next input)
for several (R, U), against MLX's own product.

    python -m benchmarks.gemv_exact          # CUDA only (step_overhead --gemv runs it)
"""
from __future__ import annotations

import time

import mlx.core as mx

_HEADER = """
#include <cooperative_groups/reduce.h>
"""

_SOURCE = """
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int N = w_shape[0];
  const int K = w_shape[1];
  const int row0 = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * R;
  if (row0 >= N) {
    return;
  }
  const int lane = warp.thread_rank();
  float sum[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    sum[r] = 0.f;
  }
  for (int c0 = NPT * lane; c0 < K; c0 += 32 * NPT * U) {
    AlignedVector<T, NPT> m[R][U];
    AlignedVector<T, NPT> v[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int col = c0 + u * 32 * NPT;
      if (col < K) {
        v[u] = unsafe_load_vector<NPT>(x + col, 0);
#pragma unroll
        for (int r = 0; r < R; r++) {
          const int row = min(row0 + r, N - 1);
          m[r][u] = unsafe_load_vector<NPT>(w + (size_t)row * K + col, 0);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int col = c0 + u * 32 * NPT;
      if (col < K) {
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
          for (int j = 0; j < NPT; ++j) {
            sum[r] += static_cast<float>(m[r][u][j]) * static_cast<float>(v[u][j]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++) {
    float s = cg::reduce(warp, sum[r], cg::plus<float>{});
    if (lane == 0 && row0 + r < N) {
      out[row0 + r] = static_cast<T>(s);
    }
  }
"""

_kernel = None


def gemv(x: mx.array, w: mx.array, r: int = 1, u: int = 4, warps: int = 8) -> mx.array:
    """x [..., K] (one row) @ w.T, w [N, K] bf16 / fp16 with K % 128 == 0 (MLX's 4-element split)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mtplx_gemv_exact", input_names=["x", "w"], output_names=["out"],
                                      source=_SOURCE, header=_HEADER)
    n, k = w.shape
    assert k % 128 == 0
    rows_a_block = warps * r
    (out,) = _kernel(inputs=[x.reshape(k), w], template=[("T", w.dtype), ("NPT", 4), ("R", r), ("U", u)],
                     grid=(-(-n // rows_a_block) * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
                     output_shapes=[(n,)], output_dtypes=[w.dtype])
    return out.reshape(*x.shape[:-1], n)


SHAPES_8B = {"q/k/v stacked": (6144, 4096), "o": (4096, 4096), "gate/up stacked": (24576, 4096), "down": (4096, 12288)}
TILES = ((1, 4), (1, 8), (2, 4), (1, 16), (2, 8))


def _time(fn, x, repeats):
    mx.eval(fn(x))
    mx.eval(fn(x))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn(x))
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def run(layers: int = 36, repeats: int = 15) -> list:
    rows = []
    for name, (n, k) in SHAPES_8B.items():
        ws = [(0.02 * mx.random.normal((n, k))).astype(mx.bfloat16) for _ in range(layers)]
        mx.eval(ws)
        x = mx.random.normal((1, 1, k)).astype(mx.bfloat16)
        ok = all(mx.array_equal(gemv(x, ws[0], r, u), x @ ws[0].T).item() for r, u in TILES)

        def chain(mm):
            def f(h):
                for w in ws:
                    y = mm(h, w)
                    h = y[..., :k] if n >= k else mx.concatenate([y] * (k // n), axis=-1)
                return h
            return mx.compile(f)

        row = {"matrix": f"{name} ({n} x {k})", "bit-identical (every tiling)": ok,
               "MLX us": 1e6 * _time(chain(lambda h, w: h @ w.T), x, repeats) / layers}
        for r, u in TILES:
            row[f"R{r} U{u} us"] = 1e6 * _time(chain(lambda h, w, r=r, u=u: gemv(h, w, r, u)), x, repeats) / layers
        row["GB/s MLX"] = n * k * 2 / row["MLX us"] / 1e3
        rows.append(row)
        print("gemv_exact", {a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()}, flush=True)
        ws = []  # (the next shape's weights replace these)
    return rows


if __name__ == "__main__":
    run()
