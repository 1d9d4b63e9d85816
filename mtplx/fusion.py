"""Sibling projections (q/k/v, gate/up) as one matmul at one row, a load-time model transform.

A one-token decode step at one stream reads every weight once; q_proj, k_proj and v_proj (and
gate_proj, up_proj) read the same input, so one matrix-vector product over their stacked weights
does the work of three (two) with fewer, larger kernels. The model's own forward is kept: each
projection is replaced by a part that, for the first sibling called on an input, computes the
stacked product and hands each sibling its slice. A row of a matrix-vector product does not
depend on the other rows (MLX's gemv gives each output row its own warp), so the values are
the ones the separate products give (checked on the H200 by benchmarks/decode_anatomy's token
comparison); with more than one row (prefill, a wide batch) each part
multiplies by its own rows of the stacked weight (a view: the same values and layout as before).
The stacked weight replaces the originals, so memory does not grow once the originals are freed.

The engine stacks them where its decode steps are compiled on CUDA (generation.py); there the
graph has no per-projection overhead left to pay for the slices, and eagerly it measured slower.
`fuse_projections(model)` returns an undo function (holding it keeps the original weights alive);
`unstack(model)` puts plain Linear layers back (views of the stacked weight: no copy).
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import mlx.core as mx
import mlx.nn as nn


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Stacked:
    """The last one-row product over a stacked weight, shared by the siblings' parts."""

    def __init__(self, sizes: Sequence[int]):
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.weight = None  # set by the first part (the parameter lives there)
        self._x = None
        self._parts: List[mx.array] = []
        self._left = 0

    def part(self, x: mx.array, i: int) -> mx.array:
        if self._x is not x or self._left == 0:
            y = x @ self.weight.T
            self._parts = [y[..., a:b] for a, b in zip(self.bounds[:-1], self.bounds[1:])]
            self._x, self._left = x, len(self._parts)
        out = self._parts[i]
        self._left -= 1
        if self._left == 0:  # every sibling has its slice: drop the references
            self._x, self._parts = None, []
        return out

    def rows(self, x: mx.array, i: int) -> mx.array:
        """Sibling i's own product for several rows: its rows of the stacked weight (a view)."""
        return x @ self.weight[self.bounds[i] : self.bounds[i + 1]].T


class StackedPart(nn.Module):
    """One sibling projection. The first holds the stacked weight as its parameter `weight`
    (so the model's parameter bytes are unchanged); the others hold none."""

    def __init__(self, stacked: _Stacked, index: int, weight=None):
        super().__init__()
        if weight is not None:
            self.weight = weight
        self._stacked = [stacked]  # a list: a plain attribute, not a child module or parameter
        self._index = index

    def __call__(self, x):
        st = self._stacked[0]
        if "weight" in self:  # after model.update(...) or load_weights the parameter is the truth
            st.weight = self["weight"]
        if x.size != x.shape[-1]:
            return st.rows(x, self._index)
        return st.part(x, self._index)


def _fusable(layers) -> bool:
    return (all(type(m) in (nn.Linear,) and "bias" not in m for m in layers)
            and len({m.weight.shape[1] for m in layers}) == 1 and len({m.weight.dtype for m in layers}) == 1)


def fuse_projections(model) -> Callable[[], None]:
    """Replace each unquantized, bias-free group of GROUPS in `model` by StackedParts (a group
    already stacked is left alone); returns undo."""
    swapped = []
    for _, module in list(model.named_modules()):
        for names in GROUPS:
            if not all(n in module for n in names):
                continue
            layers = [module[n] for n in names]
            if not _fusable(layers):
                continue
            stacked = _Stacked([m.weight.shape[0] for m in layers])
            stacked.weight = mx.concatenate([m.weight for m in layers], axis=0)
            for i, (n, m) in enumerate(zip(names, layers)):
                module[n] = StackedPart(stacked, i, stacked.weight if i == 0 else None)
                swapped.append((module, n, m))
            mx.eval(stacked.weight)

    def undo():
        for mod, n, m in swapped:
            mod[n] = m

    undo.count = len(swapped)  # type: ignore[attr-defined]
    return undo


def unstack(model) -> int:
    """Undo `fuse_projections` without its undo function: each part becomes an nn.Linear over its
    rows of the stacked weight. Returns how many parts."""
    n = 0
    for _, module in list(model.named_modules()):
        for name in list(module.keys()):
            part = module[name]
            if isinstance(part, StackedPart):
                st = part._stacked[0]
                if "weight" in part:
                    st.weight = part["weight"]
                w = st.weight[st.bounds[part._index] : st.bounds[part._index + 1]]
                layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
                layer.weight = w
                module[name] = layer
                n += 1
    return n
