"""mtplx: the MLX generation engine behind mtplx-batch."""

__version__ = "0.1.0"
