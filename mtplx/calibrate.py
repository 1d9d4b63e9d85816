"""A per-machine calibration: what a verify costs here, by batch width and verify length.

It times the verify for each length and width that fits the memory budget, and one row's plain
decoding compiled and eager; the profile (beside the model) feeds `max_batch: auto`, the depth
controller's cost curves and how one row decodes."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx
import numpy as np

PROFILE_FILE = "mtplx_calibration.json"
DEFAULT_WIDTHS = (1, 8, 32, 64, 128, 256)
AUTO_ROW_TOKENS = 2048  # prompt + generated tokens per row that `max_batch: auto` makes room for
AUTO_FALLBACK = 32  # max_batch: auto without a profile (still capped by memory)
ACCEPTANCE = 0.7  # per-token acceptance behind `depth_that_pays`


def device_tag() -> str:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return f"{mx.default_device()} {info.get('device_name', info.get('architecture', ''))}".strip()


def config_tag(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def profile_path(model_dir) -> Path:
    return Path(model_dir) / PROFILE_FILE


def rate(costs: Sequence[float], k: int, acceptance: float = ACCEPTANCE) -> float:
    """Tokens per second per row when every round drafts k tokens (costs[k]: a verify of k + 1)."""
    a = min(max(acceptance, 0.01), 0.99)
    return (1 - a ** (k + 1)) / (1 - a) / costs[k]


def _prefilled(engine, width: int, context: int, rng):
    from .cache import BatchCache
    cache = BatchCache.for_model(engine.model, width)
    prompt = mx.array(rng.integers(0, engine.vocab_size, (width, context)).astype(np.int32))
    logits = engine.runtime.forward(prompt, cache)[0]
    mx.eval(logits)
    cache.commit(np.full(width, context))
    cache.eval()
    return cache, logits


def _time_width(engine, width: int, max_len: int, context: int, repeats: int, rng) -> list:
    cache, _ = _prefilled(engine, width, context, rng)
    out = []
    for length in range(1, max_len + 1):
        tokens = mx.array(rng.integers(0, engine.vocab_size, (width, length)).astype(np.int32))
        times = []
        for i in range(repeats + 2):  # the first two compile and allocate: untimed
            t = time.perf_counter()
            mx.eval(engine.rounds.verify(tokens, cache)[0])
            cache.commit(np.zeros(width, dtype=np.int64))  # rejected: the cache stays at `context`
            cache.eval()
            if i >= 2:
                times.append(time.perf_counter() - t)
        out.append(float(np.median(times)))
    return out


def _one_stream_seconds(engine, compiled: bool, context: int, steps: int, rng) -> float:
    """Seconds a token of one row's plain decoding, pipelined as the engine runs it."""
    cache, logits = _prefilled(engine, 1, context, rng)
    y = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
    ones = np.ones(1, dtype=np.int64)
    mx.eval(y)
    start = None
    for i in range(steps + 1):
        logits = engine.rounds.verify(y[:, None], cache, eager=not compiled)[0]
        cache.commit(ones)
        nxt = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
        mx.async_eval(nxt)
        y.item()  # read this step while the next one runs
        if i == 0:
            start = time.perf_counter()
        y = nxt
    y.item()
    return (time.perf_counter() - start) / steps


def one_stream(engine, context: int = 128, steps: int = 32, repeats: int = 3, seed: int = 0) -> Optional[dict]:
    """{"compiled": tok/s, "eager": tok/s, "faster": name} of one-row plain decoding, or None."""
    if engine.bank is None:
        return None
    rng = np.random.default_rng(seed)
    runs = {"compiled": [], "eager": []}
    for i in range(repeats + 1):
        for name in runs:
            t = _one_stream_seconds(engine, name == "compiled", context, steps if i else 4, rng)
            if i:
                runs[name].append(t)
    out = {name: 1 / float(np.median(ts)) for name, ts in runs.items()}
    out["faster"] = max(("compiled", "eager"), key=out.get)
    return out


def calibrate(engine, widths: Sequence[int] = DEFAULT_WIDTHS, depth: Optional[int] = None, context: int = 128,
              repeats: int = 3, log=None, seed: int = 0) -> dict:
    depth = engine.spec.depth if depth is None else depth
    rng = np.random.default_rng(seed)
    per_row = engine.row_bytes(context, depth + 1)
    widths = sorted(set(int(w) for w in widths))
    fits = [w for w in widths if w * per_row <= engine.memory_budget]
    skipped = [w for w in widths if w not in fits]
    verify: Dict[str, list] = {}
    for w in fits:
        costs = verify[str(w)] = _time_width(engine, w, depth + 1, context, repeats, rng)
        if log:
            log(f"width {w}: {w / costs[0]:.1f} tok/s plain; verify ms by length "
                + " ".join(f"{1000 * c:.2f}" for c in costs))
    single = one_stream(engine, context, repeats=repeats, seed=seed) if 1 in fits else None
    if log and single:
        log(f"one stream: compiled {single['compiled']:.1f} tok/s, eager {single['eager']:.1f} tok/s: "
            f"{single['faster']} runs one-row plain decoding")
    tps = {w: int(w) / c[0] for w, c in verify.items()}
    pays = {w: max(range(len(c)), key=lambda k: rate(c, k)) for w, c in verify.items()}
    return {"device": device_tag(), "model": str(engine.bundle.path), "config": config_tag(engine.bundle.config),
            "created": time.time(), "context": context, "depth": depth, "acceptance": ACCEPTANCE,
            "verify_seconds": verify, "tokens_per_second": tps, "depth_that_pays": pays,
            "best_width": int(max(tps, key=tps.get)) if tps else None, "one_stream": single,
            "skipped_widths": skipped}  # skipped: over the memory budget


def save_profile(profile: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_profile(path, config: Optional[dict] = None) -> Optional[dict]:
    """The profile at `path`, or None: none, unreadable, or measured on another device or config."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(profile, dict) and profile.get("device") == device_tag()
    return profile if ok and (config is None or profile.get("config") == config_tag(config)) else None


def auto_max_batch(profile: Optional[dict], memory_budget: int, row_bytes: int) -> int:
    want = (profile or {}).get("best_width") or AUTO_FALLBACK
    return max(1, min(int(want), int(memory_budget // max(row_bytes, 1))))


def one_stream_eager(profile: Optional[dict]) -> bool:
    """Whether one-row plain decoding runs eagerly: only where the profile measured it faster."""
    return ((profile or {}).get("one_stream") or {}).get("faster") == "eager"


def cost_shapes(profile: Optional[dict]) -> Dict[int, list]:
    """{width: verify cost by depth relative to depth 0}, for the depth controller."""
    return {int(w): [c / costs[0] for c in costs] for w, costs in (profile or {}).get("verify_seconds", {}).items()
            if costs and costs[0] > 0}
