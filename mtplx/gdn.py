"""The "gdn" capture backend: Gated DeltaNet layers that record their state after every position.

A recurrent state cannot roll back a rejected draft by moving an index, so while capturing this layer
computes mlx-lm's Qwen3-Next / Qwen3.5 step by step and hands the conv window and each position's
state to the RowStateCache, which keeps each row's accepted one."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .adapters import base_call, swap_call
from .cache import RowStateCache


def _mixed_qkv_z_b_a(self, inputs):
    """(conv input, z, b, a): Qwen3-Next packs q/k/v/z and b/a per key head; Qwen3.5 projects each part."""
    B, S, _ = inputs.shape
    if hasattr(self, "in_proj_qkvz"):
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(inputs), self.in_proj_ba(inputs))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed, z, b, a
    z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
    return self.in_proj_qkv(inputs), z, self.in_proj_b(inputs), self.in_proj_a(inputs)


def _capturing_call(self, inputs, mask=None, cache=None):
    if not (isinstance(cache, RowStateCache) and cache.capturing):
        return base_call(self)(self, inputs, mask, cache)
    # imported here: at module level it would run mlx-lm's package __init__ (process.py defers it)
    from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, normalize_qk
    B, S, _ = inputs.shape
    mixed_qkv, z, b, a = _mixed_qkv_z_b_a(self, inputs)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)
    conv_out = nn.silu(self.conv1d(conv_input))
    q, k, v = [t.reshape(B, S, h, d) for t, h, d in zip(mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                                                         [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                                                         [self.head_k_dim, self.head_k_dim, self.head_v_dim])]
    q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
    beta = mx.sigmoid(b)
    g = compute_g(self.A_log, a, self.dt_bias)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32)
    if (repeat := self.num_v_heads // self.num_k_heads) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(S):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
        ys.append(y)
        states.append(state)
    cache.record(conv_input, mx.stack(states, axis=1))
    out = self.norm(mx.stack(ys, axis=1), z)
    return self.out_proj(out.reshape(B, S, -1))


_capture_classes = {}


def install_capture(model) -> int:
    layers = [l.linear_attn for l in getattr(model, "layers", []) if getattr(l, "linear_attn", None) is not None]
    for gdn in layers:
        if not (hasattr(gdn, "fix_query_key_value_ordering") or hasattr(gdn, "in_proj_qkv")):
            raise ValueError(f"no capture backend for linear-attention layer {type(gdn).__name__}")
        swap_call(gdn, _capturing_call, "Capturing", _capture_classes)
    return len(layers)
