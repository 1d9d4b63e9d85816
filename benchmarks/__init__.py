"""Benchmarks: ours against peers in the same run (see run.py)."""

from mtplx.process import prepare_process

prepare_process()  # first: MLX binds to OpenBLAS before any benchmark imports mlx.core
