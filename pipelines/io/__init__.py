"""Rows in and out: sources, prompt rendering, the Parquet sink, the run directory, exports."""
