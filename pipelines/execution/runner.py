"""Running a job: read -> prepare -> order -> engine -> shards, resumable at any point.

The pipeline is a chain of generators, so rows stream through and only one ordering window
plus the engine's in-flight requests are held in memory:

    source.rows()          SourceRow per input row, running index
    rows.prepare()         Item: id, prompt tokens, or the reason the row cannot run
    ordering.ordered()     scheduling order within a window, stable prefix lengths
    _requests()            one Request per (row, sample) not yet committed; error rows go
                           straight to the sink from here
    engine.generate()      Results, in completion order
    ShardWriter            output rows, committed shard by shard through the manifest

Exactly-once: an output row is keyed by (row index, sample). Keys in committed shards are
skipped; everything else is (re)generated. Row indices are stable because the fingerprint pins
the input files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple

from mtplx.request import Request, Result, RowStats, derive_seed

from ..io.checkpoint import RunDir
from ..job.config import JobConfig
from ..errors import JobError, RunError
from ..job.fingerprint import fingerprint_parts
from .ordering import ordered
from ..cli.progress import DEFAULT_LOG_EVERY, Progress, json_logger
from ..io.prompts import PromptRenderer
from ..io.rows import Item, keep_checker, prepare
from ..io.sink import ShardWriter, output_schema
from ..io.sources import Source, open_source


@dataclass
class RunSummary:
    run_dir: str
    outputs: int = 0  # output rows committed by this session
    errors: int = 0  # of those, error rows
    skipped: int = 0  # (row, sample) pairs already committed by an earlier session
    completion_tokens: int = 0
    seconds: float = 0.0
    shards: int = 0  # shards committed by this session

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    def count_shard(self, entry: dict) -> None:
        """Add a committed shard's manifest entry to this session's totals."""
        self.shards += 1
        self.outputs += entry["rows"]
        self.errors += entry["errors"]
        self.completion_tokens += entry["completion_tokens"]


def load_engine(job: JobConfig):
    try:
        from mtplx.generation import Engine
    except ImportError as e:
        raise RunError(f"the generation engine is not available ({e})")
    return Engine.load(job.model.path, job.speculative, job.schedule,
                       trust_remote_code=job.model.trust_remote_code)


def check_remote_code(job: JobConfig) -> None:
    """Refuse (before anything loads) a model whose config.json names a Python file to run
    (`model_file`, which mlx-lm would import), unless the job sets model.trust_remote_code."""
    if job.model.trust_remote_code:
        return
    path = os.path.join(resolve_model_dir(job), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # a missing or broken config.json is reported by the loader
    if isinstance(config, dict) and config.get("model_file") is not None:
        raise JobError(
            f"model.path: {path} sets model_file: {config['model_file']!r}, Python code shipped with the "
            "model that would run on load; running it is off by default. If you trust this model, set "
            "model.trust_remote_code: true in the job"
        )


def load_tokenizer(job: JobConfig):
    from mtplx.models.loading import load_tokenizer_only

    check_remote_code(job)
    try:
        return load_tokenizer_only(job.model.path)
    except Exception as e:  # missing dir, bad tokenizer files: all mean the job cannot run
        raise JobError(f"model.path: cannot load a tokenizer from {job.model.path!r}: {e}")


def resolve_model_dir(job: JobConfig) -> str:
    from mtplx.models.loading import resolve_model_path

    try:
        return str(resolve_model_path(job.model.path))
    except Exception as e:
        raise JobError(f"model.path: {e}")


@dataclass
class Prepared:
    """Everything checked and opened before any weights load."""

    source: Source
    renderer: PromptRenderer
    keep_types: list
    check_keep: Optional[Callable]


def open_job(job: JobConfig, tokenizer) -> Prepared:
    """Open the input and prompt rendering; any problem here is a JobError (exit 2)."""
    if job.input.format == "openai-batch":
        from ..io.openai_batch import OpenAIBatchRenderer  # refuses rows with unsupported body fields

        renderer = OpenAIBatchRenderer(job.input, tokenizer, job.generation.n)
    else:
        renderer = PromptRenderer(job.input, tokenizer)
    keep = job.output.keep_columns
    # The row id hashes the whole row when there is no id column, so then every column is read.
    if job.input.id_column is None:
        columns = None
    else:
        columns = list(dict.fromkeys(renderer.columns + [job.input.id_column] + list(keep)))
    source = open_source(job.input, columns)
    schema = source.schema()
    if schema is not None:
        missing = [c for c in keep if c not in schema.names]
        if missing:
            raise JobError(f"output.keep_columns: the input has no column {missing[0]!r} "
                           f"(has: {', '.join(schema.names)})")
    keep_types = [(c, source.column_type(c)) for c in keep]
    check_keep = keep_checker(keep_types) if schema is None and keep_types else None
    return Prepared(source, renderer, keep_types, check_keep)


def _output_row(item: Item, sample: int, seed: int, result: Optional[Result] = None,
                error: Optional[str] = None, stable_prefix_len: int = 0) -> Dict[str, Any]:
    st = result.stats if result is not None else RowStats()
    failed = error is not None or (result is not None and result.finish_reason == "error")
    row = {
        "id": item.id,
        "row": item.index,
        "sample": sample,
        "completion": None if failed else result.text,
        "finish_reason": "error" if failed else result.finish_reason,
        "error": error if error is not None else ((result.error or "engine error") if failed else None),
        "prompt_tokens": st.prompt_tokens or len(item.tokens or ()),
        "completion_tokens": st.completion_tokens or (len(result.tokens) if result and not failed else 0),
        "cached_prompt_tokens": st.cached_prompt_tokens,
        "prefill_chunks": st.prefill_chunks,
        "verify_calls": st.verify_calls,
        "drafted_tokens": st.drafted_tokens,
        "accepted_tokens": st.accepted_tokens,
        "acceptance_rate": st.acceptance_rate,
        "tokens_per_verify": st.tokens_per_verify,
        "accepted_by_depth": list(st.accepted_by_depth),
        "compiled_verify_calls": st.compiled_verify_calls,
        "eager_verify_calls": st.eager_verify_calls,
        "parity_failures": st.parity_failures,
        "seed": result.seed if result is not None and result.seed else seed,
        "batch_width": st.batch_width,
        "decode_seconds": st.decode_seconds,
    }
    row.update(item.keep)
    return row


def run_job(job: JobConfig, restart: bool = False, limit: Optional[int] = None, engine=None,
            quiet: bool = True, log: Optional[Callable[[str], None]] = None, log_json: bool = False,
            log_every: float = DEFAULT_LOG_EVERY) -> RunSummary:
    """Run (or resume) `job`; returns what this session did.

    Raises JobError (nothing ran, no weights loaded) when the job, its input or its run
    directory is refused, and RunError when the run breaks; committed shards stay valid either
    way. `engine` (anything with `tokenizer`, `max_context` and `generate(requests)`) replaces
    the one `job.model`/`speculative`/`schedule` would load; `limit` takes the first N rows.
    Progress (pipelines/cli/progress.py): tqdm bars on a terminal unless `quiet`; with `log_json`
    JSON lines on stderr instead (start, shard commits, progress every `log_every` s, summary).
    """
    if limit is None:
        limit = job.input.limit
    if log_json and log is None:
        log = json_logger()
    log = log or ((lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr)))
    if job.executor.type == "ray" and engine is None:
        try:
            from .ray_executor import run_job as run_on_ray
        except ImportError as e:
            raise JobError(f"executor: ray is not available here ({e}); use executor: local")
        return run_on_ray(job, restart=restart, limit=limit, quiet=quiet, log=log, log_json=log_json,
                          log_every=log_every)
    tokenizer = engine.tokenizer if engine is not None else load_tokenizer(job)
    prep = open_job(job, tokenizer)
    if hasattr(prep.renderer, "warn"):
        prep.renderer.warn = log  # openai-batch: one line per ignored request field
    parts = fingerprint_parts(job, resolve_model_dir(job), prep.source.files)
    n = job.generation.n
    total_rows = prep.source.count_rows()  # reads the input to the end: refuses a truncated file before any write
    with RunDir.prepare(job.output.dir, job.to_yaml(), parts, restart=restart, log=log) as run:
        committed = run.committed_keys()
        run.update(input_rows=total_rows, samples=n)
        if engine is None:
            log(f"loading {job.model.path}")
            engine = load_engine(job)
        wanted = None if total_rows is None else min(total_rows, limit if limit is not None else total_rows) * n
        summary = RunSummary(run_dir=run.path, skipped=len(committed))
        progress = Progress(wanted, min(len(committed), wanted or len(committed)),
                            mode="json" if log_json else "off" if quiet else "bars", log_every=log_every)
        schema = output_schema(prep.keep_types)

        def on_commit(entry):
            summary.count_shard(entry)
            progress.committed(entry)

        sink = ShardWriter(run, schema, job.output.shard_rows, on_commit)
        started = time.monotonic()
        progress.start(run_dir=run.path, job=job.name)
        status, error = "failed", None
        try:
            _generate(job, prep, engine, sink, committed, limit, progress)
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
                summary.seconds = time.monotonic() - started
                progress.close(summary, status, error)
    return summary


def _generate(job: JobConfig, prep: Prepared, engine, sink: ShardWriter, committed: Set[Tuple[int, int]],
              limit: Optional[int], progress: Progress) -> None:
    gen = job.generation
    params = gen.sampling_params()
    inflight: Dict[Tuple[int, int], Tuple[Item, int]] = {}
    items = prepare(prep.source.rows(), prep.renderer, job.input.id_column, job.output.keep_columns,
                    engine.max_context, prep.check_keep, limit)
    # Skip fully committed rows before ordering, so a resume does not re-tokenize them twice over.
    pending = (it for it in items if any((it.index, s) not in committed for s in range(gen.n)))
    order = ordered(pending, job.schedule.order, lambda it: it.tokens, job.ordering.window_rows,
                    job.ordering.min_prefix_tokens, gen.n)

    row_params = getattr(prep.renderer, "row_params", None)  # a request's own settings (openai-batch)

    def emit(row, via_engine=True):
        sink.add(row)
        progress.finished(row, via_engine)

    def requests() -> Iterator[Request]:
        for item, plen in order:
            own = row_params(item.id) if row_params is not None and item.tokens is not None else None
            for s in range(gen.n):
                if (item.index, s) in committed:
                    continue
                job_seed = own.seed if own is not None and own.seed is not None else gen.seed
                seed = derive_seed(job_seed, item.id, s) if item.id is not None else 0
                if item.tokens is None:
                    emit(_output_row(item, s, seed, error=item.error), via_engine=False)
                    continue
                inflight[(item.index, s)] = (item, seed)
                progress.submitted(len(item.tokens))
                yield Request(key=(item.index, s), prompt_tokens=item.tokens,
                              params=own.apply(params) if own is not None else params,
                              seed=seed, stable_prefix_len=plen)

    feed = requests()
    for result in engine.generate(feed):
        key = tuple(result.key) if isinstance(result.key, list) else result.key
        if key not in inflight:
            raise RunError(f"the engine returned a result for an unknown request {result.key!r}")
        item, seed = inflight.pop(key)
        emit(_output_row(item, key[1], seed, result=result))
    for _ in feed:  # trailing error rows still get written; a real request left here is a bug
        pass
    if inflight:
        raise RunError(f"the engine stopped with {len(inflight)} requests unanswered; "
                       "they were not committed and a resume will generate them")
