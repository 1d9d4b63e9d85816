"""Benchmarks: ours against peers in the same run (`python -m benchmarks.run`)."""

from mtplx.blas import use_openblas

use_openblas()  # before mlx.core loads: on a Linux CPU our engine and the mlx-lm peers run on the same OpenBLAS
