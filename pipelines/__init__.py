"""pipelines: the job machinery of mtplx-batch: job (config), io (sources, sinks), execution (session, executors), cli."""

import mtplx  # noqa: F401  (first: it binds MLX to OpenBLAS before mlx.core loads, mtplx/blas.py)
