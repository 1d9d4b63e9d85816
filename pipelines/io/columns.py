"""The shard schema and the output row, built from the output columns (pipelines/job/columns.py): a
row from an engine result, or from the reason a row could not run, the same on every executor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

from mtplx.request import Result, RowStats

from ..job.columns import COLUMNS, OUTPUT_COLUMN_NAMES

if TYPE_CHECKING:
    import pyarrow as pa

    from .rows import Item


_STATS = tuple(c.name for c in COLUMNS if c.stat)


def _arrow_type(name: str) -> "pa.DataType":
    import pyarrow as pa

    return {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(),
            "list<int64>": pa.list_(pa.int64())}[name]


def __getattr__(name: str):
    if name == "OUTPUT_COLUMNS":  # (name, pyarrow type), built on first use: pyarrow loads late
        return [(c.name, _arrow_type(c.type)) for c in COLUMNS]
    raise AttributeError(name)


def output_schema(keep: Sequence[Tuple[str, "pa.DataType"]] = ()) -> "pa.Schema":
    import pyarrow as pa

    return pa.schema([pa.field(c.name, _arrow_type(c.type)) for c in COLUMNS] + [pa.field(n, t) for n, t in keep])


def output_row(item: "Item", sample: int, seed: int, result: Optional[Result] = None,
               error: Optional[str] = None) -> Dict[str, Any]:
    """The output row for (item, sample): from the engine's `result`, or an error row with `error`."""
    st = result.stats if result is not None else RowStats()
    failed = error is not None or (result is not None and result.finish_reason == "error")
    fields = {
        "id": item.id,
        "row": item.index,
        "sample": sample,
        "completion": None if failed else result.text,
        "finish_reason": "error" if failed else result.finish_reason,
        "error": error if error is not None else ((result.error or "engine error") if failed else None),
        "prompt_tokens": st.prompt_tokens or len(item.tokens or ()),
        "completion_tokens": st.completion_tokens or (len(result.tokens) if result and not failed else 0),
        "accepted_by_depth": list(st.accepted_by_depth),
        "seed": result.seed if result is not None and result.seed else seed,
    }
    fields.update({name: getattr(st, name) for name in _STATS})
    row = {name: fields[name] for name in OUTPUT_COLUMN_NAMES}  # in schema order
    row.update(item.keep)
    return row
