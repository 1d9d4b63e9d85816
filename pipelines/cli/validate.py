"""`validate`: everything a run would check or refuse, without loading weights.

Reads the whole input once (streamed), renders and tokenizes every prompt with the model's
tokenizer, and reports the rows a run would turn into error rows, with the reason for each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import os

from ..io.checkpoint import check_run_dir

from ..io.records import totals, verify_shards
from ..job.config import JobConfig
from ..errors import JobError
from ..job.fingerprint import fingerprint_parts
from ..io.job_input import open_job
from ..io.rows import prepare
from ..execution.opening import load_tokenizer, model_max_context, resolve_model_dir

MAX_EXAMPLES = 10


@dataclass
class ValidationReport:
    job: str
    files: int = 0
    rows: int = 0
    bad_rows: int = 0
    examples: List[Tuple[int, Optional[str], str]] = field(default_factory=list)  # (row, id, reason)
    max_context: Optional[int] = None
    prompt_tokens: int = 0
    min_prompt: int = 0
    max_prompt: int = 0
    samples: int = 1
    max_tokens: int = 0
    run_dir: str = ""  # what `run` would do with output.dir
    refused: bool = False  # `run` would refuse the output dir (exit 2)

    @property
    def ok(self) -> bool:
        return self.bad_rows == 0 and not self.refused

    @property
    def requests(self) -> int:
        return (self.rows - self.bad_rows) * self.samples


def validate_job(job: JobConfig, limit: Optional[int] = None) -> ValidationReport:
    if limit is None:
        limit = job.input.limit
    if job.executor.type == "ray":  # as `run` refuses it
        from ..execution.ray_executor import check_ray

        check_ray()
    tokenizer = load_tokenizer(job)
    prep = open_job(job, tokenizer)
    prep.source.count_rows()  # a file that cannot be read to the end is refused, as `run` refuses it
    model_dir = resolve_model_dir(job)
    max_context = model_max_context(job)
    rep = ValidationReport(job=job.name, files=len(prep.source.files), max_context=max_context,
                           samples=job.generation.n, max_tokens=job.generation.max_tokens)
    rep.run_dir, rep.refused = _run_dir_state(job, fingerprint_parts(job, model_dir, prep.source.files,
                                                                      prep.source.revision))
    for item in prepare(prep.source.rows(), prep.renderer, job.input.id_column, job.output.keep_columns,
                        max_context, prep.check_keep, limit):
        rep.rows += 1
        if item.error is not None:
            rep.bad_rows += 1
            if len(rep.examples) < MAX_EXAMPLES:
                rep.examples.append((item.index, item.id, item.error))
            continue
        n = len(item.tokens)
        rep.prompt_tokens += n
        rep.min_prompt = n if rep.rows - rep.bad_rows == 1 else min(rep.min_prompt, n)
        rep.max_prompt = max(rep.max_prompt, n)
    return rep


def _run_dir_state(job: JobConfig, parts) -> Tuple[str, bool]:
    """What `run` would do with output.dir: the same checks, read-only."""
    out = job.output.dir
    try:
        m = check_run_dir(os.path.abspath(out), parts)
        if m is None:
            return f"{out}: a new run", False
        verify_shards(os.path.abspath(out), m)
    except JobError as e:
        return f"run would refuse it: {e}", True
    return f"{out}: run would resume ({totals(m)['rows']} output rows already committed)", False


def format_report(rep: ValidationReport) -> str:
    good = rep.rows - rep.bad_rows
    lines = [
        f"job {rep.job}: {rep.rows} input rows in {rep.files} file(s); {good} ready, {rep.bad_rows} would be error rows",
        f"model context: {rep.max_context if rep.max_context else 'unknown (not in config.json)'} tokens",
    ]
    if good:
        lines.append(f"prompt tokens: {rep.prompt_tokens} total, {rep.min_prompt} min, "
                     f"{rep.prompt_tokens / good:.1f} mean, {rep.max_prompt} max")
    lines.append(f"work: {rep.requests} generations (x{rep.samples} samples), "
                 f"{rep.prompt_tokens * rep.samples} prompt tokens to prefill, "
                 f"at most {rep.requests * rep.max_tokens} tokens to generate")
    lines.append(f"output: {rep.run_dir}")
    if rep.bad_rows:
        lines.append("problem rows (row, id: reason):")
        lines += [f"  {row}, {rid if rid is not None else '-'}: {reason}" for row, rid, reason in rep.examples]
        if rep.bad_rows > len(rep.examples):
            lines.append(f"  ... and {rep.bad_rows - len(rep.examples)} more")
    if rep.refused:
        lines.append("REFUSED: run would not start with this output directory")
    elif rep.bad_rows:
        lines.append("PROBLEMS: the rows above would be written as error rows")
    else:
        lines.append("OK")
    return "\n".join(lines)
