"""Rows per second through the Ray executor with 2 actors against the local executor: the same job
(`--ray-job`, `--rows` rows) in fresh `mtplx-batch run` processes, one untimed run each, then
`--repeats` rounds in rotating order. On a CPU each actor runs its own engine; `x local` is the
median per-round ratio of rows/s. Where Ray is not installed the part says so and skips.

    python -m benchmarks.run --suite cpu --parts ray --rows 8 --tokens 16
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from .common import Report, interleaved, median, spread
from .jobs import ours

EXECUTORS = {"local": ["executor.type=local"], "ray, 2 actors": ["executor.type=ray", "executor.concurrency=2"]}


def run(opts, report: Report):
    if importlib.util.find_spec("ray") is None:
        report.note("skipped: Ray is not installed (`pip install ray`)")
        return
    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    common = [f"input.limit={opts.rows}"] + ([f"generation.max_tokens={opts.tokens}"] if "tokens" in opts.explicit else [])
    runs = {label: ours(opts.ray_job, common + sets, work / f"run{i}") for i, (label, sets) in enumerate(EXECUTORS.items())}
    for label, once in runs.items():
        report.say(f"{label}: untimed first run {once()['wall s']:.2f} s")
    done = interleaved(runs, opts.repeats, report.say)
    local = done["local"]
    for label, rs in done.items():
        report.row(f"{Path(opts.ray_job).name}, {opts.rows} rows, median of {opts.repeats}", executor=label,
                   rows=rs[0]["rows"], **{"wall s": median([r["wall s"] for r in rs]),
                                          "spread": spread([r["wall s"] for r in rs]),
                                          "rows/s": median([r["rows"] / r["wall s"] for r in rs]),
                                          "x local": median([lr["wall s"] / r["wall s"] for r, lr in zip(rs, local)])})
