"""A job's input, opened before any weights load: the source, the prompt renderer and the keep
columns' types. Every problem found here is a JobError (exit 2), so `run`, `validate` and
`train-head --data JOB` refuse the same inputs with the same messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import JobError
from ..job.config import JobConfig
from .openai_batch import OpenAIBatchRenderer
from .prompts import PromptRenderer
from .rows import keep_checker
from .sources import Source, open_source


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
        renderer = OpenAIBatchRenderer(job.input, tokenizer, job.generation.n)  # refuses unsupported body fields per row
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
        prompt_key = {"messages": "messages_column", "template": "template"}.get(job.input.prompt_mode, "prompt_column")
        for key, wanted in ((f"input.{prompt_key}", renderer.columns), ("output.keep_columns", keep)):
            missing = [c for c in wanted if c not in schema.names]
            if missing:  # every row would be an error row
                raise JobError(f"{key}: the input has no column {missing[0]!r} (has: {', '.join(schema.names)})")
    keep_types = [(c, source.column_type(c)) for c in keep]
    check_keep = keep_checker(keep_types) if schema is None and keep_types else None
    return Prepared(source, renderer, keep_types, check_keep, tokenizer)
