"""Attention for a few new tokens per row over a capacity-bucket KV cache, each row to its own length.

The batch cache (cache.py) writes every row at its own offset and, for rows of different
lengths and inside compiled verify programs, attends over the whole capacity bucket under a
[B, 1, N, cap] boolean mask. On CUDA, MLX has no fused kernel for a boolean mask (its vector
kernel takes none), so each layer falls back to matmul, select, softmax, matmul. This kernel
computes every query with the arithmetic of MLX's one-pass vector attention kernel
(scaled_dot_product_attention.cu, `kernel_sdpav_1pass`, causal), with the key count read per row
from the lengths array: query i of row b reads keys 0..lengths[b] + i, and its result is bit for
bit what MLX's kernel computes over that row's exact slice (up to 1024 keys, where MLX keeps the
one-pass kernel; past that MLX splits the keys in two passes and this kernel stays one pass: the
same softmax, summed in another order, and still the same for every query count here).

Layout: a block of 32 warps x 32 lanes per (row, KV head, chunk of that KV head's G x L queries;
G = H_q / H_kv). Warp w reads keys w, w + 32, ... once (lane l holds elements l * D/32 ..) and
applies each key to every query of the chunk: per query, the lane's products summed in element
order, the warp's butterfly sum, the warp's running max / sum / output update, and at the end the
same cross-warp reductions as MLX's kernel. A key past a query's limit is skipped for that query.
So a query's result does not depend on how many queries share its block, nor on L or G: the plain
step (one query) and a verify (several) compute it alike, which keeps greedy speculation
token-identical to plain decoding. A block per query (chunks of one) is MLX's own layout; larger
chunks read each key once for several queries (a width-32 verify of 4 queries with 9 heads over 3
KV heads was 1,152 blocks each re-reading its KV head, 12 reads of every key). `split` picks the
chunk from what the H200 measured (see CHUNK): a block per query for launches that fill the GPU
in about two waves anyway, chunks of CHUNK[D] past that (at most CHUNK_MOST, a lane's registers).
Measured there (benchmarks/attn_check, us a layer): SmolLM2's width-32 verify of 4 queries 58.8
-> 53.1, Qwen3-8B's 265 -> 170; MLX's masked fallback still takes 42 / 97 (it is not exact against
the plain step, this is).

`install(model)` points the model's attention modules at `attention`, which takes this kernel
for a RowKVCache's own mask on CUDA and otherwise calls mlx-lm's function unchanged.
"""

from __future__ import annotations

import sys

import mlx.core as mx

from . import kernel_cache, small_ops


HEAD_DIMS = (64, 96, 128)
# MLX's vector kernel takes query lengths < 4; here the limit is only where a verify stops being
# "a few tokens": 8 covers speculative depths up to 7 (an MTP / draft verify of depth 3 is 4
# queries, which otherwise fall back to matmul + select + softmax + matmul under the boolean mask
# in every layer)
MAX_QUERIES = 8
# Queries one block carries, by head dim: a lane keeps D/32 outputs plus a running max and sum per
# query in registers (the queries themselves sit in shared memory), and a 1024-thread block has 64
# registers a lane: at most ~32 of them for the queries' state.
CHUNK_MOST = {64: 8, 96: 5, 128: 4}
# Queries a block where a launch takes chunks of several, by head dim (H200, session 6, benchmarks/
# attn_check's table): at D 64 two queries keep a lane at 32 registers, so two 1024-thread blocks
# share an SM; at D 96 / 128 any chunk of several holds an SM alone, and four did best.
CHUNK = {64: 2, 96: 4, 128: 4}
# A launch of at most this many blocks keeps a block per query (MLX's layout): about two waves of two
# blocks an SM on an H100 / H200 (132 SMs), where chunks only lengthen each block.
SPREAD_BLOCKS = 528

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

# The kernel reading q, k, v through their strides and writing [B, L, H_q, D] (`rows_attention`). At several
# queries a row q is a transposed view ([B, L, H, D] data: a slice of the projection, through RoPE), which the
# row-contiguous kernel had MLX copy first, and its [B, H, L, D] result the model copied back to [B, L, H * D]:
# two copies a layer (H200, session 8: ~66 copy_g_nd a one-stream MTP round). The same arithmetic: the same bits.
# On: H200, session 9 window 1 (with fusion.HEAD_GEMV, one-stream MTP depth 3, 5 interleaved repeats): 1.65x plain
# against 1.47x, 5.79 ms a round against 7.75; the trace 66 copy_g_nd a round fewer (round_trace `:...STRIDED=0`)
STRIDED = True
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
_kernel = None
_strided_kernel = None
_scales = {}
_on_cuda = None

# MLX's CUDA allocator gives arrays of at most 8 bytes (a scalar, the lengths of one row) managed memory from
# a small shared pool (mlx/backend/cuda/allocator.cpp, small_block_size), which the host also touches (it
# reads each step's token from there): a kernel that reads such an array then waits on a page that is
# not on the GPU (H200, session 7 window 1: the add + norm kernel 8.1 us against 3.1 for MLX's rms_norm,
# which takes eps as a parameter; a kernel doing atomics on a 4-byte array ~1 ms). Constants and per-step
# small arrays the kernels read are made larger than that (`resident_constant`, `padded`, and
# row_lengths.RowLengths.resident), so they live in device memory.
SMALL_POOL_BYTES = 8
PAD_SMALL = True  # benchmarks/decode_anatomy turns it off to measure without


def pads() -> bool:
    """Whether small arrays are padded: on CUDA (the CPU backend has no such pool), unless PAD_SMALL is off."""
    return PAD_SMALL and cuda_ready()


def resident_constant(values, dtype=mx.float32) -> mx.array:
    """`values` (a sequence) as a device array, on CUDA padded with zeros past SMALL_POOL_BYTES (kernels read
    the first len(values) elements)."""
    n = len(values)
    pad = max(0, -(-(SMALL_POOL_BYTES + 1) // dtype.size) - n) if pads() else 0
    return mx.array(list(values) + [0] * pad, dtype=dtype)


def padded(a: mx.array):
    """A padded copy of `a` (1-D) large enough to stay out of MLX's managed pool, or None where `a` is out
    of it already (or `pads()` is false). Its first a.size elements are `a`; past them zeros, or with
    small_ops.FEWER copies of a[0]: one gather by a constant index (a fill and two copies otherwise, three
    kernels: at one stream a round pads the lengths of each of its forwards and draft steps)."""
    if not pads() or a.nbytes > SMALL_POOL_BYTES or a.ndim != 1:
        return None
    n = -(-(SMALL_POOL_BYTES + 1) // a.dtype.size)
    if small_ops.FEWER:
        return mx.take(a, small_ops.pad_index(a.size, n))
    return mx.concatenate([a, mx.zeros((n - a.size,), dtype=a.dtype)])


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


def split(B: int, Hk: int, queries: int, D: int) -> tuple[int, int]:
    """(queries a block, blocks a KV head) for `queries` = G x L queries per (row, KV head): a block
    per query up to SPREAD_BLOCKS blocks, else chunks of CHUNK[D]."""
    if B * Hk * queries <= SPREAD_BLOCKS:
        return 1, queries
    per = min(CHUNK[D], queries)
    return per, -(-queries // per)


def _kernels(strided: bool):
    global _kernel, _strided_kernel
    if _kernel is None:
        _kernel = kernel_cache.cuda_kernel(name="mtplx_rows_attention", input_names=["q", "k", "v", "lengths", "scale"],
                                           output_names=["out"], source=_SOURCE, header=_HEADER)
        _strided_kernel = kernel_cache.cuda_kernel(
            name="mtplx_rows_attention_strided", input_names=["q", "k", "v", "lengths", "scale"], output_names=["out"],
            source=_STRIDED_SOURCE, header=_HEADER, ensure_row_contiguous=False)
    return _strided_kernel if strided else _kernel


def rows_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, lengths: mx.array,
                   per_block: int | None = None) -> mx.array:
    """softmax(q k^T * scale) v where query i of row b reads keys 0..lengths[b] + i of k/v
    [B, H_kv, cap, D] (the rest of the bucket is never read). q: [B, H_q, L, D], L <= MAX_QUERIES.
    `per_block`: queries a block (default `split`'s; benchmarks/attn_check times others; 1 is
    MLX's layout). Every choice gives every query the same bits. With STRIDED (and L > 1) the kernel
    reads q, k, v where they lie and the result [B, H_q, L, D] is a view of a [B, L, H_q, D] array:
    the model's transpose back to [B, L, H_q * D] is then no copy."""
    B, Hq, L, D = q.shape
    Hk = k.shape[1]
    per, blocks = split(B, Hk, Hq // Hk * L, D)
    if per_block is not None:
        per, blocks = per_block, -(-(Hq // Hk * L) // per_block)
    key = (scale, pads())
    if key not in _scales:
        _scales[key] = resident_constant([scale])
    strided = STRIDED and L > 1  # (at one query the layouts are one: MLX copies nothing either way)
    shape = (B, L, Hq, D) if strided else q.shape
    (out,) = _kernels(strided)(inputs=[q, k, v, lengths.astype(mx.int32), _scales[key]],
                               template=[("T", q.dtype), ("D", D), ("QB", per)], grid=(blocks * 1024, Hk, B),
                               threadgroup=(1024, 1, 1), output_shapes=[shape], output_dtypes=[q.dtype])
    return out.transpose(0, 2, 1, 3) if strided else out


# -- plugging it into mlx-lm model code ------------------------------------------------------------
_original = None


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with `rows_attention` for a RowKVCache's own mask."""
    from .cache import RowKVCache

    if (sinks is None and isinstance(cache, RowKVCache) and mask is not None and mask is cache.rows.mask
            and usable(queries, keys, values)):
        return rows_attention(queries, keys, values, scale, cache.rows.resident())
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
