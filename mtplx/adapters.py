"""Batching adapters: mlx-lm layers that assume one row, made safe for per-row offsets and masks.

gemma2's attention adds a 4-d mask to [B, kv_heads, repeats, N, D] queries (the mask gets the repeats
axis); DynamicNTKScalingRoPE takes a Python max over the offset (the base is picked per row). Each
adapter is a subclass swapped onto the instance and computes what the layer does for one row."""

from __future__ import annotations

import mlx.core as mx

def swap_call(module, call, prefix: str, made: dict, **attrs) -> None:
    """Swap `module`'s class for a subclass whose __call__ is `call` (one per class, kept in `made`)."""
    cls = type(module)
    if cls in made.values():
        return
    if cls not in made:
        made[cls] = type(f"{prefix}{cls.__name__}", (cls,), {"__call__": call, **attrs})
    module.__class__ = made[cls]


def base_call(self):
    return type(self).__mro__[1].__call__


_adapted = {}


def install_adapters(model) -> int:
    count = 0
    for _, module in model.named_modules():
        cls = type(module)
        call = ADAPTERS.get((cls.__module__, cls.__name__))
        if cls in _adapted.values() or call is not None:
            swap_call(module, call, "Batched", _adapted)
            count += 1
    return count


def _gemma2_attention(self, x, mask=None, cache=None):
    if mask is not None and not isinstance(mask, str) and mask.ndim == 4 and self.repeats > 1:
        mask = mx.expand_dims(mask, 2)  # [B, 1, 1, N, keys] against [B, kv_heads, repeats, N, keys]
    return base_call(self)(self, x, mask, cache)


def _dynamic_ntk_rope(self, x, offset=0):
    if not isinstance(offset, mx.array) or offset.ndim == 0:
        return base_call(self)(self, x, offset)
    # mlx-lm, per row: seq_len = max(n + offset, trained context); the base grows past it.
    seq_len = mx.maximum(x.shape[-2] + offset, self.max_position_embeddings).astype(mx.float32)
    grown = self.base * ((self.factor * seq_len / self.max_position_embeddings) - (self.factor - 1)) ** (
        self.dims / (self.dims - 2))
    plain = mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=1.0, offset=offset)
    over = x.shape[-2] + offset > self.max_position_embeddings
    scaled = _rope_per_row(x, self.dims, self.traditional, grown, 1.0, offset)
    return mx.where(over[:, None, None, None], scaled, plain)


def _rope_per_row(x, dims, traditional, base, scale, offset):
    """RoPE over x [B, H, L, D] with each row's own base [B] and offset [B] (mx.fast.rope's math)."""
    B, _, L, _ = x.shape
    inv = mx.exp(-mx.log(base)[:, None] * (mx.arange(0, dims, 2, dtype=mx.float32) / dims)[None])  # [B, dims/2]
    pos = (offset[:, None] + mx.arange(L)).astype(mx.float32) * scale  # [B, L]
    theta = (pos[:, :, None] * inv[:, None, :])[:, None]  # [B, 1, L, dims/2]
    cos, sin = mx.cos(theta), mx.sin(theta)
    rot, rest = x[..., :dims].astype(mx.float32), x[..., dims:]
    if traditional:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., : dims // 2], rot[..., dims // 2 :]
        out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return mx.concatenate([out.astype(x.dtype), rest], axis=-1) if rest.shape[-1] else out.astype(x.dtype)


ADAPTERS = {
    ("mlx_lm.models.gemma2", "Attention"): _gemma2_attention,
    ("mlx_lm.models.rope_utils", "DynamicNTKScalingRoPE"): _dynamic_ntk_rope,
}
