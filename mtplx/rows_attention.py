"""Attention for a few new tokens per row over a capacity-bucket KV cache, each row to its own length.

The batch cache (cache.py) writes every row at its own offset and, for rows of different
lengths and inside compiled verify programs, attends over the whole capacity bucket under a
[B, 1, N, cap] boolean mask. On CUDA, MLX has no fused kernel for a boolean mask (its vector
kernel takes none), so each layer falls back to matmul, select, softmax, matmul. This kernel is
MLX's one-pass vector attention kernel (scaled_dot_product_attention.cu, `kernel_sdpav_1pass`,
causal) with the key count read per row from the lengths array: query i of row b reads keys
0..lengths[b] + i, exactly what MLX's kernel computes over that row's exact slice (up to 1024
keys, where MLX keeps the one-pass kernel; past that MLX splits the keys in two passes and this
kernel stays one pass: the same softmax, summed in another order).

`install(model)` points the model's attention modules at `attention`, which takes this kernel
for a RowKVCache's own mask on CUDA and otherwise calls mlx-lm's function unchanged.
"""

from __future__ import annotations

import sys

import mlx.core as mx


HEAD_DIMS = (64, 96, 128)
# MLX's vector kernel takes query lengths < 4; here each query is its own block (grid y), so the
# limit is only where a verify stops being "a few tokens": 8 covers speculative depths up to 7
# (an MTP / draft verify of depth 3 is 4 queries, which otherwise fall back to matmul + select +
# softmax + matmul under the boolean mask in every layer)
MAX_QUERIES = 8

_HEADER = "#include <cooperative_groups/reduce.h>\n"
_SOURCE = """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int VPT = D / BD;
  typedef float U;
  U qv[VPT];
  U kv[VPT];
  U o[VPT];
  __shared__ U outputs[BN][BD + 1];
  __shared__ U max_scores[BN];
  __shared__ U sum_exp_scores[BN];

  const U scale_log2 = (U)((double)scale[0] * 1.4426950408889634);
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();

  const int Hq = q_shape[1];
  const int L = q_shape[2];
  const int Hk = k_shape[1];
  const int cap = k_shape[2];
  const int batch_idx = blockIdx.z;
  const int head_idx = blockIdx.x;
  const int kv_head_idx = head_idx / (Hq / Hk);
  const int q_seq_idx = blockIdx.y;
  const int kL = lengths[batch_idx] + q_seq_idx + 1;  // this query's keys: 0 .. length + i

  const T* Q = q + (((size_t)batch_idx * Hq + head_idx) * L + q_seq_idx) * D;
  const T* K = k + (((size_t)batch_idx * Hk + kv_head_idx) * cap + warp_idx) * D;
  const T* V = v + (((size_t)batch_idx * Hk + kv_head_idx) * cap + warp_idx) * D;
  T* O = out + (((size_t)batch_idx * Hq + head_idx) * L + q_seq_idx) * D;

#pragma unroll
  for (int i = 0; i < VPT; i++) {
    qv[i] = scale_log2 * static_cast<U>(Q[VPT * lane_idx + i]);
  }
#pragma unroll
  for (int i = 0; i < VPT; i++) {
    o[i] = 0.f;
  }
  U max_score = Limits<U>::finite_min();
  U sum_exp_score = 0.f;

  for (int i = warp_idx; i < kL; i += BN) {
#pragma unroll
    for (int j = 0; j < VPT; j++) {
      kv[j] = K[VPT * lane_idx + j];
    }
    U score = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
      score += qv[j] * kv[j];
    }
    score = cg::reduce(warp, score, cg::plus<U>());
    U new_max = max(max_score, score);
    U factor = exp2f(max_score - new_max);
    U exp_score = exp2f(score - new_max);
    max_score = new_max;
    sum_exp_score = sum_exp_score * factor + exp_score;
#pragma unroll
    for (int j = 0; j < VPT; j++) {
      o[j] = o[j] * factor + exp_score * static_cast<U>(V[VPT * lane_idx + j]);
    }
    K += BN * D;
    V += BN * D;
  }

  if (lane_idx == 0) {
    max_scores[warp_idx] = max_score;
    sum_exp_scores[warp_idx] = sum_exp_score;
  }
  block.sync();
  max_score = max_scores[lane_idx];
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  sum_exp_score = cg::reduce(warp, sum_exp_scores[lane_idx] * factor, cg::plus<U>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);
#pragma unroll
  for (int i = 0; i < VPT; i++) {
    outputs[lane_idx][warp_idx] = o[i];
    block.sync();
    U ot = outputs[warp_idx][lane_idx] * factor;
    o[i] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score;
    block.sync();
  }
  if (lane_idx == 0) {
#pragma unroll
    for (int i = 0; i < VPT; i++) {
      O[VPT * warp_idx + i] = static_cast<T>(o[i]);
    }
  }
"""

_kernel = None
_scales = {}
_on_cuda = None


def cuda_ready() -> bool:
    """Whether arrays run on MLX's CUDA backend (the kernel's only home)."""
    global _on_cuda
    if _on_cuda is None:
        _on_cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and mx.default_device() == mx.gpu)
    return _on_cuda


def usable(q: mx.array, k: mx.array, v: mx.array) -> bool:
    B, Hq, L, D = q.shape
    return (cuda_ready() and L <= MAX_QUERIES and D in HEAD_DIMS and v.shape[-1] == D and k.shape[-1] == D
            and Hq % k.shape[1] == 0 and q.dtype in (mx.bfloat16, mx.float16, mx.float32) and k.dtype == q.dtype)


def rows_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, lengths: mx.array) -> mx.array:
    """softmax(q k^T * scale) v where query i of row b reads keys 0..lengths[b] + i of k/v
    [B, H_kv, cap, D] (the rest of the bucket is never read). q: [B, H_q, L, D], L <= MAX_QUERIES."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mtplx_rows_attention", input_names=["q", "k", "v", "lengths", "scale"],
                                      output_names=["out"], source=_SOURCE, header=_HEADER)
    B, Hq, L, D = q.shape
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    (out,) = _kernel(inputs=[q, k, v, lengths.astype(mx.int32), _scales[scale]],
                     template=[("T", q.dtype), ("D", D)], grid=(Hq * 1024, L, B), threadgroup=(1024, 1, 1),
                     output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out


# -- plugging it into mlx-lm model code ------------------------------------------------------------
_original = None


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with `rows_attention` for a RowKVCache's own mask."""
    from .cache import RowKVCache

    if (sinks is None and isinstance(cache, RowKVCache) and mask is not None and mask is cache.rows.mask
            and usable(queries, keys, values)):
        return rows_attention(queries, keys, values, scale, cache.rows.device)
    return _original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install(model) -> int:
    """Point the model's attention modules' `scaled_dot_product_attention` at `attention` (their
    module's global; everything else keeps mlx-lm's). Returns how many modules; 0 off CUDA."""
    global _original
    from mlx_lm.models import base

    if not cuda_ready():
        return 0
    _original = _original or base.scaled_dot_product_attention
    done = set()
    for _, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is None or mod.__name__ in done:
            continue
        if getattr(mod, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            mod.scaled_dot_product_attention = attention
            done.add(mod.__name__)
    return len(done)


def uninstall() -> None:
    from mlx_lm.models import base

    for mod in list(sys.modules.values()):
        if getattr(mod, "scaled_dot_product_attention", None) is attention:
            mod.scaled_dot_product_attention = base.scaled_dot_product_attention
