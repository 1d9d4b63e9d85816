"""How large MLX's CUDA graphs are, chosen from the job and set through MLX's own variables before mlx.core loads.

MLX's CUDA backend records the kernels of an eval into a CUDA graph and launches it once it holds more
than MLX_MAX_OPS_PER_BUFFER kernels or its inputs more than MLX_MAX_MB_PER_BUFFER MB
(mlx/backend/cuda/device.cpp; 100 ops / 1000 MB on an sm_90 GPU such as the H200). MLX reads both once
per process, when its first GPU stream is made, i.e. when mlx.core loads, so one process gets one value.

Which value pays depends on the job (BENCHMARKS.md, session 9 and h10b), and must be read in tok/s, not as
a ratio to plain: a larger graph made plain decoding slower at every width measured (width 1: 269-303 tok/s
at 400 ops against 323 at 100; width 8: 1.33k against 2.03k; width 32: 5.2-5.3k against 5.8-6.3k), so "x plain"
rose while the job did not get faster; at widths 8 and 32 MTP ran slower at 400 too. A one-stream MTP round
is ~640 kernels, 6-7 graphs at 100 ops (h9d's trace), each graph a launch, an update and a destroy for the
host (25-200 us), which is the case for larger graphs there. So `TABLE` is keyed by (width bucket, plain
or speculative): the CLI (through pipelines' `run_job`), the Ray executor's actors and the benchmarks that
run a job call `apply_for` with the job's width and method before anything imports mlx.core. A variable the user set wins; once mlx.core
is loaded, or off Linux (MLX_MAX_OPS_PER_BUFFER is also a Metal setting), nothing is set.
`describe()` says what applied, for the run's log and summary.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, MutableMapping, Optional, Tuple, Union

ENABLED = True  # False: MLX's own defaults for every job (the A/B switch: fresh_cli --attr mtplx.cuda_graphs.ENABLED=0)
VARIABLES = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")

# Rows decoded together (schedule.max_batch, at most the rows the run has) -> bucket; "auto" (a calibrated
# width, known only once the model loads) counts as the widest.
BUCKETS = ((1, "1"), (16, "2-16"), (None, "17+"))

# (bucket, speculative) -> MLX's variable -> value; a key not here: MLX's defaults. H200, SmolLM2-135M,
# held-out HumanEval, fresh processes (raw logs benchmarks/results/h200-s9-final-ops400.log, h200-s10-*):
TABLE: Dict[Tuple[str, bool], Dict[str, str]] = {
    # No row pays yet, so every job gets MLX's defaults. One stream, MTP depth 3 at 400 ops: 464 / 562 tok/s
    # (7 / 3 repeats, two processes) against 502 at 100 (session 9's final window): inside the noise, and
    # never re-measured. Width 8 at 400 ops (session 10 window 1, 3 repeats): plain 1.32-1.33k tok/s against
    # 1.88-2.03k, MTP 3 1.83-2.03k against 2.28-2.67k. Width 32 (session 9, 64 / 128 rows): plain 5.3k / 5.2k
    # against 6.3k / 5.8k, MTP 3 5.9k / 6.8k against 6.9k / 7.7k.
}

applied: Dict[str, str] = {}  # what this process set
chosen: Optional[str] = None  # the table row apply_for looked up ("width 1, speculative"), or why none


def bucket(width: Union[int, str]) -> str:
    if not isinstance(width, int):
        return BUCKETS[-1][1]
    return next(name for top, name in BUCKETS if top is None or width <= top)


def limits_for(width: Union[int, str], method: str) -> Tuple[str, Dict[str, str]]:
    """(the table row's name, its limits) for `width` rows decoded together with speculative `method`."""
    spec = method != "none"
    row = f"width {bucket(width)}, {'speculative' if spec else 'plain'}"
    return row, dict(TABLE.get((bucket(width), spec), {}))


def apply(limits: Dict[str, str], environ: Optional[MutableMapping[str, str]] = None,
          platform: Optional[str] = None) -> Dict[str, str]:
    """Set the `limits` that `environ` (os.environ) does not have; returns what was set ({} once mlx.core
    is loaded, off Linux, or with nothing to set)."""
    environ = os.environ if environ is None else environ
    if not (platform or sys.platform).startswith("linux") or "mlx.core" in sys.modules:
        return {}
    done = {k: v for k, v in limits.items() if k not in environ}
    environ.update(done)
    applied.update(done)
    return done


def apply_for(width: Union[int, str], method: str, environ: Optional[MutableMapping[str, str]] = None,
              platform: Optional[str] = None) -> Dict[str, str]:
    """The table's limits for this job, set where the user did not set them (see `apply`)."""
    global chosen
    if not (platform or sys.platform).startswith("linux"):
        chosen = "not Linux: no CUDA backend"
        return {}
    if "mlx.core" in sys.modules:
        chosen = chosen or "mlx.core loaded before the job was read"
        return {}
    if not ENABLED:
        chosen = "off (cuda_graphs.ENABLED)"
        return {}
    chosen, limits = limits_for(width, method)
    return apply(limits, environ, platform)


def describe(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, object]:
    """What MLX reads in this process: {"table": the row apply_for chose (or why none; None before it ran),
    VARIABLE: "VALUE (table|yours)" for each one set, "set": whether any is, "line": all that in words
    (None off Linux)}."""
    environ = os.environ if environ is None else environ
    out: Dict[str, object] = {"table": chosen}
    for k in VARIABLES:
        if k in environ:
            out[k] = f"{environ[k]} ({'table' if applied.get(k) == environ[k] else 'yours'})"
    out["set"] = any(k in out for k in VARIABLES)  # a limit in effect, not MLX's defaults
    values = ", ".join(f"{k}={out[k]}" for k in VARIABLES if k in out) or "MLX's defaults"
    row = f"; table row: {chosen}" if chosen else ""
    out["line"] = f"MLX CUDA graphs: {values}{row}" if sys.platform.startswith("linux") else None
    return out
