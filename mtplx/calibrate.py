"""A per-machine calibration: what a verify costs here, by batch width and verify length.

`calibrate(engine)` times the engine's own verify forward (the compiled bank when it is on)
over W rows of `context` cached tokens, for every verify length 1..depth+1 and every width that
fits the memory budget, and returns a profile:

    verify_seconds      {width: [seconds of a verify of length 1, 2, ...]}
    tokens_per_second   {width: plain decoding, width / verify_seconds[width][0]}
    depth_that_pays     {width: the depth with the most tokens per second at `acceptance`}
    best_width          the width with the most plain tokens per second
    one_stream          one row's plain decoding, pipelined as the engine runs it: tokens/s of the
                        compiled program and of the eager forward, and the `faster` of the two

The profile is JSON, stored beside the converted model by default (`profile_path`), with the
device and model config it was measured on; `mtplx-batch calibrate MODEL [--out PROFILE]` writes
one. The engine reads it for `schedule.max_batch: auto` (`auto_max_batch`), the depth controller's
cost curves (`cost_shapes`) and one row's plain decoding (`one_stream_eager`: both paths give the
same logits; which is faster depends on whether the host or the device bounds a step).
"""

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


def _verify(engine, tokens: mx.array, cache) -> mx.array:
    if engine.bank is not None:
        return engine.bank.verify(tokens, cache)[0]
    cache.set_capturing(True)
    try:
        return engine.runtime.forward(tokens, cache)[0]
    finally:
        cache.set_capturing(False)


def _prefilled(engine, width: int, context: int, rng):
    """(a cache of `width` rows holding `context` random tokens each, the prefill's logits)."""
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
            mx.eval(_verify(engine, tokens, cache))
            cache.commit(np.zeros(width, dtype=np.int64))  # rejected: the cache stays at `context`
            cache.eval()
            if i >= 2:
                times.append(time.perf_counter() - t)
        out.append(float(np.median(times)))
    return out


def _one_stream_seconds(engine, compiled: bool, context: int, steps: int, rng) -> float:
    """Seconds per token of one row's plain decoding, pipelined as the engine runs it (step i+1
    queued before step i is read): through the compiled bank, or the eager forward."""
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
    """Plain one-row decoding through the compiled bank and eagerly, each run once untimed, then
    `repeats` times in turn (median): {"compiled": tok/s, "eager": tok/s, "faster": name}. None when
    the engine has no compiled bank (then every forward is eager anyway)."""
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
    """Measure this machine (see the module docstring); `log(message)` hears each width."""
    depth = engine.spec.depth if depth is None else depth
    rng = np.random.default_rng(seed)
    per_row = engine.row_bytes(context, depth + 1)
    widths = sorted(set(int(w) for w in widths))
    fits = [w for w in widths if w * per_row <= engine.memory_budget]
    skipped = [w for w in widths if w not in fits]
    verify: Dict[str, list] = {}
    for w in fits:
        verify[str(w)] = _time_width(engine, w, depth + 1, context, repeats, rng)
        if log:
            costs = verify[str(w)]
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
    """The profile at `path`, or None when there is none, it is unreadable, or it was measured on
    another device or for another model config."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(profile, dict) and profile.get("device") == device_tag()
    return profile if ok and (config is None or profile.get("config") == config_tag(config)) else None


def auto_max_batch(profile: Optional[dict], memory_budget: int, row_bytes: int) -> int:
    """`schedule.max_batch: auto`: the profile's best width (or AUTO_FALLBACK), never more rows
    than `memory_budget // row_bytes` (rows of AUTO_ROW_TOKENS tokens), and at least 1."""
    want = (profile or {}).get("best_width") or AUTO_FALLBACK
    return max(1, min(int(want), int(memory_budget // max(row_bytes, 1))))


def one_stream_eager(profile: Optional[dict]) -> bool:
    """Whether one-row plain decoding runs eagerly: only where the profile measured it faster."""
    return ((profile or {}).get("one_stream") or {}).get("faster") == "eager"


def cost_shapes(profile: Optional[dict]) -> Dict[int, list]:
    """{width: verify cost by depth, relative to depth 0}: what the depth controller starts from."""
    if not profile:
        return {}
    return {int(w): [c / costs[0] for c in costs] for w, costs in profile.get("verify_seconds", {}).items()
            if costs and costs[0] > 0}
