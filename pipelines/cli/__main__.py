"""`python -m pipelines.cli ...`, the same as the `mtplx-batch` console script."""

from .commands import main

main(prog_name="mtplx-batch")
