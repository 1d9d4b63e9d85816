"""The startup phases of a run: where the time from `mtplx-batch run` to the first generated token goes.

With `--log-json` the runner writes them as one `startup` line (seconds per phase):
    import       process start to the run (interpreter, imports, reading the job file)
    config       the job's input, fingerprint and run directory
    tokenizer    the tokenizer (once: the engine reuses it)
    weights      config.json, weights and MTP weights into memory
    engine       the engine's own setup (cache probe, compiled verify bank)
    first_token  the first prefill, to its first sampled token
    total        process start to the first token
`benchmarks/startup.py` times the same phases against mlx-lm's load and first token.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since this module loaded)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _MODULE_LOADED


_MODULE_LOADED = time.perf_counter()


class Startup:
    """Phase timer for one run; `lap(name)` adds the time since the last mark to `name`."""

    def __init__(self):
        self.began = time.perf_counter()
        self.phases: Dict[str, float] = {"import": process_age()}
        self.mark = self.began
        self.engine = None
        self.reported = False

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.mark
        self.mark = now

    def engine_loaded(self, engine) -> None:
        """Split the engine load into the bundle's own phases (tokenizer, weights) and the rest."""
        now = time.perf_counter()
        self.engine = engine
        own = dict(getattr(getattr(engine, "bundle", None), "phases", None) or {})
        for name in ("config", "tokenizer", "weights"):
            self.phases[name] = self.phases.get(name, 0.0) + own.get(name, 0.0)
        self.phases["engine"] = max(0.0, now - self.mark - sum(own.get(n, 0.0) for n in ("config", "tokenizer", "weights")))
        self.mark = now

    def report(self, emit: Callable[..., None]) -> None:
        """Emit the phases once, when the engine has produced its first token."""
        first = getattr(self.engine, "first_token_at", None)
        if self.reported or first is None:
            return
        self.reported = True
        self.phases["first_token"] = max(0.0, first - self.mark)
        self.phases["total"] = self.phases["import"] + first - self.began
        emit("startup", **{k: round(v, 3) for k, v in self.phases.items()})
