"""What an evaluation hands the device, counted for tests on any backend: primitives by name.

`graph_primitives(arrays)` writes the unevaluated graph behind `arrays` (`mx.export_to_dot`) and
counts its primitive nodes by name; `GraphCounter` does that for every `mx.eval` / `mx.async_eval`
while it is active. View-only primitives (`VIEWS`: reshape, broadcast, slice, ...) rarely launch a
kernel, so tests count them apart.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter

import mlx.core as mx

VIEWS = {"Broadcast", "BroadcastAxes", "ExpandDims", "Squeeze", "Reshape", "Slice", "Transpose", "StopGradient",
         "AsStrided", "Flatten", "Unflatten", "Depends"}
_LABEL = re.compile(r'label ="([^"]+)", shape=rectangle')


def graph_primitives(arrays) -> Counter:
    """Primitive names in the unevaluated graph behind `arrays` (one count per primitive node)."""
    arrays = [a for a in arrays if isinstance(a, mx.array)]
    if not arrays:
        return Counter()
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return Counter(_LABEL.findall(f.read()))
    finally:
        os.unlink(path)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        elif isinstance(a, dict):
            yield from _flat(list(a.values()))
        else:
            yield a


class GraphCounter:
    """Counts the primitives of every evaluation while active (`primitives`, by name)."""

    def __init__(self):
        self.primitives = Counter()
        self._restore = []

    def __enter__(self):
        for name in ("eval", "async_eval"):
            real = getattr(mx, name)

            def counted(*args, _real=real, **kwargs):
                self.primitives.update(graph_primitives(list(_flat(args))))
                return _real(*args, **kwargs)

            self._restore.append((name, real))
            setattr(mx, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in reversed(self._restore):
            setattr(mx, name, real)
