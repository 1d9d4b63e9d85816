"""Opening a job before any weights load: the model's files, its tokenizer, the input and prompt
rendering. Every problem found here is a JobError (exit 2), so `run` and `validate` refuse the
same jobs with the same messages. `load_engine` is the one place weights load."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import JobError, RunError
from ..io.prompts import PromptRenderer
from ..io.rows import keep_checker
from ..io.sources import Source, open_source
from ..job.config import JobConfig


def job_width(job: JobConfig, limit: Optional[int] = None):
    """Rows the job decodes together: schedule.max_batch (an int or "auto"), at most the rows it can have
    (`limit` or input.limit, times generation.n)."""
    rows = limit if limit is not None else job.input.limit
    if rows is None:
        return job.schedule.max_batch
    rows *= job.generation.n
    return rows if job.schedule.max_batch == "auto" else min(job.schedule.max_batch, rows)


def apply_graph_limits(job: JobConfig, limit: Optional[int] = None) -> None:
    """MLX's CUDA-graph limits for this job's width and method (mtplx/cuda_graphs.py): before anything
    imports mlx.core (`run_job` calls it first, a Ray actor in `load_engine`); a no-op once it has."""
    from mtplx import cuda_graphs

    cuda_graphs.apply_for(job_width(job, limit), job.speculative.method)


def load_engine(job: JobConfig, tokenizer=None):
    """The job's engine; `tokenizer`: the model's, already loaded by `load_tokenizer` (not loaded again)."""
    from mtplx.process import prepare_process

    prepare_process()  # in a Ray actor, the first code of the job's to run (the CLI has run it already)
    apply_graph_limits(job)
    try:
        from mtplx.generation import Engine
    except ImportError as e:
        raise RunError(f"the generation engine is not available ({e})")
    return Engine.load(job.model.path, job.speculative, job.schedule,
                       trust_remote_code=job.model.trust_remote_code, gguf_mode=job.model.gguf_mode,
                       tokenizer=tokenizer)


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


def check_mtp_head(job: JobConfig) -> None:
    """`method: mtp` without `mtp_head` needs the model's own head: refuse, before weights load, a
    checkpoint that has none (its safetensors headers name no MTP weights)."""
    if job.speculative.method != "mtp" or job.speculative.mtp_head:
        return
    from mtplx.models.mtp import check_native_head

    try:
        check_native_head(resolve_model_dir(job))
    except ValueError as e:
        raise JobError(f"speculative.method: mtp: {e}")
    except OSError:
        return  # unreadable files are reported by the loader


def load_tokenizer(job: JobConfig):
    from mtplx.models.loading import load_tokenizer_only

    check_remote_code(job)
    check_mtp_head(job)
    try:
        return load_tokenizer_only(job.model.path, job.model.gguf_mode)
    except Exception as e:  # missing dir, bad tokenizer files: all mean the job cannot run
        raise JobError(f"model.path: cannot load a tokenizer from {job.model.path!r}: {e}")


def resolve_model_dir(job: JobConfig) -> str:
    from mtplx.models.loading import resolve_model_path

    try:
        return str(resolve_model_path(job.model.path, job.model.gguf_mode))
    except Exception as e:
        raise JobError(f"model.path: {e}")


def model_max_context(job: JobConfig) -> Optional[int]:
    """The context length the engine will use for this model, from its config.json alone (the
    engine's own rule), so prompts can be checked against it before weights load."""
    from mtplx.models.loading import context_length, model_config

    try:
        return context_length(model_config(job.model.path, job.model.gguf_mode))
    except Exception as e:
        raise JobError(f"model.path: cannot read config.json of {job.model.path!r}: {e}")


@dataclass
class Prepared:
    """Everything checked and opened before any weights load."""

    source: Source
    renderer: PromptRenderer
    keep_types: list
    check_keep: Optional[Callable]
    tokenizer: object = None  # the model's, as the renderer uses it (the engine reuses it)


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
    return Prepared(source, renderer, keep_types, check_keep, tokenizer)
