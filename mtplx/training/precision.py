"""Mixed precision for train-head: which dtypes a run stores and steps in, and a loss/gradient step over a
bfloat16 copy of the head's float32 parameters (float32 gradients for the optimizer)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


def step_dtypes(cfg):
    """(dtype hidden states are stored in, dtype the training step computes in). Head parameters,
    the optimizer state and every evaluation stay float32 throughout; a bfloat16 step runs on a
    bfloat16 copy of the parameters and hands float32 gradients to the optimizer (on a GPU a
    float32 step is bound by float32 arithmetic)."""
    auto = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return tuple(auto if name == "auto" else getattr(mx, name) for name in (cfg.dtype, cfg.train_dtype))


def value_and_grad(head: nn.Module, loss_fn, dtype):
    """(loss, float32 gradients) of `loss_fn(head, ...)`, the forward and backward run over a copy of
    the head's (float32) trainable parameters cast to `dtype` (mixed precision; the head keeps its
    float32 parameters). float32: plain nn.value_and_grad."""
    if dtype == mx.float32:
        return nn.value_and_grad(head, loss_fn)

    def over(params, *args):
        head.update(params)
        return loss_fn(head, *args)

    grad_fn = mx.value_and_grad(over)

    def run(_head, *args):
        master = head.trainable_parameters()
        try:
            loss, grads = grad_fn(tree_map(lambda p: p.astype(dtype), master), *args)
        finally:
            head.update(master)
        return loss, tree_map(lambda g: g.astype(mx.float32), grads)

    return run
