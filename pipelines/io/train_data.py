"""`train-head --data` (and `--heldout-data`) when it names a job, a table or a known dataset: its
rows read the way a run reads them (the job's source, prompt template and per-row checks), handed
to the engine's head training as plain data (`mtplx.training.head_data.ReadData`). A known
dataset (`owt-1k`, `truthfulqa-100`, ...) reads as its fetched table: its prompts through the chat
template, or as raw text where the dataset's prompts are passage openings to continue."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from mtplx.models.assets import ASSETS, AssetError, resolve_asset
from mtplx.training.head_data import TABLE_FORMATS, ReadData, TrainHeadError, is_dataset_name

from ..errors import JobError
from ..job.config import InputConfig, load_job
from .job_input import open_job
from .prompts import PromptRenderer
from .rows import prepare
from .sources import open_source

DEFAULT_NEW_TOKENS = 256  # continuation length for a table's prompts without --max-new-tokens


def read_train_data(path: str, tokenizer, cfg) -> ReadData:
    """The rows of the job YAML or table at `path`, within `cfg`'s max_rows / sample / seed."""
    low = path.lower()
    try:
        if is_dataset_name(path):
            raw = ASSETS[path].continuation  # passage openings: continued as they are
            return _table(resolve_asset(path, "dataset"), "jsonl", tokenizer, cfg, f"dataset:{path}",
                          "off" if raw else "auto")
        if low.endswith((".yaml", ".yml")):
            return _job(path, tokenizer, cfg)
        fmt = next(f for suf, f in TABLE_FORMATS.items() if low.endswith(suf))
        return _table(path, fmt, tokenizer, cfg)
    except (JobError, AssetError) as e:
        raise TrainHeadError(str(e))


def sample_rows(rows, n: Optional[int], seed: int):
    """A seeded uniform sample of n of `rows` (reservoir: one pass, n rows held), in input order;
    all rows when n is None."""
    if n is None:
        return list(rows)
    rng = np.random.default_rng(seed)
    keep: list = []
    for i, row in enumerate(rows):
        if i < n:
            keep.append((i, row))
        else:
            j = int(rng.integers(0, i + 1))
            if j < n:
                keep[j] = (i, row)
    return [row for _, row in sorted(keep, key=lambda t: t[0])]


def _job(path: str, tokenizer, cfg) -> ReadData:
    job = load_job(path)
    prep = open_job(job, tokenizer)
    rows = sample_rows(prep.source.rows(), cfg.sample, cfg.seed) if cfg.sample else prep.source.rows()
    # prepare's limit counts input indices, which a sample skips: cut a sample by count instead
    items = [it for it in prepare(rows, prep.renderer, job.input.id_column, [], None, None,
                                  None if cfg.sample else cfg.max_rows) if it.tokens][: cfg.max_rows or None]
    if not items:
        raise TrainHeadError(f"{path}: the job's input gave no usable prompts")
    # --max-new-tokens, when given, wins: a head drafts best up to the lengths it was trained on,
    # so train past the job's max_tokens when the head will also serve longer runs
    max_new = job.generation.max_tokens if cfg.max_new_tokens is None else cfg.max_new_tokens
    return ReadData(f"job:{os.path.abspath(path)}", prompts=[it.tokens for it in items], max_new_tokens=max_new,
                    rows=[it.index for it in items])


def _table(path: str, fmt: str, tokenizer, cfg, source: Optional[str] = None, chat: str = "auto") -> ReadData:
    def table_rows():
        for row in open_source(InputConfig(path=path, format=fmt), None).rows():
            if row.data is not None:
                yield row.data

    rows = []
    for data in sample_rows(table_rows(), cfg.sample, cfg.seed) if cfg.sample else table_rows():
        rows.append(data)
        if cfg.max_rows and len(rows) >= cfg.max_rows:
            break
    if not rows:
        raise TrainHeadError(f"--data {path!r} holds no rows")
    cols = set(rows[0])
    if "prompt" in cols or "messages" in cols:
        inp = InputConfig(path=path, format=fmt, messages_column="messages" if "prompt" not in cols else None,
                          chat_template=chat)
        renderer = PromptRenderer(inp, tokenizer)
        return ReadData(source or f"{fmt}-prompts:{os.path.abspath(path)}", prompts=[renderer.tokens(r) for r in rows],
                        max_new_tokens=cfg.max_new_tokens or DEFAULT_NEW_TOKENS)
    if "text" in cols:
        return ReadData(source or f"{fmt}-text:{os.path.abspath(path)}",
                        texts=[r["text"] for r in rows if isinstance(r.get("text"), str)])
    raise TrainHeadError(f"--data {path!r}: needs a 'prompt' (or 'messages') column to self-distill, or a "
                         f"'text' column of plain text; it has {', '.join(sorted(cols))}")
