"""Benchmarks: ours against peers in the same run (see run.py)."""

import mtplx  # noqa: F401  (first: MLX binds to OpenBLAS before any benchmark imports mlx.core)
