"""Running a job: one session, whichever executor generates the rows; resumable at any point.

    run_job()      open the job (tokenizer, input, prompt rendering), fingerprint it, open the
                   run directory (RunDir.prepare: create, resume or refuse), count what is done
    executor       the stream of output rows still to do: `local_rows` (one engine here) or
                   `ray_rows` (Ray Data actors); each reads the job through `work.plan`
    ShardWriter    every output row, committed shard by shard (RunDir.record_shard)
    Progress       counts, JSON lines, the caller's bars; RunSummary: what this session did

The pipeline is a chain of generators, so rows stream through and only one ordering window
plus the engine's in-flight requests are held in memory.

Exactly-once: an output row is keyed by (row index, sample). Keys in committed shards are
skipped; everything else is (re)generated. Row indices are stable because the fingerprint pins
the input files.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from ..errors import RunError
from ..io.checkpoint import RunDir
from ..io.records import PROGRESS_FILE, CommittedKeys, totals
from ..io.columns import output_schema
from ..io.figures import per_second
from ..io.job_input import Prepared, open_job
from ..io.sink import ShardWriter
from ..job.config import JobConfig
from ..job.fingerprint import fingerprint_parts
from .opening import load_tokenizer, resolve_model_dir
from .progress import DEFAULT_LOG_EVERY, Progress, json_line, json_logger
from .startup import Startup

Rows = Iterator[Tuple[Dict[str, Any], bool]]  # (output row, reached the engine)


@dataclass
class RunSummary:
    run_dir: str
    outputs: int = 0  # output rows committed by this session
    errors: int = 0  # of those, error rows
    skipped: int = 0  # (row, sample) pairs already committed by an earlier session
    completion_tokens: int = 0
    seconds: float = 0.0  # active seconds: the `elapsed` of the shards this session committed (figures.py)
    shards: int = 0  # shards committed by this session
    peak_rss_bytes: int = 0  # the process's peak resident memory (what the OS counts)
    peak_mlx_bytes: int = 0  # MLX's own peak: weights, caches, activations (0 before MLX loads)

    @property
    def tokens_per_second(self) -> float:
        return per_second(self.completion_tokens, self.seconds)

    def measure_memory(self) -> None:
        self.peak_rss_bytes = peak_rss_bytes()
        mx = sys.modules.get("mlx.core")
        if mx is not None and hasattr(mx, "get_peak_memory"):
            self.peak_mlx_bytes = int(mx.get_peak_memory())

    def count_shard(self, entry: dict) -> None:
        """Add a committed shard's manifest entry to this session's totals."""
        self.shards += 1
        self.outputs += entry["rows"]
        self.errors += entry["errors"]
        self.completion_tokens += entry["completion_tokens"]
        self.seconds += entry["elapsed"]


def peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


@dataclass
class Session:
    """One session of a run: what an executor reads (`job`, `prep`, `committed`, `limit`) and
    what it calls (`log`, `begin` once generation starts, `progress.submitted`)."""

    job: JobConfig
    prep: Prepared
    run: RunDir
    committed: CommittedKeys
    limit: Optional[int]
    total_rows: Optional[int]
    log: Callable[[str], None]
    quiet: bool = True
    progress_mode: str = "off"
    log_every: float = DEFAULT_LOG_EVERY
    progress: Optional[Progress] = None
    started: float = field(default_factory=time.monotonic)
    startup: Startup = field(default_factory=Startup)
    bars: Optional[Callable[[Progress], Any]] = None  # draws the progress (run_job's `bars`)
    sink: Optional[ShardWriter] = None  # its active time starts with `begin`

    def report_startup(self) -> None:
        """With --log-json: the `startup` line, once the first token is out."""
        if self.progress_mode == "json":
            self.startup.report(json_line)

    @property
    def wanted(self) -> Optional[int]:
        """Output rows this run has when done (None: the input cannot say without reading it)."""
        if self.total_rows is None:
            return None
        rows = self.total_rows if self.limit is None else min(self.total_rows, self.limit)
        return rows * self.job.generation.n

    @property
    def done_before(self) -> int:
        """Rows within `limit` committed by earlier sessions."""
        return len(self.committed) if self.limit is None else self.committed.rows_below(self.limit)

    def _new_progress(self) -> Progress:
        wanted, done = self.wanted, self.done_before
        return Progress(wanted, min(done, wanted or done), mode=self.progress_mode, log_every=self.log_every,
                        max_tokens=self.job.generation.max_tokens,
                        record_path=os.path.join(self.run.path, PROGRESS_FILE), view=self.bars)

    @property
    def finished(self) -> bool:
        """Every output row this session wants is committed already (nothing to load or run)."""
        if self.total_rows is None:
            return False
        rows = self.total_rows if self.limit is None else min(self.total_rows, self.limit)
        n = self.job.generation.n
        return self.committed.has_all(rows, n)

    def begin(self, **fields: Any) -> None:
        """Generation starts now (the engine or the cluster is up): the clock and the progress."""
        self.started = time.monotonic()
        if self.sink is not None:
            self.sink.start_clock()
        self.progress = self._new_progress()
        self.progress.start(run_dir=self.run.path, job=self.job.name, **fields)


def all_errors(run: RunDir, example: Optional[Tuple[int, str]] = None) -> Optional[RunError]:
    """The failure of a run whose every committed output row is an error row (nothing was
    generated), or None. `example`: (row, error) of one of them."""
    t = totals(run.manifest)
    if not t["rows"] or t["errors"] < t["rows"]:
        return None
    seen = f" (row {example[0]}: {example[1]})" if example else ""
    return RunError(f"every one of the {t['rows']} output rows is an error row{seen}: nothing was generated. "
                    f"They are committed in {run.path} (`mtplx-batch report {run.path}` lists them); fix the "
                    "cause and run again with --restart")


def executor_rows(job: JobConfig, engine=None) -> Callable[[Session], Rows]:
    """The executor the job names (`engine` given: that engine, here)."""
    if engine is not None or job.executor.type == "local":
        from .local import local_rows

        return functools.partial(local_rows, engine=engine)
    from .ray_executor import check_ray, ray_rows

    check_ray()
    return ray_rows


def run_job(job: JobConfig, restart: bool = False, limit: Optional[int] = None, engine=None,
            quiet: bool = True, log: Optional[Callable[[str], None]] = None, log_json: bool = False,
            log_every: float = DEFAULT_LOG_EVERY, bars: Optional[Callable[[Progress], Any]] = None) -> RunSummary:
    """Run (or resume) `job`; returns what this session did.

    Raises JobError (nothing ran, no weights loaded) when the job, its input or its run
    directory is refused, and RunError when the run breaks; committed shards stay valid either
    way. `engine` (anything with `tokenizer`, `max_context` and `generate(requests)`) replaces
    the one `job.model`/`speculative`/`schedule` would load; `limit` takes the first N rows.
    Progress (pipelines/execution/progress.py): `bars(progress)` draws it unless `quiet` (the CLI
    passes its tqdm bars); with `log_json` JSON lines on stderr instead (start, shard commits,
    progress every `log_every` s, summary).
    """
    startup = Startup()
    if limit is None:
        limit = job.input.limit
    if log_json and log is None:
        log = json_logger()
    log = log or ((lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr)))
    rows = executor_rows(job, engine)
    startup.lap("config")
    tokenizer = engine.tokenizer if engine is not None else load_tokenizer(job)
    startup.lap("tokenizer")
    prep = open_job(job, tokenizer)  # every fatal input problem is refused here, before any write
    if hasattr(prep.renderer, "warn"):
        prep.renderer.warn = log  # openai-batch: one line per ignored request field
    parts = fingerprint_parts(job, resolve_model_dir(job), prep.source.files, prep.source.revision)
    total_rows = prep.source.count_rows()  # reads the input to the end: refuses a truncated file before any write
    with RunDir.prepare(job.output.dir, job.to_yaml(), parts, restart=restart, log=log) as run:
        committed = run.committed_keys()
        # The run's plan is the stored job's (input.limit, which `resume` keeps); --limit only
        # bounds this session. status / report / export read planned_rows.
        job_limit = job.input.limit
        planned = None if total_rows is None else min(total_rows, total_rows if job_limit is None else job_limit)
        run.update(input_rows=total_rows, samples=job.generation.n, planned_rows=planned, limit=job_limit)
        s = Session(job, prep, run, committed, limit, total_rows, log, quiet, "json" if log_json else "off",
                    log_every, startup=startup, bars=None if quiet or log_json else bars)
        startup.lap("config")
        summary = RunSummary(run_dir=run.path, skipped=len(committed))
        if s.finished:  # checked before any model loads
            failed = all_errors(run)
            if failed is not None:
                raise failed
            log(f"finished: all {s.wanted} output rows are committed in {run.path}; nothing to do "
                "(--restart starts over)")
            summary.measure_memory()
            if log_json:
                done = Progress(s.wanted, s.wanted, mode="json", log_every=0)
                done.start(run_dir=run.path, job=job.name)
                done.close(summary, "done")
            return summary

        def on_commit(entry):
            s.report_startup()
            summary.count_shard(entry)
            if s.progress is not None:
                s.progress.committed(entry)

        sink = s.sink = ShardWriter(run, output_schema(prep.keep_types), job.output.shard_rows, on_commit)
        added = 0
        example = None  # (row, error) of an error row, for the message of a run that is all errors
        status, error = "failed", None
        try:
            with contextlib.closing(rows(s)) as stream:
                for row, via_engine in stream:
                    sink.add(row)
                    s.progress.finished(row, via_engine)
                    added += 1
                    if example is None and row["finish_reason"] == "error":
                        example = (row["row"], row["error"])
            s.report_startup()
            missing = (s.wanted or 0) - s.done_before - added
            if s.wanted is not None and missing > 0:
                raise RunError(f"the run ended with {missing} rows missing; they were not committed "
                               "and a resume will generate them")
            sink.flush()
            failed = all_errors(run, example)
            if failed is not None:
                raise failed
            run.finish()
            status = "done"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            try:
                sink.flush()  # finished rows are committed even when the run stops early
            except BaseException as e:
                status, error = "failed", error or f"{type(e).__name__}: {e}"
                raise
            finally:
                summary.measure_memory()
                if s.progress is None:  # stopped before generation began: still one summary
                    s.progress = s._new_progress()
                s.progress.close(summary, status, error)
    return summary
