"""Shared pieces of the benchmark harness: timing, environment, tables."""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import mlx.core as mx


def device_name() -> str:
    dev = mx.default_device()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return f"{dev} {info.get('device_name', platform.processor() or platform.machine())}"


def versions() -> Dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("mlx", "mlx-lm", "mlx-cuda-13", "mlx-cpu", "torch", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def reset_peak():
    sync()
    mx.reset_peak_memory()


def peak_gb() -> float:
    """Peak memory MLX allocated since the last reset_peak(), in GB."""
    return mx.get_peak_memory() / 1e9


def sync():
    mx.synchronize() if hasattr(mx, "synchronize") else mx.eval(mx.array(0))


@dataclass
class Measure:
    """Repeats of one measurement; reports the median and the spread (min..max)."""

    values: List[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def spread(self) -> str:
        if len(self.values) < 2:
            return "n=1"
        return f"{min(self.values):.3g}..{max(self.values):.3g} (n={len(self.values)})"


def repeat(fn: Callable[[], float], repeats: int) -> Measure:
    """Run `fn` (which returns a rate or a time) `repeats` times."""
    return Measure([fn() for _ in range(repeats)])


def timed(fn: Callable[[], object]):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def speed_ratio(ours_tokens: int, ours_s: float, peer_tokens: int, peer_s: float, peer: str = "peer") -> Dict[str, object]:
    """Ours against a peer as tokens/s: the two sides may generate different token counts (sampled
    rows, different EOS timing), and then a ratio of wall times compares different work. The
    wall-time ratio is given only when both generated the same number of tokens."""
    ours_rate, peer_rate = ours_tokens / ours_s, peer_tokens / peer_s
    return {
        f"{peer} tokens": peer_tokens, "ours tokens": ours_tokens,
        f"{peer} tok/s": peer_rate, "ours tok/s": ours_rate,
        f"ours / {peer} (tok/s)": ours_rate / peer_rate,
        f"ours / {peer} (wall)": peer_s / ours_s if ours_tokens == peer_tokens else "n/a: token counts differ",
    }


def table(rows: List[Dict[str, object]], columns: Optional[List[str]] = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save_json(path, payload):
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
