"""What the engine does to an mlx-lm model before it batches it, and what it refuses.

`prepare` installs capture backends and batching adapters, then probes: two rows of different lengths
prefill, verify with a partial accept and step once more, and every logit must match a cache-less
forward. A failure is `UnsupportedArchitecture`: an unknown layer could give wrong text silently."""

from __future__ import annotations

import contextlib
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
    """What the probe's verdict depends on: config, device, dtypes, versions, engine code."""
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
    """"gdn", "recurrent", both joined by "+", or None (attention only): read from the layers."""
    found = {"gdn" for layer in getattr(model, "layers", []) if getattr(layer, "linear_attn", None) is not None}
    if any((c.__module__, c.__name__) in STEPPED_LAYERS for _, m in model.named_modules() for c in type(m).__mro__):
        found.add("recurrent")
    return "+".join(sorted(found)) or None


PASSED_FILE = "mtplx_probe_passed"  # holds the probe_key of the last passed probe


def prepare(model, arch: str, vocab_size: int = 2, remember: Optional[Tuple[Path, str]] = None) -> bool:
    """Make `model` ready for batching or refuse it; whether it is recurrent. `remember`: (file, key)."""
    kinds = flat_kinds(layer_kinds(model))
    try:
        install_capture(model)
    except ValueError as e:
        raise UnsupportedArchitecture(f"architecture {arch!r}: {e}; refused rather than run") from None
    install_stepping(model)
    install_adapters(model)
    passed, key = remember or (None, None)
    known = False
    with contextlib.suppress(OSError):
        known = passed is not None and passed.read_text().strip() == key
    if not known:
        _probe(model, arch, vocab_size)
        with contextlib.suppress(OSError):  # a read-only directory: probe again next time
            if passed is not None:
                passed.write_text(key + "\n")
    return any(k != "kv" for k in kinds)


class _ProbeStateCache(RowStateCache):
    """A RowStateCache that remembers which module classes wrote its slots directly."""

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
                "be rolled back after a rejected draft); refused rather than run")
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
                f"(row {b}, relative error {err:.2g} after a partial accept); refused rather than run")
