"""What the engine does to an mlx-lm model before it batches it, and what it refuses.

`prepare(model, arch)` runs once per model, before any row:
  1. every cache of the model's `make_cache` must be a kind the batch cache knows
     (cache.layer_kinds: attention, sliding-window attention, ArraysCache, CacheList);
  2. recurrent layers get their capture backend (gdn.py: Gated DeltaNet; recurrent.py: conv
     and SSM layers) and batching adapters are installed (adapters.py);
  3. a probe checks the engine's own path against mlx-lm's: two rows of different lengths are
     prefilled, verified with a partial accept, and stepped once more, and every logit must
     match a fresh cache-less forward of the accepted text. A recurrent cache no capture
     backend recorded names the layer class that wrote it.
Anything that fails is refused with `UnsupportedArchitecture`, naming the architecture: an
unknown layer that runs could give wrong text without an error, the worst outcome.

The probe's verdict depends only on the config, the device and dtype, mlx / mlx-lm and the
engine's own code (`probe_key`). For a model the engine converted itself (under the cache
directory) a passed probe is remembered beside it (`PASSED_FILE`) and not run again: on a CPU it
costs seconds of startup. Other model directories are not written to and are probed every time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from .adapters import install_adapters
from .cache import BatchCache, RowStateCache, UnsupportedArchitecture, flat_kinds, layer_kinds
from .gdn import install_capture
from .recurrent import STEPPED_LAYERS, install_stepping

PROBE = [5, 17, 3, 11, 8, 2, 9, 4, 13, 6]


def probe_key(config: dict, model) -> str:
    """What the probe's verdict depends on: config, device, weight dtype, versions, engine code."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    h.update(f"{mx.default_device()}|{dtypes}".encode())
    for pkg in ("mlx", "mlx-lm"):
        h.update(importlib.metadata.version(pkg).encode())
    for f in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:24]


def capture_backend(model) -> Optional[str]:
    """The capture backend `model`'s recurrent layers use: "gdn" (Gated DeltaNet, gdn.py),
    "recurrent" (conv / SSM steps, recurrent.py), both joined by "+", or None (attention only).
    Read from the layers themselves, installed or not."""
    found = {"gdn" for layer in getattr(model, "layers", []) if getattr(layer, "linear_attn", None) is not None}
    if any((c.__module__, c.__name__) in STEPPED_LAYERS for _, m in model.named_modules() for c in type(m).__mro__):
        found.add("recurrent")
    return "+".join(sorted(found)) or None


PASSED_FILE = "mtplx_probe_passed"  # holds the probe_key of the last passed probe


def prepare(model, arch: str, vocab_size: int = 2, remember: Optional[Tuple[Path, str]] = None) -> bool:
    """Make `model` ready for batching, or refuse it. Returns whether it has recurrent layers.
    `remember` = (file, probe_key): a probe passed before under the same key is not run again."""
    kinds = flat_kinds(layer_kinds(model))
    try:
        install_capture(model)
    except ValueError as e:
        raise UnsupportedArchitecture(f"architecture {arch!r}: {e}; refused rather than run") from None
    install_stepping(model)
    install_adapters(model)
    passed, key = remember or (None, None)
    try:
        known = passed.read_text().strip() == key if passed is not None else False
    except OSError:
        known = False
    if not known:
        _probe(model, arch, vocab_size)
        if passed is not None:
            try:
                passed.write_text(key + "\n")
            except OSError:
                pass  # read-only: probe again next time
    return any(k != "kv" for k in kinds)


class _ProbeStateCache(RowStateCache):
    """A RowStateCache that remembers which module class wrote its slots directly."""

    def __setitem__(self, i, v):
        caller = sys._getframe(1).f_locals.get("self")
        self.writers = getattr(self, "writers", set()) | {type(caller).__name__}
        super().__setitem__(i, v)


def _forward(model, tokens, cache, capturing=False):
    cache.set_capturing(capturing)
    try:
        return model(mx.array(tokens, dtype=mx.int32), cache=cache.layers)
    finally:
        cache.set_capturing(False)


def _probe(model, arch: str, vocab_size: int):
    toks = [t % max(vocab_size, 2) for t in PROBE]
    rows = [toks[:6], toks[:4]]  # different lengths
    singles = []
    for r in rows:
        c = BatchCache.for_model(model, 1)
        _forward(model, [r], c)
        c.commit([len(r)])
        singles.append(c)
    cache = BatchCache.stack(singles)
    for leaf in cache.leaves:
        if isinstance(leaf, RowStateCache):
            leaf.__class__ = _ProbeStateCache
    verify = [toks[6:9], toks[4:7]]
    _forward(model, verify, cache, capturing=True)
    for i, leaf in enumerate(cache.leaves):
        if isinstance(leaf, RowStateCache) and (leaf._steps is None or getattr(leaf, "writers", None)):
            who = ", ".join(sorted(getattr(leaf, "writers", set())))
            how = f"is written by {who}, which has" if who else "is not written through the engine's cache by any layer:"
            raise UnsupportedArchitecture(
                f"architecture {arch!r}: recurrent cache {i} {how} no capture backend (its state could not "
                "be rolled back after a rejected draft); refused rather than run"
            )
    counts = np.array([2, 1])
    cache.commit(counts)
    nxt = [[toks[9]], [toks[9]]]
    got = _forward(model, nxt, cache)[:, -1]
    for b, (r, v) in enumerate(zip(rows, verify)):
        ref = model(mx.array([r + v[: counts[b]] + nxt[b]], dtype=mx.int32))[0, -1]
        scale = max(float(mx.abs(ref).max()), 1.0)
        err = float(mx.abs(got[b].astype(mx.float32) - ref.astype(mx.float32)).max()) / scale
        if err > (1e-3 if ref.dtype == mx.float32 else 5e-2):
            raise UnsupportedArchitecture(
                f"architecture {arch!r}: the batched engine's logits differ from mlx-lm's own forward "
                f"(row {b}, relative error {err:.2g} after a partial accept); refused rather than run"
            )
