"""What the device runs per decode round, counted on any backend: primitives (≈ kernels) and programs.

On a launch-bound GPU a round costs about what its kernel launches cost, so the count of
primitives each round hands to the device says more than a CPU's wall time does. `GraphCounter`
wraps `mx.async_eval` / `mx.eval`: before each call it writes the lazy graph of the arrays
about to be evaluated (`mx.export_to_dot`, only what is not evaluated yet) and counts its
primitives by name. View-only primitives (reshape, broadcast, slice, ...) are counted apart:
they rarely launch a kernel. Every compiled-program call (verify bank, draft bank) is counted by
wrapping the banks' call sites; each write (scatter, slice update) is classed by where it lands
(`write_destinations`: in place, or a copy of the whole destination first). Use it in `benchmarks.round_cost --graph`.
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


def _dot(arrays) -> str:
    """The DOT text of the unevaluated graph behind `arrays` ('' when none is an array)."""
    arrays = [a for a in arrays if isinstance(a, mx.array)]
    if not arrays:
        return ""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return f.read()
    finally:
        os.unlink(path)


def graph_primitives(arrays) -> Counter:
    """Primitive names in the unevaluated graph behind `arrays` (one count per primitive node)."""
    return Counter(_LABEL.findall(_dot(arrays)))


WRITES = {"ScatterAxis", "Scatter", "SliceUpdate"}
_NODE = re.compile(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}')
_EDGE = re.compile(r'^"?([^"\s]+)"? -> "?([^"\s]+)"?$')


def write_destinations(arrays) -> Counter:
    """Where each write (scatter, slice update) in the unevaluated graph behind `arrays` lands. MLX writes
    in place only into an array nothing else holds (`is_donatable`); on CUDA an array a kernel of the
    same command batch read is held until the batch completes. So: `copy` (the destination is read by
    another node of this graph, or is one of its outputs: MLX copies the whole array first, a copy_v on
    CUDA), `evaluated` (an array an earlier eval made: in place once nothing holds it, on CUDA once the
    round before has finished on the device), `in place` (a fresh intermediate only this write reads)."""
    text = _dot(arrays)
    if not text:
        return Counter()
    prims = dict(_NODE.findall(text))
    sources = set(re.findall(r'rank=source; "([^"]+)"', text))
    sinks = set(re.findall(r'rank=sink; "([^"]+)"', text))
    inputs, readers = {}, Counter()
    for line in text.splitlines():
        m = _EDGE.match(line.strip())
        if m and m.group(2) in prims:
            inputs.setdefault(m.group(2), []).append(m.group(1))
            readers[m.group(1)] += 1
    out = Counter()
    for node, label in prims.items():
        if label in WRITES:
            dst = inputs[node][0]
            where = ("copy" if readers[dst] > 1 or dst in sinks else "evaluated" if dst in sources else "in place")
            out[where] += 1
    return out


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        elif isinstance(a, dict):
            yield from _flat(list(a.values()))
        else:
            yield a


class GraphCounter:
    """Counts primitives handed to the device and compiled-program calls while active."""

    def __init__(self, engine=None):
        self.primitives = Counter()
        self.programs = Counter()
        self.writes = Counter()  # write_destinations
        self.engine = engine
        self._restore = []

    def _wrap(self, owner, name, fn):
        real = getattr(owner, name)
        self._restore.append((owner, name, real))
        setattr(owner, name, fn(real))

    def __enter__(self):
        def counting(real):
            def wrapped(*args, **kwargs):
                self.primitives.update(graph_primitives(list(_flat(args))))
                self.writes.update(write_destinations(list(_flat(args))))
                return real(*args, **kwargs)
            return wrapped

        self._wrap(mx, "async_eval", counting)
        self._wrap(mx, "eval", counting)
        eng = self.engine
        if eng is not None and eng.bank is not None:
            self._program_counter(eng.bank.programs, "verify")
        bank = getattr(getattr(eng, "drafter", None), "bank", None)
        if bank is not None:  # the MTP head's bank or the draft model's (mtplx/drafting/)
            self._program_counter(bank.programs, "draft")
        return self

    def _program_counter(self, programs, label):
        counter = self.programs

        def outer(real):
            def call(key, build, *args):
                counter[key[0] if isinstance(key[0], str) else label] += 1
                return real(key, build, *args)
            return call

        self._wrap(programs, "call", outer)

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._restore):
            setattr(owner, name, real)

    def summary(self, rounds: int) -> dict:
        """Per round: kernels (non-view primitives), views, program calls, the costliest names."""
        r = max(rounds, 1)
        kernels = sum(v for k, v in self.primitives.items() if k not in VIEWS)
        views = sum(v for k, v in self.primitives.items() if k in VIEWS)
        costly = [(k, v) for k, v in self.primitives.most_common() if k not in VIEWS][:8]
        top = ", ".join(f"{k} {v / r:.1f}" for k, v in costly)
        return {"kernels/round": kernels / r, "views/round": views / r,
                "programs/round": sum(self.programs.values()) / r,
                "programs": ", ".join(f"{k} {v / r:.2f}" for k, v in sorted(self.programs.items())),
                "top kernels/round": top,
                "writes/round": ", ".join(f"{k} {v / r:.2f}" for k, v in sorted(self.writes.items()))}
