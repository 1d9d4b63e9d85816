"""Benchmarks: ours against peers in the same run (`python -m benchmarks.run`)."""

from mtplx.process import prepare_process

prepare_process()  # first: MLX binds to OpenBLAS before any benchmark imports mlx.core
