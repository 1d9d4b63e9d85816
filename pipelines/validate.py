"""`validate`: everything a run would check or refuse, without loading weights.

Reads the whole input once (streamed), renders and tokenizes every prompt with the model's
tokenizer, and reports the rows a run would turn into error rows, with the reason for each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .config import JobConfig
from .rows import context_from_config, prepare
from .runner import load_tokenizer, open_job, resolve_model_dir

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

    @property
    def ok(self) -> bool:
        return self.bad_rows == 0

    @property
    def requests(self) -> int:
        return (self.rows - self.bad_rows) * self.samples


def validate_job(job: JobConfig, limit: Optional[int] = None) -> ValidationReport:
    from mtplx.loading import model_config

    tokenizer = load_tokenizer(job)
    prep = open_job(job, tokenizer)
    resolve_model_dir(job)
    max_context = context_from_config(model_config(job.model.path))
    rep = ValidationReport(job=job.name, files=len(prep.source.files), max_context=max_context,
                           samples=job.generation.n, max_tokens=job.generation.max_tokens)
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
    if rep.bad_rows:
        lines.append("problem rows (row, id: reason):")
        lines += [f"  {row}, {rid if rid is not None else '-'}: {reason}" for row, rid, reason in rep.examples]
        if rep.bad_rows > len(rep.examples):
            lines.append(f"  ... and {rep.bad_rows - len(rep.examples)} more")
    lines.append("OK" if rep.ok else "PROBLEMS: the rows above would be written as error rows")
    return "\n".join(lines)
