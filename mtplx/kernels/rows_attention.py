"""Attention for a few new tokens per row over a capacity-bucket KV cache, each row to its own length.

MLX's CUDA backend has no fused kernel for the batch cache's mask. Query i of row b reads keys
0..lengths[b] + i with the arithmetic of MLX's one-pass vector kernel, bit for bit MLX's result over
that slice whatever shares its block (greedy speculation stays token-identical). At several queries it
reads through strides and writes [B, L, H_q, D], copying nothing (an MTP round: 5.79 ms, 7.75, H200)."""

from __future__ import annotations

import sys

import mlx.core as mx

from ..cache import RowKVCache
from . import device, kernel_cache
from .device import cuda_ready


HEAD_DIMS = (64, 96, 128)
MAX_QUERIES = 8  # MLX's vector kernel takes fewer than 4; 8 covers verifies up to depth 7
CHUNK_MOST = {64: 8, 96: 5, 128: 4}  # most queries a block carries, by head dim (a lane's registers)
CHUNK = {64: 2, 96: 4, 128: 4}  # queries a block where a launch takes chunks: the H200's fastest
SPREAD_BLOCKS = 528  # up to this many blocks, a block per query (two waves of two an SM on 132 SMs)

_HEADER = "#include <cooperative_groups/reduce.h>\n"
_SOURCE = """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int VPT = D / BD;
  typedef float U;
  __shared__ U qs[QB][D];
  __shared__ U outputs[QB][BN][BD + 1];
  __shared__ U max_scores[QB][BN];
  __shared__ U sum_exp_scores[QB][BN];
  __shared__ int limits[QB];  // key counts: 0 for the chunk's unused places
  U kv[VPT];
  U vv[VPT];
  U o[QB][VPT];
  U max_score[QB];
  U sum_exp_score[QB];

  const U scale_log2 = (U)((double)scale[0] * 1.4426950408889634);
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();

  const int Hq = q_shape[1];
  const int L = q_shape[2];
  const int Hk = k_shape[1];
  const int cap = k_shape[2];
  const int G = Hq / Hk;
  const int batch_idx = blockIdx.z;
  const int kv_head_idx = blockIdx.y;
  const int first = blockIdx.x * QB;  // this block's queries: t = first .. first + nq - 1 of the
  const int nq = min(QB, G * L - first);  // KV head's G x L, t = g * L + i (head kv * G + g, query i)
  const int base = lengths[batch_idx];  // query i reads keys 0 .. base + i

  // The chunk's queries, scaled as MLX's kernel scales them, into shared memory.
  for (int e = threadIdx.x; e < QB * D; e += BN * BD) {
    const int c = e / D;
    const int t = first + c;
    U x = 0.f;
    if (c < nq) {
      x = scale_log2 * static_cast<U>(q[(((size_t)batch_idx * Hq + kv_head_idx * G + t / L) * L + t % L) * D + e % D]);
    }
    qs[c][e % D] = x;
  }
  int most = 0;  // the chunk's longest key count
#pragma unroll
  for (int c = 0; c < QB; c++) {
    const int n = c < nq ? base + (first + c) % L + 1 : 0;
    most = max(most, n);
    if (threadIdx.x == 0) {
      limits[c] = n;
    }
#pragma unroll
    for (int j = 0; j < VPT; j++) {
      o[c][j] = 0.f;
    }
    max_score[c] = Limits<U>::finite_min();
    sum_exp_score[c] = 0.f;
  }
  block.sync();

  const T* K = k + (((size_t)batch_idx * Hk + kv_head_idx) * cap + warp_idx) * D;
  const T* V = v + (((size_t)batch_idx * Hk + kv_head_idx) * cap + warp_idx) * D;
  for (int i = warp_idx; i < most; i += BN) {
#pragma unroll
    for (int j = 0; j < VPT; j++) {
      kv[j] = K[VPT * lane_idx + j];
      vv[j] = static_cast<U>(V[VPT * lane_idx + j]);
    }
#pragma unroll
    for (int c = 0; c < QB; c++) {
      if (i < limits[c]) {  // the same for the whole warp
        U score = 0.f;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
          score += qs[c][VPT * lane_idx + j] * kv[j];
        }
        score = cg::reduce(warp, score, cg::plus<U>());
        U new_max = max(max_score[c], score);
        U factor = exp2f(max_score[c] - new_max);
        U exp_score = exp2f(score - new_max);
        max_score[c] = new_max;
        sum_exp_score[c] = sum_exp_score[c] * factor + exp_score;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
          o[c][j] = o[c][j] * factor + exp_score * vv[j];
        }
      }
    }
    K += BN * D;
    V += BN * D;
  }

  // Across the warps, per query as MLX's kernel does (max_score / sum_exp_score become the
  // warp's rescale factor and the query's 1 / sum).
  if (lane_idx == 0) {
#pragma unroll
    for (int c = 0; c < QB; c++) {
      max_scores[c][warp_idx] = max_score[c];
      sum_exp_scores[c][warp_idx] = sum_exp_score[c];
    }
  }
  block.sync();
#pragma unroll
  for (int c = 0; c < QB; c++) {
    if (c < nq) {
      U m = max_scores[c][lane_idx];
      U new_max = cg::reduce(warp, m, cg::greater<U>());
      U factor = exp2f(m - new_max);
      U s = cg::reduce(warp, sum_exp_scores[c][lane_idx] * factor, cg::plus<U>());
      max_score[c] = factor;
      sum_exp_score[c] = s == 0 ? 0 : __frcp_rn(s);
    }
  }
#pragma unroll
  for (int j = 0; j < VPT; j++) {
#pragma unroll
    for (int c = 0; c < QB; c++) {
      outputs[c][lane_idx][warp_idx] = o[c][j];
    }
    block.sync();
#pragma unroll
    for (int c = 0; c < QB; c++) {
      if (c < nq) {
        U ot = outputs[c][warp_idx][lane_idx] * max_score[c];
        o[c][j] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score[c];
      }
    }
    block.sync();
  }
  if (lane_idx == 0) {
#pragma unroll
    for (int c = 0; c < QB; c++) {
      if (c < nq) {
        const int t = first + c;
        T* O = out + (((size_t)batch_idx * Hq + kv_head_idx * G + t / L) * L + t % L) * D;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
          O[VPT * warp_idx + j] = static_cast<T>(o[c][j]);
        }
      }
    }
  }
"""

_REPLACE = (  # (row-contiguous indexing, strided indexing): each occurs once in _SOURCE
    ("q[(((size_t)batch_idx * Hq + kv_head_idx * G + t / L) * L + t % L) * D + e % D]",
     "q[batch_idx * q_strides[0] + (kv_head_idx * G + t / L) * q_strides[1] + (t % L) * q_strides[2]\n"
     "                                 + (e % D) * q_strides[3]]"),
    ("const T* K = k + (((size_t)batch_idx * Hk + kv_head_idx) * cap + warp_idx) * D;",
     "const T* K = k + batch_idx * k_strides[0] + kv_head_idx * k_strides[1] + warp_idx * k_strides[2];"),
    ("const T* V = v + (((size_t)batch_idx * Hk + kv_head_idx) * cap + warp_idx) * D;",
     "const T* V = v + batch_idx * v_strides[0] + kv_head_idx * v_strides[1] + warp_idx * v_strides[2];"),
    ("kv[j] = K[VPT * lane_idx + j];", "kv[j] = K[(VPT * lane_idx + j) * k_strides[3]];"),
    ("vv[j] = static_cast<U>(V[VPT * lane_idx + j]);", "vv[j] = static_cast<U>(V[(VPT * lane_idx + j) * v_strides[3]]);"),
    ("K += BN * D;", "K += BN * k_strides[2];"),
    ("V += BN * D;", "V += BN * v_strides[2];"),
    ("T* O = out + (((size_t)batch_idx * Hq + kv_head_idx * G + t / L) * L + t % L) * D;",
     "T* O = out + (((size_t)batch_idx * L + t % L) * Hq + kv_head_idx * G + t / L) * D;  // [B, L, Hq, D]"),
)


def _strided_source() -> str:
    src = _SOURCE
    for old, new in _REPLACE:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return src


_STRIDED_SOURCE = _strided_source()
# the row-contiguous kernel at one query, the strided one at several (by `strided`)
_KERNELS = {strided: kernel_cache.cuda_kernel(
    name="mtplx_rows_attention" + ("_strided" if strided else ""), input_names=["q", "k", "v", "lengths", "scale"],
    output_names=["out"], source=_STRIDED_SOURCE if strided else _SOURCE, header=_HEADER,
    ensure_row_contiguous=not strided) for strided in (False, True)}
_scales = {}


def usable(q: mx.array, k: mx.array, v: mx.array) -> bool:
    B, Hq, L, D = q.shape
    return (cuda_ready() and L <= MAX_QUERIES and D in HEAD_DIMS and v.shape[-1] == D and k.shape[-1] == D
            and Hq % k.shape[1] == 0 and q.dtype in (mx.bfloat16, mx.float16, mx.float32) and k.dtype == q.dtype)


def split(B: int, Hk: int, queries: int, D: int) -> tuple[int, int]:
    """(queries a block, blocks a KV head) for G x L `queries` per (row, KV head)."""
    if B * Hk * queries <= SPREAD_BLOCKS:
        return 1, queries
    per = min(CHUNK[D], queries)
    return per, -(-queries // per)


def rows_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, lengths: mx.array) -> mx.array:
    """softmax(q k^T * scale) v, query i of row b over keys 0..lengths[b] + i of k/v [B, H_kv, cap, D]."""
    B, Hq, L, D = q.shape
    Hk = k.shape[1]
    per, blocks = split(B, Hk, Hq // Hk * L, D)
    key = (scale, device.pads())
    if key not in _scales:
        _scales[key] = device.resident_constant([scale])
    strided = L > 1  # at one query the layouts are the same
    shape = (B, L, Hq, D) if strided else q.shape
    (out,) = _KERNELS[strided](inputs=[q, k, v, lengths.astype(mx.int32), _scales[key]],
                               template=[("T", q.dtype), ("D", D), ("QB", per)], grid=(blocks * 1024, Hk, B),
                               threadgroup=(1024, 1, 1), output_shapes=[shape], output_dtypes=[q.dtype])
    return out.transpose(0, 2, 1, 3) if strided else out


_original = None


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with `rows_attention` for a RowKVCache's own mask."""
    if (sinks is None and isinstance(cache, RowKVCache) and mask is not None and mask is cache.rows.mask
            and usable(queries, keys, values)):
        return rows_attention(queries, keys, values, scale, cache.rows.resident())
    return _original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install(model) -> int:
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
