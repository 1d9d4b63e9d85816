"""A decoder layer's small ops as fewer CUDA kernels: residual add + RMSNorm, q/k RMSNorm + RoPE.

At one stream a decode step of an 8B model is ~145 weight matmuls and ~12 small kernels per
layer around them (benchmarks/step_kernels.py counts them); on the H200 each small kernel costs a
few microseconds whatever its size. Two custom kernels take five of them per layer (Qwen3; three
for Llama, which has no q/k norm):

- `add_rms_norm(x, r, w, eps)` -> (x + r, rms_norm(x + r) * w): the residual add and the RMSNorm
  that reads it, one kernel. The block's second residual add is the next block's input add (or the
  final norm's): the block returns the plain sum, lazily, and the next patched block or final norm
  that receives exactly that array takes its two terms instead, so the lone add is never run.
- `qk_norm_rope(q, k, ...)`: q_norm and k_norm (Qwen3) and RoPE on q and k, one kernel, one warp
  per head, writing [B, H, L, D].

Each reproduces MLX's own CUDA arithmetic (rms_norm.cu: the block size, the per-thread order of the
sum of squares, the warp then block reduction; rope.cu: the angle, cos / sin, the rotation), so
the values are meant to be the unfused ops' bit for bit; `benchmarks/step_kernels.py --check`
compares them on the GPU. Every forward of a patched model (prefill, eager and compiled steps,
every verify) takes the same kernels, so plain decoding and speculation see one model.

`install(model)` swaps the classes of the Qwen3 / Llama / Qwen2 blocks, attentions and final norm (the
instances only; models it does not know keep mlx-lm's code); CUDA only. The engine installs it for
Qwen3 (DEFAULT_FAMILIES) since the H200 check (session 6: every case bit-identical in two windows, 8B
one stream 177 vs 166 and 180 vs 178 tok/s; `Engine.use_layer_kernels`, `fusion.decode_paths`). `install(model, reference=True)` runs the
same plumbing with the unfused MLX ops in place of the kernels (how the CPU tests check it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import kernel_cache
from .rows_attention import cuda_ready

_HEADER = "#include <cooperative_groups/reduce.h>\n"

# One block per row, BLOCK threads (MLX's choice for this width, `_norm_layout`); each thread
# reads NR consecutive elements at vector index c * BLOCK + tid for c < CHUNKS.
_ADD_NORM = """
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  constexpr int NW = BLOCK / 32;
  __shared__ float partial[NW];
  const size_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const T* X = x + row * D;
  const T* R = r + row * D;
  T* H = h + row * D;
  T* Y = y + row * D;
  T hv[CHUNKS * NR];
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
#pragma unroll
    for (int j = 0; j < NR; j++) {
      const int i = (c * BLOCK + tid) * NR + j;
      T v = T(0);
      if (i < D) {
        v = X[i] + R[i];
        H[i] = v;
      }
      hv[c * NR + j] = v;
      float t = static_cast<float>(v);
      acc = ACC == 0 ? acc + t * t : __fadd_rn(acc, __fmul_rn(t, t));
    }
  }
  float s = cg::reduce(warp, acc, cg::plus<float>());
  if (NW > 1) {
    if (warp.thread_rank() == 0) {
      partial[warp.meta_group_rank()] = s;
    }
    block.sync();
    s = warp.thread_rank() < warp.meta_group_size() ? partial[warp.thread_rank()] : 0.f;
    s = cg::reduce(warp, s, cg::plus<float>());
  }
  const float n = rsqrt(s / D + eps[0]);
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
#pragma unroll
    for (int j = 0; j < NR; j++) {
      const int i = (c * BLOCK + tid) * NR + j;
      if (i < D) {
        float v = static_cast<float>(hv[c * NR + j]) * n;
        Y[i] = w[i] * static_cast<T>(v);
      }
    }
  }
"""

# One warp per (head, token, row): heads 0..HQ-1 are q's, HQ..HQ+HK-1 k's. params: eps, log2(base),
# scale (float32). offset: int32, read at b * OSTRIDE.
# Both versions of the q/k kernel end alike: each pair (x1, x2) rotated by its angle (rope.cu's
# arithmetic; ROT picks the fma placement), the dimensions past DIMS copied through.
_ROTATION = """
    float theta = pos * inv_freq;
    float costheta = cos(theta);
    float sintheta = sin(theta);
    const int i1 = TRADITIONAL ? 2 * p : p;
    const int i2 = TRADITIONAL ? i1 + 1 : p + HALF;
    float x1 = static_cast<float>(buf[i1]);
    float x2 = static_cast<float>(buf[i2]);
    float rx1, rx2;
    if (ROT == 0) {  // rope.cu's expressions, contracted as the compiler likes (the default)
      rx1 = x1 * costheta - x2 * sintheta;
      rx2 = x1 * sintheta + x2 * costheta;
    } else if (ROT == 1) {
      rx1 = fmaf(x1, costheta, -(x2 * sintheta));
      rx2 = fmaf(x1, sintheta, x2 * costheta);
    } else if (ROT == 2) {
      rx1 = fmaf(-x2, sintheta, x1 * costheta);
      rx2 = fmaf(x2, costheta, x1 * sintheta);
    } else {
      rx1 = __fsub_rn(__fmul_rn(x1, costheta), __fmul_rn(x2, sintheta));
      rx2 = __fadd_rn(__fmul_rn(x1, sintheta), __fmul_rn(x2, costheta));
    }
    dst[i1] = static_cast<T>(rx1);
    dst[i2] = static_cast<T>(rx2);
  }
  for (int i = DIMS + lane; i < D; i += 32) {
    dst[i] = buf[i];
  }
"""

_QK_ROPE = """
  auto warp = cg::tiled_partition<32>(cg::this_thread_block());
  __shared__ T buf[D];
  const int lane = threadIdx.x;
  const int hi = blockIdx.x;
  const int l = blockIdx.y;
  const int b = blockIdx.z;
  const int L = gridDim.y;
  const bool isq = hi < HQ;
  const int head = isq ? hi : hi - HQ;
  const int nh = isq ? HQ : HK;
  const T* src = (isq ? q : k) + (((size_t)b * L + l) * nh + head) * D;
  T* dst = (isq ? q_out : k_out) + (((size_t)b * nh + head) * L + l) * D;
  if (NORM) {
    const T* w = isq ? q_weight : k_weight;
    T xv[NR];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < NR; j++) {
      const int i = lane * NR + j;
      xv[j] = i < D ? src[i] : T(0);
      float t = static_cast<float>(xv[j]);
      acc = ACC == 0 ? acc + t * t : __fadd_rn(acc, __fmul_rn(t, t));
    }
    acc = cg::reduce(warp, acc, cg::plus<float>());
    const float n = rsqrt(acc / D + params[0]);
#pragma unroll
    for (int j = 0; j < NR; j++) {
      const int i = lane * NR + j;
      if (i < D) {
        float v = static_cast<float>(xv[j]) * n;
        buf[i] = w[i] * static_cast<T>(v);
      }
    }
  } else {
    for (int i = lane; i < D; i += 32) {
      buf[i] = src[i];
    }
  }
  __syncwarp();
  constexpr int HALF = DIMS / 2;
  const float pos = params[2] * static_cast<float>(l + offset[b * OSTRIDE]);
  for (int p = lane; p < HALF; p += 32) {
    float d = static_cast<float>(p) / static_cast<float>(HALF);
    float inv_freq = exp2(-d * params[1]);
""" + _ROTATION

# Version 2: the same arithmetic in the same order, with every global load before any global
# store (version 1 interleaves them: the compiler cannot move a load above a store that may alias
# it, so each element's loads waited for the previous store) and 16-byte vector loads / stores
# (MLX's load_vector / store_vector, which fall back to element loads off alignment or past D).
_ADD_NORM_V2 = """
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  constexpr int NW = BLOCK / 32;
  __shared__ float partial[NW];
  const size_t row = blockIdx.x;
  const int tid = threadIdx.x;
  AlignedVector<T, NR> hv[CHUNKS];
  AlignedVector<T, NR> wv[CHUNKS];
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
    const int vi = c * BLOCK + tid;
    auto xa = load_vector<NR>(x + row * D, vi, D, T(0));
    auto ra = load_vector<NR>(r + row * D, vi, D, T(0));
    wv[c] = load_vector<NR>(w, vi, D, T(0));
#pragma unroll
    for (int j = 0; j < NR; j++) {
      hv[c][j] = xa[j] + ra[j];
      float t = static_cast<float>(hv[c][j]);
      acc = ACC == 0 ? acc + t * t : __fadd_rn(acc, __fmul_rn(t, t));
    }
  }
  const float e = eps[0];
  float s = cg::reduce(warp, acc, cg::plus<float>());
  if (NW > 1) {
    if (warp.thread_rank() == 0) {
      partial[warp.meta_group_rank()] = s;
    }
    block.sync();
    s = warp.thread_rank() < warp.meta_group_size() ? partial[warp.thread_rank()] : 0.f;
    s = cg::reduce(warp, s, cg::plus<float>());
  }
  const float n = rsqrt(s / D + e);
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
    const int vi = c * BLOCK + tid;
    store_vector<NR>(h + row * D, vi, hv[c], D);
#pragma unroll
    for (int j = 0; j < NR; j++) {
      float v = static_cast<float>(hv[c][j]) * n;
      hv[c][j] = wv[c][j] * static_cast<T>(v);
    }
    store_vector<NR>(y + row * D, vi, hv[c], D);
  }
"""

_QK_ROPE_V2 = """
  auto warp = cg::tiled_partition<32>(cg::this_thread_block());
  __shared__ T buf[D];
  const int lane = threadIdx.x;
  const int hi = blockIdx.x;
  const int l = blockIdx.y;
  const int b = blockIdx.z;
  const int L = gridDim.y;
  const bool isq = hi < HQ;
  const int head = isq ? hi : hi - HQ;
  const int nh = isq ? HQ : HK;
  const T* src = (isq ? q : k) + (((size_t)b * L + l) * nh + head) * D;
  T* dst = (isq ? q_out : k_out) + (((size_t)b * nh + head) * L + l) * D;
  const float e = params[0];
  const float base2 = params[1];
  const float pos = params[2] * static_cast<float>(l + offset[b * OSTRIDE]);
  if (NORM) {
    auto xv = load_vector<NR>(src, lane, D, T(0));
    auto wv = load_vector<NR>(isq ? q_weight : k_weight, lane, D, T(0));
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < NR; j++) {
      float t = static_cast<float>(xv[j]);
      acc = ACC == 0 ? acc + t * t : __fadd_rn(acc, __fmul_rn(t, t));
    }
    acc = cg::reduce(warp, acc, cg::plus<float>());
    const float n = rsqrt(acc / D + e);
#pragma unroll
    for (int j = 0; j < NR; j++) {
      const int i = lane * NR + j;
      if (i < D) {
        float v = static_cast<float>(xv[j]) * n;
        buf[i] = wv[j] * static_cast<T>(v);
      }
    }
  } else {
    for (int i = lane; i < D; i += 32) {
      buf[i] = src[i];
    }
  }
  __syncwarp();
  constexpr int HALF = DIMS / 2;
  for (int p = lane; p < HALF; p += 32) {
    float d = static_cast<float>(p) / static_cast<float>(HALF);
    float inv_freq = exp2(-d * base2);
""" + _ROTATION

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# the kernels installed models take (each off here runs its unfused ops through the same plumbing)
ENABLED = {"add_rms_norm", "qk_norm_rope"}
# how the kernels write the sum of squares (SQUARES) and the rotation (ROTATION): 0 is MLX's own
# source; the others are the forms it could compile to, which the GPU check tries on a mismatch
SQUARES, ROTATION = 0, 0
# which sources: 1 (checked bit-identical on the H200, session 6 window 2) or 2 (loads first, vector)
VERSION = 1
_kernels = {}
_consts = {}
_no_weight = {}
_log2f = None


def _kernel(name):
    key = (name, VERSION)
    if key not in _kernels:
        v2 = VERSION == 2
        if name == "add_norm":
            _kernels[key] = kernel_cache.cuda_kernel(name="mtplx_add_rms_norm" + ("_v2" if v2 else ""), input_names=["x", "r", "w", "eps"],
                                                output_names=["h", "y"], source=_ADD_NORM_V2 if v2 else _ADD_NORM, header=_HEADER)
        else:
            _kernels[key] = kernel_cache.cuda_kernel(
                name="mtplx_qk_norm_rope" + ("_v2" if v2 else ""), input_names=["q", "k", "q_weight", "k_weight", "offset", "params"],
                output_names=["q_out", "k_out"], source=_QK_ROPE_V2 if v2 else _QK_ROPE, header=_HEADER)
    return _kernels[key]


def _const(*values) -> mx.array:
    """A float32 constant array for the kernels, in device memory (rows_attention.resident_constant)."""
    from .rows_attention import pads, resident_constant

    key = values + (pads(),)
    if key not in _consts:
        _consts[key] = resident_constant(values)
    return _consts[key]


def log2f(x: float) -> float:
    """The C library's float log2, which MLX's RoPE calls on the host for its base (std::log2(float))."""
    global _log2f
    if _log2f is None:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or None)
        _log2f = lib.log2f
        _log2f.restype, _log2f.argtypes = ctypes.c_float, [ctypes.c_float]
    return float(_log2f(x))


def _norm_layout(D: int, itemsize: int):
    """(threads per row, chunks per thread, elements per read): how MLX's rms_norm.cu lays a row out."""
    nr = 16 // itemsize
    nvec = -(-D // nr)
    if D > nr * 128 * 8:
        return 1024, -(-nvec // 1024), nr
    if D <= nr * 64:
        return 64, 1, nr
    if nvec % 128 == 0 and nvec // 128 <= 8:
        return 128, nvec // 128, nr
    if nvec % 64 == 0 and nvec // 64 <= 8:
        return 64, nvec // 64, nr
    return 128, -(-nvec // 128), nr


# -- the two fused ops (kernel on CUDA, the unfused MLX ops otherwise) ---------------------------
def add_rms_norm_reference(x, r, weight, eps):
    h = x + r
    return h, mx.fast.rms_norm(h, weight, eps)


def add_norm_usable(x, r, weight) -> bool:
    return (x.dtype in DTYPES and r.dtype == x.dtype and weight.dtype == x.dtype and x.shape == r.shape
            and weight.ndim == 1 and weight.shape[0] == x.shape[-1])


def add_rms_norm(x: mx.array, r: mx.array, weight: mx.array, eps: float, acc: Optional[int] = None):
    """(x + r, rms_norm(x + r, weight, eps)) as one kernel; the same values as the two ops. `acc`: how
    the sum of squares is written (0: as rms_norm.cu, contracted by the compiler; 1: no fma; default
    SQUARES), for the GPU check to tell which form MLX's build has should the default not match."""
    acc = SQUARES if acc is None else acc
    D = x.shape[-1]
    block, chunks, nr = _norm_layout(D, x.dtype.size)
    rows = x.size // D
    h, y = _kernel("add_norm")(
        inputs=[x, r, weight, _const(float(eps))], template=[("T", x.dtype), ("D", D), ("BLOCK", block), ("CHUNKS", chunks), ("NR", nr), ("ACC", acc)],
        grid=(block * rows, 1, 1), threadgroup=(block, 1, 1), output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, y


def qk_norm_rope_reference(q, k, q_norm, k_norm, rope, offset, n_q, n_kv):
    """mlx-lm's ops: q [B, L, n_q * D] -> [B, n_q, L, D] normed (if q_norm) and rotated; k likewise."""
    B, L, _ = q.shape
    q, k = q.reshape(B, L, n_q, -1), k.reshape(B, L, n_kv, -1)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    return rope(q, offset=offset), rope(k, offset=offset)


def rope_usable(rope) -> bool:
    return type(rope) is nn.RoPE and rope.dims % 2 == 0


def qk_usable(q, k, q_norm, k_norm, rope, n_q, n_kv) -> bool:
    D = q.shape[-1] // n_q
    nr = 16 // q.dtype.size if q.dtype in DTYPES else 0
    ok = (q.dtype in DTYPES and k.dtype == q.dtype and q.ndim == 3 and k.shape[-1] == n_kv * D
          and D <= 32 * nr and rope.dims <= D and rope_usable(rope)
          and q.shape[1] < 65536 and q.shape[0] < 65536)  # tokens and rows are grid y / z
    if ok and q_norm is not None:
        ok = (q_norm.weight.dtype == q.dtype and k_norm.weight.dtype == q.dtype and q_norm.eps == k_norm.eps
              and q_norm.weight.shape == (D,) and k_norm.weight.shape == (D,))
    return ok


def qk_norm_rope(q, k, q_norm, k_norm, rope, offset, n_q, n_kv, rot: Optional[int] = None, acc: Optional[int] = None):
    """`qk_norm_rope_reference` as one kernel (the same values). `rot`: how the rotation is written
    (0: as rope.cu; 1-3: the fma placements it could compile to, for the GPU check; default ROTATION);
    `acc`: as for add_rms_norm."""
    rot, acc = ROTATION if rot is None else rot, SQUARES if acc is None else acc
    B, L, _ = q.shape
    D = q.shape[-1] // n_q
    if isinstance(offset, mx.array):
        stride = 1 if offset.ndim == 1 and offset.shape[0] == B and B > 1 else 0
        off = offset.astype(mx.int32).reshape(-1)
    else:  # the layers of one eager step share one length: one small array per step, not per layer
        if _State.offset[0] != int(offset):
            from .rows_attention import resident_constant

            _State.offset = (int(offset), resident_constant([int(offset)], mx.int32))
        stride, off = 0, _State.offset[1]
    norm = q_norm is not None
    eps = float(q_norm.eps) if norm else 0.0
    params = _const(eps, log2f(rope.base), float(rope.scale))
    if not norm and q.dtype not in _no_weight:  # the kernel reads no weights then, but they are typed T
        _no_weight[q.dtype] = mx.zeros((16,), dtype=q.dtype)  # (past MLX's managed small-array pool)
    qw, kw = (q_norm.weight, k_norm.weight) if norm else (_no_weight[q.dtype], _no_weight[q.dtype])
    q_out, k_out = _kernel("qk")(
        inputs=[q, k, qw, kw, off, params],
        template=[("T", q.dtype), ("D", D), ("HQ", n_q), ("HK", n_kv), ("NR", 16 // q.dtype.size), ("NORM", norm),
                  ("DIMS", rope.dims), ("TRADITIONAL", bool(rope.traditional)), ("OSTRIDE", stride), ("ROT", rot),
                  ("ACC", acc)],
        grid=(32 * (n_q + n_kv), L, B), threadgroup=(32, 1, 1),
        output_shapes=[(B, n_q, L, D), (B, n_kv, L, D)], output_dtypes=[q.dtype, q.dtype])
    return q_out, k_out


# -- plugging them into mlx-lm's Qwen3 / Llama code ---------------------------------------------
class _State:
    reference = False  # True: the unfused ops through the same plumbing (CPU tests)
    # the last patched block's output, lazily x + r, and its two terms: the next patched block (or
    # final norm) that receives exactly that array adds and normalizes in one kernel
    pending = None
    offset = (None, None)  # the last int rope offset and its device array
    o_norm = False  # install(o_norm=True): o_proj + add + norm as one kernel at one row (o_norm_kernel.py)
    o_pending = None  # the last patched attention's (o_proj output, its input, o_proj)


def _add_norm(norm, x, r):
    if not _State.reference and "add_rms_norm" in ENABLED and add_norm_usable(x, r, norm.weight):
        return add_rms_norm(x, r, norm.weight, norm.eps)
    return add_rms_norm_reference(x, r, norm.weight, norm.eps)


def _input_norm(norm, x, plain):
    """(norm(x), x); when `x` is the sum the last patched block returned lazily, from its two
    terms in one kernel (the sum itself is then never run). `plain`: norm's own call."""
    p = _State.pending
    if p is None or p[0] is not x:
        return plain(x), x
    _State.pending = None
    h, y = _fused_add_norm(norm, p[1], p[2], p[3])
    return y, h


def _fused_add_norm(norm, x, r, product):
    """(x + r, norm(x + r)); with o_norm, where `r` is a one-row product's output (product = (r, its input,
    its Linear): o_proj's, or the MLP's down_proj under mlp_kernel), the product, the add and the norm in
    one kernel (o_norm_kernel.py; `r` itself is then never run)."""
    if product is not None and product[0] is r and _State.o_norm and not _State.reference:
        from . import o_norm_kernel

        if o_norm_kernel.usable(product[1], product[2], x, norm):
            return o_norm_kernel.o_add_norm(product[1], product[2].weight, x, norm.weight, norm.eps)
    return _add_norm(norm, x, r)


def _block_call(self, x, mask=None, cache=None):
    xn, x = _input_norm(self.input_layernorm, x, self.input_layernorm)
    attn = self.self_attn(xn, mask, cache)
    o, _State.o_pending = _State.o_pending, None
    h, hn = _fused_add_norm(self.post_attention_layernorm, x, attn, o)
    r = self.mlp(hn)
    out = h + r  # run only if something other than a patched consumer reads it
    _State.pending = (out, h, r, _down_product() if _State.o_norm else None)
    return out


def _down_product():
    """The last one-row MLP output of mlp_kernel's patched MLP as (output, down_proj's input, down_proj)."""
    from . import mlp_kernel

    p, mlp_kernel._State.product = mlp_kernel._State.product, None
    return p


def _final_norm_call(self, x):
    return _input_norm(self, x, lambda a: nn.RMSNorm.__call__(self, a))[0]


def _base(obj):
    return type(obj).__mro__[1]


def _attention_call(self, x, mask=None, cache=None):
    B, L, _ = x.shape
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    offset = cache.offset if cache is not None else 0
    if (not _State.reference and "qk_norm_rope" in ENABLED
            and qk_usable(q, k, q_norm, k_norm, self.rope, self.n_heads, self.n_kv_heads)):
        q, k = qk_norm_rope(q, k, q_norm, k_norm, self.rope, offset, self.n_heads, self.n_kv_heads)
    else:
        q, k = qk_norm_rope_reference(q, k, q_norm, k_norm, self.rope, offset, self.n_heads, self.n_kv_heads)
    v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    sdpa = sys.modules[_base(self).__module__].scaled_dot_product_attention  # rows_attention's, if installed
    out = sdpa(q, k, v, cache=cache, scale=self.scale, mask=mask)
    flat = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    o = self.o_proj(flat)
    _State.o_pending = (o, flat, self.o_proj) if _State.o_norm else None
    return o


# module -> class name -> the replacement __call__ (a model is patched only if every layer is known)
FAMILIES = {
    "mlx_lm.models.qwen3": {"TransformerBlock": _block_call, "Attention": _attention_call},
    "mlx_lm.models.llama": {"TransformerBlock": _block_call, "Attention": _attention_call},
    "mlx_lm.models.qwen2": {"TransformerBlock": _block_call, "Attention": _attention_call},
}
_patched = {}
# what the engine installs (Engine.use_layer_kernels): the families where it was measured. The H200's
# 8B Qwen3 shape ran at or above the unfused ops (session 6: 177 vs 166, 180 vs 178 tok/s), but a
# cuda_kernel call cost ~19-25 us in a chain of one-row calls against ~8 for an MLX op, so it pays
# where one kernel replaces four (Qwen3's q/k norms + RoPE) and likely not in Llama / Qwen2, where it
# replaces two RoPEs (not measured; `install(model, families=FAMILIES)` patches them)
DEFAULT_FAMILIES = ("mlx_lm.models.qwen3",)


def _swap(module, call):
    cls = _base(module) if type(module) in _patched.values() else type(module)
    if (cls, call) not in _patched:
        _patched[(cls, call)] = type(f"Fused{cls.__name__}", (cls,), {"__call__": call})
    module.__class__ = _patched[(cls, call)]


def _own(module):
    """The module's mlx-lm class (under our patch, if patched)."""
    return _base(module) if type(module) in _patched.values() else type(module)


def _claims(model, families):
    """The model's inner decoder (`model.model`) when every layer is a Qwen3 / Llama / Qwen2 block with
    plain RMSNorms and RoPE, else None."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or _own(getattr(inner, "norm", None)) is not nn.RMSNorm:
        return None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if _own(layer).__module__ not in families or _own(layer).__module__ not in FAMILIES or attn is None or _own(attn).__module__ != _own(layer).__module__:
            return None
        if any(type(getattr(layer, n, None)) is not nn.RMSNorm for n in ("input_layernorm", "post_attention_layernorm")):
            return None
        if not rope_usable(getattr(attn, "rope", None)) or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return None
    return inner


def install(model, reference: bool = False, families: Optional[Sequence[str]] = None, o_norm: bool = False) -> int:
    """Patch the blocks, attentions and final norm of a model of one of `families` (mlx-lm modules;
    default DEFAULT_FAMILIES); returns how many layers (0: not on CUDA, or a model it does not claim,
    which keeps mlx-lm's code). `o_norm`: one-row o_proj + add + norm as one kernel (o_norm_kernel.py)."""
    if not (cuda_ready() or reference):
        return 0
    inner = _claims(model, DEFAULT_FAMILIES if families is None else families)
    if inner is None:
        return 0
    _State.reference = reference
    _State.pending = _State.o_pending = None
    _State.o_norm = o_norm
    for layer in inner.layers:
        fam = FAMILIES[_own(layer).__module__]
        _swap(layer, fam["TransformerBlock"])
        _swap(layer.self_attn, fam["Attention"])
    _swap(inner.norm, _final_norm_call)
    return len(inner.layers)


def uninstall(model) -> int:
    """Give the patched modules their classes back; returns how many were patched."""
    n = 0
    for _, m in model.named_modules():
        if type(m) in _patched.values():
            m.__class__ = _base(m)
            n += 1
    _State.pending = _State.o_pending = None
    _State.o_norm = False
    return n
