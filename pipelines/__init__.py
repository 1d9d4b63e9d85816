"""pipelines: the job machinery of mtplx-batch (config, sources, sinks, runner, CLI)."""

import mtplx  # noqa: F401  (first: it binds MLX to OpenBLAS before mlx.core loads, mtplx/blas.py)
