"""The output columns of DESIGN.md, written once: each column's name and type, and which of them the
engine's row stats fill, the manifest sums per shard and `report` reads back. The job refuses a
keep column that takes one of these names; pipelines/io/columns.py builds the shard schema and the
output row from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # int64 | float64 | string | list<int64>
    stat: bool = False  # the engine's RowStats field of the same name
    summed: bool = False  # summed per shard into manifest.json (what `status` totals)
    report: bool = True  # read back by `report`


COLUMNS: Tuple[Column, ...] = (
    Column("id", "string"),
    Column("row", "int64"),  # index of the input row (0-based, in input order): join key back to the input
    Column("sample", "int64"),
    Column("completion", "string", report=False),  # null for error rows
    Column("finish_reason", "string"),  # stop | length | error
    Column("error", "string"),
    Column("prompt_tokens", "int64", summed=True),
    Column("completion_tokens", "int64", summed=True),
    Column("cached_prompt_tokens", "int64", stat=True),
    Column("prefill_chunks", "int64", stat=True, report=False),
    Column("verify_calls", "int64", stat=True, summed=True),
    Column("drafted_tokens", "int64", stat=True, summed=True),
    Column("accepted_tokens", "int64", stat=True, summed=True),
    Column("acceptance_rate", "float64", stat=True, report=False),
    Column("tokens_per_verify", "float64", stat=True),
    Column("accepted_by_depth", "list<int64>"),
    Column("compiled_verify_calls", "int64", stat=True),
    Column("eager_verify_calls", "int64", stat=True),
    Column("parity_failures", "int64", stat=True),
    Column("seed", "int64", report=False),
    Column("batch_width", "int64", stat=True),
    Column("decode_seconds", "float64", stat=True, summed=True),
)
OUTPUT_COLUMN_NAMES = tuple(c.name for c in COLUMNS)
SUMMED_COLUMNS = tuple(c.name for c in COLUMNS if c.summed)  # manifest shard entries and totals
REPORT_COLUMNS = tuple(c.name for c in COLUMNS if c.report)
