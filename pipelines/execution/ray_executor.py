"""`executor: ray`: the same job as a Ray Data pipeline, with the same rows, shards and resume.

    read + prepare (1 task)  ->  map_batches(JobPredictor, actor pool)  ->  driver
    row index, id, tokens,       one Engine per actor (`concurrency`     ShardWriter: writes and
    per-row errors, order;       actors, `num_gpus` each), one long      commits shards through
    committed keys skipped       generate() fed from the batches it      RunDir (manifest.json)
                                 is handed, two at once; streams out
                                 output rows as they finish, writes
                                 nothing

Who writes what: the driver (this process) is the only writer of the run directory. The job
session (session.py) opens the run and commits shards, the same code as on the local executor;
this module only supplies the stream of output rows (`ray_rows`). Actors only return result
batches.

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
import inspect
import logging
import os
import sys
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import pyarrow as pa

from ..errors import JobError, RunError
from ..io.records import CommittedKeys
from ..io.job_input import open_job
from ..job.config import ExecutorConfig, JobConfig
from .opening import load_tokenizer, model_max_context
from .ray_engine import PARAMS_COL, PREFIX_COL, SAMPLES_COL, SEED_COL, TOKENS_COL, JobPredictor, params_to_json
from .work import plan

READ_BLOCK_ROWS = 256  # prepared rows per table the reader yields
# Ray Data joins what a task yields into blocks of up to this many bytes (its default: 128 MiB) and
# hands a block on only once it is full or the task ends: at that size the reader's whole output
# was one block, so one actor got every row, and an actor's rows left it only with its batch. At
# this size prepared rows reach the actors as they are read, spread over all of them, and output
# rows stream back a few dozen at a time.
BLOCK_BYTES = 16 * 1024
READER_CPUS = 0.5  # differs from the actors' 1 CPU on purpose: Ray does not fuse the two stages


def check_ray() -> None:
    try:
        importlib.import_module("ray.data")
    except ImportError as e:
        raise JobError(f"executor: ray needs Ray Data ({e}): pip install 'mtplx-batch[ray]'")


CALLS_PER_ACTOR = 2  # batches an actor works on at once (see actor_compute)


def actor_compute(actors: int):
    """The actor pool: `actors` engines, each handed CALLS_PER_ACTOR batches at once, so the next
    batch's rows join the engine's one long generate() while the last rows of a batch finish
    (ray_engine.EngineLoop). A Ray Data without concurrent calls (before 2.5x) runs an actor's
    batches one after another: the same rows, each batch draining before the next starts."""
    import ray.data

    options = inspect.signature(ray.data.ActorPoolStrategy).parameters
    if {"max_concurrent_calls_per_actor", "enable_true_multi_threading"} <= set(options):
        return ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
                                          enable_true_multi_threading=True)
    return ray.data.ActorPoolStrategy(size=actors)


def actor_batch_rows(job: JobConfig) -> int:
    """Input rows per actor call: a few engine batches, so continuous batching stays full."""
    mb = job.schedule.max_batch
    return max(16, 4 * (int(mb) if mb != "auto" else 32))


def reader_schema(keep_types) -> pa.Schema:
    return pa.schema(
        [("row", pa.int64()), ("id", pa.string()), ("error", pa.string()), (TOKENS_COL, pa.list_(pa.int64())),
         (SAMPLES_COL, pa.list_(pa.int64())), (PREFIX_COL, pa.int64()), (PARAMS_COL, pa.string()),
         (SEED_COL, pa.int64())]
        + [pa.field(n, t) for n, t in keep_types]
    )


def read_prepared(job: JobConfig, committed: np.ndarray, limit: Optional[int], max_context: int,
                  block_rows: int = READ_BLOCK_ROWS) -> Iterator[pa.Table]:
    """The job's rows still to do (`work.plan`, the local executor's code), in blocks of
    `reader_schema`; `committed` holds row * n + sample of every committed key."""
    tokenizer = load_tokenizer(job)
    prep = open_job(job, tokenizer)
    if hasattr(prep.renderer, "warn"):  # openai-batch: ignored request fields, once each
        prep.renderer.warn = lambda msg: print(msg, file=sys.stderr)
    n = job.generation.n
    done = CommittedKeys.of(committed // n, committed % n)
    schema = reader_schema(prep.keep_types)
    block: List[Dict] = []
    for w in plan(job, prep, done, limit, max_context):
        item = w.item
        row = {"row": item.index, "id": item.id, "error": item.error, TOKENS_COL: item.tokens,
               SAMPLES_COL: list(w.samples), PREFIX_COL: w.prefix, PARAMS_COL: params_to_json(w.params),
               SEED_COL: w.seed_base}
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


def build_dataset(job: JobConfig, committed_keys: CommittedKeys, limit: Optional[int] = None):
    """The Ray Dataset of output rows still to do (not executed until iterated)."""
    import ray.data

    n = job.generation.n
    committed = committed_keys.flat(n)
    max_context = model_max_context(job)
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
        batch_size=actor_batch_rows(job), batch_format="pyarrow", compute=actor_compute(int(ex.concurrency)),
        **actor_args,
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
def ray_data_context(quiet: bool):
    """Ray Data's settings for a run, put back afterwards: no bars of its own, and small blocks."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    bars, block_bytes = ctx.enable_progress_bars, ctx.target_max_block_size
    ctx.enable_progress_bars = False  # the session's own progress bar shows rows and tok/s
    ctx.target_max_block_size = BLOCK_BYTES
    logger = logging.getLogger("ray.data")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.enable_progress_bars, ctx.target_max_block_size = bars, block_bytes
        logger.setLevel(level)


def ray_rows(session) -> Iterator[tuple]:
    """The session's output rows from a Ray Data pipeline (never via this process's engine).
    A Ray task retry can deliver a batch twice: keys already seen are dropped here."""
    job, log = session.job, session.log
    seen = set()  # keys this session delivered (session.committed: the earlier sessions')
    repeats = 0
    try:
        with ray_session(job.executor, session.quiet, log), ray_data_context(session.quiet):
            ds = build_dataset(job, session.committed, session.limit)
            session.begin(executor="ray")
            for table in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                for row in table.to_pylist():
                    key = (row["row"], row["sample"])
                    if key in seen or key in session.committed:
                        repeats += 1
                        continue
                    seen.add(key)
                    yield row, False
    except (JobError, RunError):
        raise
    except Exception as e:  # a failed actor (engine crash, model load) or Ray itself
        raise RunError(f"the Ray pipeline failed: {type(e).__name__}: {e}. Committed shards are "
                       "kept; run the same command again to continue") from e
    if repeats:
        log(f"ray: dropped {repeats} rows delivered twice by retried tasks")
