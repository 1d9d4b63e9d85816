"""What users see: the `mtplx-batch` commands, progress, status, report and validate."""

from .commands import entry, main  # noqa: F401 (the console script `pipelines.cli:entry`)
