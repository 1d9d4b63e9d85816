"""The "recurrent" capture backend: conv and SSM layers that record their state after every position.

While capturing, a layer runs the verify one position at a time through its own mlx-lm code on a
scratch cache and hands each position's slots to the RowStateCache, whose commit keeps each row's
accepted one. It serves any layer whose state lives in its ArraysCache slots (`STEPPED_LAYERS`)."""

from __future__ import annotations

import inspect

import mlx.core as mx

from .adapters import base_call, swap_call
from .cache import ArraysSurface, RowStateCache

STEPPED_LAYERS = {
    ("mlx_lm.models.lfm2", "ShortConv"),
    ("mlx_lm.models.nemotron_h", "NemotronHMamba2Mixer"),
    ("mlx_lm.models.falcon_h1", "FalconH1Mixer"),
    ("mlx_lm.models.lfm2_moe", "ShortConv"),
    ("mlx_lm.models.mamba2", "Mamba2Block"),
    ("mlx_lm.models.granitemoehybrid", "GraniteMoeHybridMamba2Mixer"),
    ("mlx_lm.models.jamba", "JambaMambaMixer"),
    ("mlx_lm.models.recurrent_gemma", "RecurrentBlock"),
}


class _Scratch(ArraysSurface):
    """What the layer sees for one step: mlx-lm's ArraysCache surface over plain slots."""

    def __init__(self, slots):
        self.cache = list(slots)


def _stepping_call(self, *args, **kwargs):
    base = base_call(self)
    if not args:  # the input passed by name (falcon_h1: `input_states=`)
        name = type(self)._input_name
        args, kwargs = (kwargs[name],), {k: v for k, v in kwargs.items() if k != name}
    x, args = args[0], args[1:]
    named = "cache" in kwargs
    cache = kwargs["cache"] if named else next((a for a in args if isinstance(a, RowStateCache)), None)
    if not (isinstance(cache, RowStateCache) and cache.capturing):
        return base(self, x, *args, **kwargs)
    scratch = _Scratch(cache.cache)
    if named:
        kwargs = dict(kwargs, cache=scratch)
    else:
        args = tuple(scratch if a is cache else a for a in args)
    outs, steps = [], []
    for t in range(x.shape[1]):
        outs.append(base(self, x[:, t : t + 1], *args, **kwargs))
        steps.append(list(scratch.cache))
    cache.record_steps([mx.stack([s[i] for s in steps], axis=1) for i in range(len(cache.cache))])
    return mx.concatenate(outs, axis=1)


_stepping_classes = {}


def install_stepping(model) -> int:
    count = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls in _stepping_classes.values() or (cls.__module__, cls.__name__) in STEPPED_LAYERS:
            first = list(inspect.signature(cls.__call__).parameters)[1]  # the input's name
            swap_call(module, _stepping_call, "Stepping", _stepping_classes, _input_name=first)
            count += 1
    return count
