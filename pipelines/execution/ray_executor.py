"""`executor: ray`: the same job as a Ray Data pipeline, with the same rows, shards and resume.

    read + prepare (1 task)  ->  map_batches(JobPredictor, actor pool)  ->  driver
    row index, id, tokens,       one Engine per actor (`concurrency`     ShardWriter: writes and
    per-row errors, order;       actors, `num_gpus` each); returns       commits shards through
    committed keys skipped       output rows, writes nothing             RunDir (manifest.json)

Who writes what: the driver (this process) is the only writer of the run directory. It opens
the run with `RunDir.prepare` (fingerprint check, lock, leftover cleanup) and commits shards with
the local runner's `ShardWriter`, so the temp-write / fsync / rename / manifest-record sequence is
the same code on both executors. Actors only return result batches.

Why the input is read by one Ray task running the job's own reader rather than by
`ray.data.read_parquet` / `read_json` / `read_csv`: an output row is keyed by (input row index,
sample), and that index is the running row number over the sorted input files. Ray's readers
give no row positions (blocks arrive in any order, a file may split into several blocks), so the
index could not be rebuilt, and a resume of a run started on the other executor would then
regenerate or skip the wrong rows. They also differ on bad input: pyarrow's JSON reader fails the
whole file on one broken line where the local executor makes one error row, and `read_csv` infers
types (`"007"` becomes 7, changing ids and prompts). Reading, id derivation, duplicate-id checks,
prompt rendering and ordering are cheap next to generation, so the one reader task streams
prepared rows (Ray's backpressure bounds how far it runs ahead) and the actors do the expensive
part in parallel.

Exactly-once: keys in committed shards are skipped by the reader (before `map_batches`), and the
driver drops any key it already wrote in this session (a Ray task retry can deliver a batch twice).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import pyarrow as pa

from ..io.checkpoint import RunDir
from ..job.config import ExecutorConfig, JobConfig
from ..errors import JobError, RunError
from ..job.fingerprint import fingerprint_parts
from .ordering import ordered
from .ray_engine import PARAMS_COL, PREFIX_COL, SAMPLES_COL, SEED_COL, TOKENS_COL, JobPredictor, params_to_json
from ..io.rows import prepare
from .runner import RunSummary, load_tokenizer, open_job, resolve_model_dir
from ..io.sink import ShardWriter, output_schema

try:
    from ..cli.progress import DEFAULT_LOG_EVERY, Progress
except ImportError:  # pragma: no cover - older trees without pipelines/cli/progress.py
    DEFAULT_LOG_EVERY, Progress = 30.0, None

READ_BLOCK_ROWS = 256  # prepared rows per block handed from the reader to the actors
READER_CPUS = 0.5  # differs from the actors' 1 CPU on purpose: Ray does not fuse the two stages


def engine_max_context(job: JobConfig) -> int:
    """The context length `Engine` will use for this model (the reader checks prompts against it;
    each actor checks that its engine agrees)."""
    from mtplx.models.loading import context_length, model_config

    try:
        return context_length(model_config(job.model.path))
    except Exception as e:
        raise JobError(f"model.path: cannot read config.json of {job.model.path!r}: {e}")


def actor_batch_rows(job: JobConfig) -> int:
    """Input rows per actor call: a few engine batches, so continuous batching stays full."""
    return max(16, 4 * int(job.schedule.max_batch))


def reader_schema(keep_types) -> pa.Schema:
    return pa.schema(
        [("row", pa.int64()), ("id", pa.string()), ("error", pa.string()), (TOKENS_COL, pa.list_(pa.int64())),
         (SAMPLES_COL, pa.list_(pa.int64())), (PREFIX_COL, pa.int64()), (PARAMS_COL, pa.string()),
         (SEED_COL, pa.int64())]
        + [pa.field(n, t) for n, t in keep_types]
    )


def read_prepared(job: JobConfig, committed: np.ndarray, limit: Optional[int], max_context: int,
                  block_rows: int = READ_BLOCK_ROWS) -> Iterator[pa.Table]:
    """The input as prepared, ordered rows still to do, in blocks of `reader_schema`.

    The same steps as the local runner, with the same code: source rows -> `prepare` (row index,
    id, duplicate ids, tokens, per-row errors) -> skip (row, sample) keys already committed
    (`committed` holds row * n + sample) -> `ordered` (prefix groups / length, stable prefixes).
    """
    tokenizer = load_tokenizer(job)
    prep = open_job(job, tokenizer)
    if hasattr(prep.renderer, "warn"):  # openai-batch: ignored request fields, once each
        prep.renderer.warn = lambda msg: print(msg, file=sys.stderr)
    row_params = getattr(prep.renderer, "row_params", None)  # a request's own settings (openai-batch)
    base = job.generation.sampling_params()
    n = job.generation.n
    done = set(committed.tolist())
    items = prepare(prep.source.rows(), prep.renderer, job.input.id_column, job.output.keep_columns,
                    max_context, prep.check_keep, limit)
    pending = ((it, [s for s in range(n) if it.index * n + s not in done]) for it in items)
    order = ordered((p for p in pending if p[1]), job.schedule.order, lambda p: p[0].tokens,
                    job.ordering.window_rows, job.ordering.min_prefix_tokens, n)
    schema = reader_schema(prep.keep_types)
    block: List[Dict] = []
    for (item, samples), plen in order:
        own = row_params(item.id) if row_params is not None and item.tokens is not None else None
        row = {"row": item.index, "id": item.id, "error": item.error, TOKENS_COL: item.tokens,
               SAMPLES_COL: samples, PREFIX_COL: plen,
               PARAMS_COL: params_to_json(own.apply(base)) if own is not None else None,
               SEED_COL: own.seed if own is not None else None}
        row.update(item.keep)
        block.append(row)
        if len(block) >= block_rows:
            yield pa.Table.from_pylist(block, schema=schema)
            block = []
    if block:
        yield pa.Table.from_pylist(block, schema=schema)


def _read_stage(_seed: pa.Table, job: JobConfig, committed: np.ndarray, limit: Optional[int],
                max_context: int) -> Iterator[pa.Table]:
    yield from read_prepared(job, committed, limit, max_context)


def build_dataset(job: JobConfig, committed_keys, limit: Optional[int] = None):
    """The Ray Dataset of output rows still to do (not executed until iterated)."""
    import ray.data

    n = job.generation.n
    committed = np.fromiter((r * n + s for r, s in committed_keys), dtype=np.int64, count=len(committed_keys))
    max_context = engine_max_context(job)
    ex = job.executor
    seed = ray.data.from_items([{"part": 0}])  # one reader task; see the module docstring
    prepared = seed.map_batches(
        _read_stage, batch_size=None, batch_format="pyarrow", num_cpus=READER_CPUS,
        fn_kwargs={"job": job, "committed": committed, "limit": limit, "max_context": max_context},
    )
    actor_args = {"num_cpus": 1}
    if ex.num_gpus:
        actor_args["num_gpus"] = ex.num_gpus
    return prepared.map_batches(
        JobPredictor, fn_constructor_kwargs={"job": job, "max_context": max_context},
        batch_size=actor_batch_rows(job), batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=int(ex.concurrency)), **actor_args,
    )


def _worker_runtime_env() -> Optional[Dict]:
    """Local cluster workers run this interpreter with the driver's environment and working
    directory on their path; only a checkout that is neither installed nor the working directory
    needs its location passed on."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("mtplx-batch")
        return None
    except PackageNotFoundError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if os.path.abspath(os.getcwd()) == root or root in paths:
        return None
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([root] + paths)}}


@contextlib.contextmanager
def ray_session(ex: ExecutorConfig, quiet: bool, log: Callable[[str], None]):
    """Ray for the length of a run: the caller's if `ray.init` already ran in this process, else
    the cluster at `executor.address`, else a small local cluster started here (and stopped)."""
    import ray

    if ray.is_initialized():
        yield
        return
    level = logging.ERROR if quiet else logging.WARNING
    if ex.address:
        log(f"ray: connecting to {ex.address}")
        try:
            ray.init(address=ex.address, logging_level=level, log_to_driver=not quiet)
        except Exception as e:
            raise JobError(f"executor.address: cannot connect to the Ray cluster at {ex.address!r}: {e}")
    else:
        cpus = max(2, int(ex.concurrency) + 1)
        log(f"ray: starting a local cluster ({cpus} CPUs)")
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=level,
                 log_to_driver=not quiet, runtime_env=_worker_runtime_env())
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _quiet_ray_data(quiet: bool):
    from ray.data import DataContext

    ctx = DataContext.get_current()
    bars = ctx.enable_progress_bars
    ctx.enable_progress_bars = False  # the runner's own progress bar shows rows and tok/s
    logger = logging.getLogger("ray.data")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.enable_progress_bars = bars
        logger.setLevel(level)


class _NoProgress:
    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None


def run_job(job: JobConfig, restart: bool = False, limit: Optional[int] = None, quiet: bool = True,
            log: Optional[Callable[[str], None]] = None, log_json: bool = False,
            log_every: float = DEFAULT_LOG_EVERY) -> RunSummary:
    """Run (or resume) `job` on Ray; same contract as `pipelines.execution.runner.run_job`."""
    try:
        importlib.import_module("ray.data")
    except ImportError as e:
        raise JobError(f"executor: ray needs Ray Data ({e}): pip install 'mtplx-batch[ray]'")
    log = log or ((lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr)))
    tokenizer = load_tokenizer(job)
    prep = open_job(job, tokenizer)  # every fatal input problem is refused here, before Ray starts
    parts = fingerprint_parts(job, resolve_model_dir(job), prep.source.files)
    n = job.generation.n
    with RunDir.prepare(job.output.dir, job.to_yaml(), parts, restart=restart, log=log) as run:
        committed = run.committed_keys()
        total_rows = prep.source.count_rows()
        run.update(input_rows=total_rows, samples=n)
        wanted = None if total_rows is None else min(total_rows, limit if limit is not None else total_rows) * n
        done_before = sum(1 for r, _ in committed if limit is None or r < limit)
        summary = RunSummary(run_dir=run.path, skipped=len(committed))
        progress = (Progress or _NoProgress)(wanted, min(done_before, wanted or done_before),
                                             mode="json" if log_json else "off" if quiet else "bars",
                                             log_every=log_every)

        def on_commit(entry):
            summary.count_shard(entry)
            progress.committed(entry)

        sink = ShardWriter(run, output_schema(prep.keep_types), job.output.shard_rows, on_commit)
        written: set = set()
        repeats = 0
        started = time.monotonic()
        status, error = "failed", None
        try:
            with ray_session(job.executor, quiet, log), _quiet_ray_data(quiet):
                ds = build_dataset(job, committed, limit)
                progress.start(run_dir=run.path, job=job.name, executor="ray")
                try:
                    for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                        for row in table.to_pylist():
                            key = (row["row"], row["sample"])
                            if key in written or key in committed:
                                repeats += 1  # a retried Ray task delivered this row again
                                continue
                            written.add(key)
                            sink.add(row)
                            progress.finished(row, via_engine=False)
                finally:
                    sink.flush()  # finished rows are committed even when the run stops early
            if repeats:
                log(f"ray: dropped {repeats} rows delivered twice by retried tasks")
            if wanted is not None and done_before + len(written) < wanted:
                raise RunError(f"the Ray pipeline ended with {wanted - done_before - len(written)} rows "
                               "missing; they were not committed and a resume will generate them")
            status = "done"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except (JobError, RunError) as e:
            error = f"{type(e).__name__}: {e}"
            raise
        except Exception as e:  # a failed actor (engine crash, model load) or Ray itself
            error = f"{type(e).__name__}: {e}"
            raise RunError(f"the Ray pipeline failed: {type(e).__name__}: {e}. Committed shards are "
                           "kept; run the same command again to continue") from e
        finally:
            summary.seconds = time.monotonic() - started
            progress.close(summary, status, error)
    return summary
