"""A Qwen3 layer's small ops as fewer CUDA kernels: residual add + RMSNorm, q/k RMSNorm + RoPE.

Two kernels take five of a decode step's ~12 small kernels a layer. A block returns its residual sum
lazily and the next patched block or final norm adds and normalizes its two terms in one kernel. Each
kernel reproduces MLX's CUDA arithmetic bit for bit and every forward takes them: one model for plain
decoding and speculation."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import mlx.core as mx
import mlx.nn as nn

from ..adapters import swap_call
from . import device, kernel_cache
from .device import cuda_ready

_HEADER = "#include <cooperative_groups/reduce.h>\n"

# One block per row, BLOCK threads (`_norm_layout`); thread tid reads NR elements at vector c * BLOCK + tid.
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
      acc += t * t;
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

# One warp per (head, token, row), q's heads then k's. params: eps, log2(base), scale; offset[b * OSTRIDE].
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
  const T* w = isq ? q_weight : k_weight;
  T xv[NR];
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < NR; j++) {
    const int i = lane * NR + j;
    xv[j] = i < D ? src[i] : T(0);
    float t = static_cast<float>(xv[j]);
    acc += t * t;
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
  __syncwarp();
  constexpr int HALF = DIMS / 2;
  const float pos = params[2] * static_cast<float>(l + offset[b * OSTRIDE]);
  for (int p = lane; p < HALF; p += 32) {
    float d = static_cast<float>(p) / static_cast<float>(HALF);
    float inv_freq = exp2(-d * params[1]);
    float theta = pos * inv_freq;
    float costheta = cos(theta);
    float sintheta = sin(theta);
    const int i1 = TRADITIONAL ? 2 * p : p;
    const int i2 = TRADITIONAL ? i1 + 1 : p + HALF;
    float x1 = static_cast<float>(buf[i1]);
    float x2 = static_cast<float>(buf[i2]);
    float rx1 = x1 * costheta - x2 * sintheta;
    float rx2 = x1 * sintheta + x2 * costheta;
    dst[i1] = static_cast<T>(rx1);
    dst[i2] = static_cast<T>(rx2);
  }
  for (int i = DIMS + lane; i < D; i += 32) {
    dst[i] = buf[i];
  }
"""

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_ADD_NORM_KERNEL = kernel_cache.cuda_kernel(name="mtplx_add_rms_norm", input_names=["x", "r", "w", "eps"],
                                             output_names=["h", "y"], source=_ADD_NORM, header=_HEADER)
_QK_KERNEL = kernel_cache.cuda_kernel(name="mtplx_qk_norm_rope", input_names=["q", "k", "q_weight", "k_weight", "offset", "params"],
                                      output_names=["q_out", "k_out"], source=_QK_ROPE, header=_HEADER)
_consts = {}


def _const(*values) -> mx.array:
    key = values + (device.pads(),)
    if key not in _consts:
        _consts[key] = device.resident_constant(values)
    return _consts[key]


@functools.cache
def log2f(x: float) -> float:
    """The C library's float log2, as MLX's RoPE computes its base on the host."""
    f = ctypes.CDLL(ctypes.util.find_library("m") or None).log2f
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return float(f(x))


def _norm_layout(D: int, itemsize: int):
    """(threads per row, chunks per thread, elements per read) as MLX's rms_norm.cu lays a row out."""
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


def add_rms_norm_reference(x, r, weight, eps):
    h = x + r
    return h, mx.fast.rms_norm(h, weight, eps)


def add_norm_usable(x, r, weight) -> bool:
    return (x.dtype in DTYPES and r.dtype == x.dtype and weight.dtype == x.dtype and x.shape == r.shape
            and weight.ndim == 1 and weight.shape[0] == x.shape[-1])


def add_rms_norm(x: mx.array, r: mx.array, weight: mx.array, eps: float):
    D = x.shape[-1]
    block, chunks, nr = _norm_layout(D, x.dtype.size)
    return _ADD_NORM_KERNEL(
        inputs=[x, r, weight, _const(float(eps))], template=[("T", x.dtype), ("D", D), ("BLOCK", block), ("CHUNKS", chunks), ("NR", nr)],
        grid=(block * (x.size // D), 1, 1), threadgroup=(block, 1, 1), output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype])


def qk_norm_rope_reference(q, k, q_norm, k_norm, rope, offset, n_q, n_kv):
    """mlx-lm's ops: q [B, L, n_q * D] -> [B, n_q, L, D] normed and rotated; k likewise."""
    B, L, _ = q.shape
    q, k = q_norm(q.reshape(B, L, n_q, -1)), k_norm(k.reshape(B, L, n_kv, -1))
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    return rope(q, offset=offset), rope(k, offset=offset)


def rope_usable(rope) -> bool:
    return type(rope) is nn.RoPE and rope.dims % 2 == 0


def qk_usable(q, k, q_norm, k_norm, rope, n_q, n_kv) -> bool:
    D = q.shape[-1] // n_q
    nr = 16 // q.dtype.size if q.dtype in DTYPES else 0
    return (q.dtype in DTYPES and k.dtype == q.dtype and q.ndim == 3 and k.shape[-1] == n_kv * D
            and D <= 32 * nr and rope.dims <= D and rope_usable(rope)
            and q.shape[1] < 65536 and q.shape[0] < 65536  # tokens and rows are grid y / z
            and q_norm.weight.dtype == q.dtype and k_norm.weight.dtype == q.dtype and q_norm.eps == k_norm.eps
            and q_norm.weight.shape == (D,) and k_norm.weight.shape == (D,))


def qk_norm_rope(q, k, q_norm, k_norm, rope, offset, n_q, n_kv):
    B, L, _ = q.shape
    D = q.shape[-1] // n_q
    if isinstance(offset, mx.array):
        stride = 1 if offset.ndim == 1 and offset.shape[0] == B and B > 1 else 0
        off = offset.astype(mx.int32).reshape(-1)
    else:  # an eager step's layers share one offset: one small array a step
        if _State.offset[0] != int(offset):
            _State.offset = (int(offset), device.resident_constant([int(offset)], mx.int32))
        stride, off = 0, _State.offset[1]
    params = _const(float(q_norm.eps), log2f(rope.base), float(rope.scale))
    return _QK_KERNEL(
        inputs=[q, k, q_norm.weight, k_norm.weight, off, params],
        template=[("T", q.dtype), ("D", D), ("HQ", n_q), ("HK", n_kv), ("NR", 16 // q.dtype.size),
                  ("DIMS", rope.dims), ("TRADITIONAL", bool(rope.traditional)), ("OSTRIDE", stride)],
        grid=(32 * (n_q + n_kv), L, B), threadgroup=(32, 1, 1),
        output_shapes=[(B, n_q, L, D), (B, n_kv, L, D)], output_dtypes=[q.dtype, q.dtype])


class _State:
    pending = None  # (the last patched block's lazy output x + r, x, r)
    offset = (None, None)  # the last int rope offset and its device array


def _add_norm(norm, x, r):
    fused = add_norm_usable(x, r, norm.weight)
    return (add_rms_norm if fused else add_rms_norm_reference)(x, r, norm.weight, norm.eps)


def _input_norm(norm, x, plain):
    """(norm(x), x); from the pending sum's two terms in one kernel where `x` is that sum."""
    p = _State.pending
    if p is None or p[0] is not x:
        return plain(x), x
    _State.pending = None
    h, y = _add_norm(norm, p[1], p[2])
    return y, h


def _block_call(self, x, mask=None, cache=None):
    xn, x = _input_norm(self.input_layernorm, x, self.input_layernorm)
    h, hn = _add_norm(self.post_attention_layernorm, x, self.self_attn(xn, mask, cache))
    r = self.mlp(hn)
    out = h + r  # run only if something other than a patched consumer reads it
    _State.pending = (out, h, r)
    return out


def _final_norm_call(self, x):
    return _input_norm(self, x, lambda a: nn.RMSNorm.__call__(self, a))[0]


def _attention_call(self, x, mask=None, cache=None):
    B, L, _ = x.shape
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    offset = cache.offset if cache is not None else 0
    args = (q, k, self.q_norm, self.k_norm, self.rope)
    fused = qk_usable(*args, self.n_heads, self.n_kv_heads)
    q, k = (qk_norm_rope if fused else qk_norm_rope_reference)(*args, offset, self.n_heads, self.n_kv_heads)
    v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    sdpa = sys.modules[FAMILY].scaled_dot_product_attention  # rows_attention's, if installed
    out = sdpa(q, k, v, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


# A cuda_kernel call costs ~19-25 us against ~8 for an MLX op: it pays where one kernel replaces four
# (Qwen3's q/k norms + RoPE: 177 vs 166 tok/s at 8B on the H200), not two RoPEs (Llama, Qwen2).
FAMILY = "mlx_lm.models.qwen3"
_patched = {}  # mlx-lm class -> its patched subclass


def _own(module):
    return type(module).__mro__[1] if type(module) in _patched.values() else type(module)


def _claims(model):
    """`model.model` when every layer is a FAMILY block with plain RMSNorms and RoPE, else None."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or _own(getattr(inner, "norm", None)) is not nn.RMSNorm:
        return None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if _own(layer).__module__ != FAMILY or attn is None or _own(attn).__module__ != FAMILY:
            return None
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if any(type(m) is not nn.RMSNorm for m in norms + [getattr(attn, n, None) for n in ("q_norm", "k_norm")]):
            return None
        if not rope_usable(getattr(attn, "rope", None)) or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return None
    return inner


def install(model) -> int:
    inner = _claims(model) if cuda_ready() else None
    if inner is None:
        return 0
    _State.pending = None
    for layer in inner.layers:
        swap_call(layer, _block_call, "Fused", _patched)
        swap_call(layer.self_attn, _attention_call, "Fused", _patched)
    swap_call(inner.norm, _final_norm_call, "Fused", _patched)
    return len(inner.layers)


def uninstall(model) -> int:
    n = 0
    for _, m in model.named_modules():
        if type(m) in _patched.values():
            m.__class__ = type(m).__mro__[1]
            n += 1
    _State.pending = None
    return n
