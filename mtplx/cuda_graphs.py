"""How large MLX's CUDA graphs are, set through MLX's own variables before mlx.core loads.

MLX's CUDA backend records the kernels of an eval into a CUDA graph and launches it once it holds more
than MLX_MAX_OPS_PER_BUFFER kernels or its inputs more than MLX_MAX_MB_PER_BUFFER MB
(mlx/backend/cuda/device.cpp; 100 ops / 1000 MB on an sm_90 GPU such as the H200). MLX reads both once,
when its first GPU stream is made, i.e. when mlx.core loads. `apply()` gives MLX the values in LIMITS
that the environment does not already set (a user's own setting wins), and only while mlx.core is not
yet loaded; `import mtplx` calls it, as it binds OpenBLAS (mtplx/blas.py), so the CLI, the engine and
the benchmarks, which import mtplx first, all run with it. Where MLX has no CUDA backend the variables
mean nothing to it (MLX_MAX_OPS_PER_BUFFER is also a Metal setting, so this is Linux only).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, MutableMapping, Optional

# MLX's own variable -> value; empty: MLX's defaults (benchmarks/step_overhead measures the settings)
LIMITS: Dict[str, str] = {}
applied: Dict[str, str] = {}  # what apply() set in this process


def apply(environ: Optional[MutableMapping[str, str]] = None, platform: Optional[str] = None) -> Dict[str, str]:
    """Set the LIMITS that `environ` (os.environ) does not have; returns what was set ({} once mlx.core
    is loaded, off Linux, or with nothing to set)."""
    environ = os.environ if environ is None else environ
    if not (platform or sys.platform).startswith("linux") or "mlx.core" in sys.modules:
        return {}
    done = {k: v for k, v in LIMITS.items() if k not in environ}
    environ.update(done)
    applied.update(done)
    return done
