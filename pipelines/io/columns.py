"""The output columns of DESIGN.md, written once: the shard schema and the output row built from an
engine result (or from the reason a row could not run), the same on every executor."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import pyarrow as pa

from mtplx.request import Result, RowStats

from .rows import Item

I64, F64, STR = pa.int64(), pa.float64(), pa.string()
OUTPUT_COLUMNS: List[Tuple[str, pa.DataType]] = [
    ("id", STR),
    ("row", I64),  # index of the input row (0-based, in input order): join key back to the input
    ("sample", I64),
    ("completion", STR),  # null for error rows
    ("finish_reason", STR),  # stop | length | error
    ("error", STR),
    ("prompt_tokens", I64),
    ("completion_tokens", I64),
    ("cached_prompt_tokens", I64),
    ("prefill_chunks", I64),
    ("verify_calls", I64),
    ("drafted_tokens", I64),
    ("accepted_tokens", I64),
    ("acceptance_rate", F64),
    ("tokens_per_verify", F64),
    ("accepted_by_depth", pa.list_(I64)),
    ("compiled_verify_calls", I64),
    ("eager_verify_calls", I64),
    ("parity_failures", I64),
    ("seed", I64),
    ("batch_width", I64),
    ("decode_seconds", F64),
]


def output_schema(keep: Sequence[Tuple[str, pa.DataType]] = ()) -> pa.Schema:
    return pa.schema([pa.field(n, t) for n, t in OUTPUT_COLUMNS] + [pa.field(n, t) for n, t in keep])


def output_row(item: Item, sample: int, seed: int, result: Optional[Result] = None,
               error: Optional[str] = None) -> Dict[str, Any]:
    """The output row for (item, sample): from the engine's `result`, or an error row with `error`."""
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
