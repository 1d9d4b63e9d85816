"""mtplx: the MLX generation engine behind mtplx-batch. Importing it changes nothing in the process
(mtplx/process.py lists what `prepare_process()` does)."""

__version__ = "0.1.0"
