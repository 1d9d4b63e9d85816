"""From source rows to work items: the row id, the prompt tokens, and every per-row check.

Shared by `run` and `validate`, so validate reports exactly the rows a run would turn into
error rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa

from .prompts import PromptRenderer, RowError, a_type
from .sources import SourceRow, plain_type


@dataclass
class Item:
    """One input row on its way through the pipeline."""

    index: int
    id: Optional[str]
    tokens: Optional[List[int]] = None  # None when the row cannot be generated
    error: Optional[str] = None
    keep: Dict[str, Any] = field(default_factory=dict)


def _canonical(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, float) and v != v:
        return {"$float": "nan"}
    if isinstance(v, dict):
        return {str(k): _canonical(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canonical(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return {"$" + type(v).__name__: str(v)}


def content_id(data: Dict[str, Any]) -> str:
    """A stable id from a row's content: the same row always gets the same id, across runs."""
    text = json.dumps(_canonical(data), sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:20]


def row_id(data: Dict[str, Any], id_column: Optional[str]) -> str:
    if id_column is None:
        return content_id(data)
    if id_column not in data:
        raise RowError(f"this row has no id column {id_column!r} (input.id_column)")
    v = data[id_column]
    if v is None:
        raise RowError(f"id column {id_column!r} is null; every row needs an id")
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise RowError(f"id column {id_column!r} is {a_type(v)}; ids must be strings or integers")
    v = str(v)
    if not v:
        raise RowError(f"id column {id_column!r} is empty; every row needs an id")
    return v


class DuplicateIds:
    """Ids seen so far, kept as 16-byte digests to bound memory on long inputs."""

    def __init__(self):
        self.seen = set()

    def check(self, rid: str, hashed: bool) -> None:
        digest = hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if digest in self.seen:
            if hashed:
                raise RowError("row is identical to an earlier row (its id is a hash of the row, as "
                               "input.id_column is unset); set input.id_column to keep both")
            raise RowError(f"duplicate id {rid!r}: an earlier row has the same id; ids must be unique "
                           "(drop the duplicate or choose another input.id_column)")
        self.seen.add(digest)


def keep_checker(types: Sequence[Tuple[str, pa.DataType]]):
    """Checks keep_column values against their declared types; needed only for schema-less input
    (jsonl), where a later value can disagree with the type read from the first rows."""

    def check(keep: Dict[str, Any]) -> None:
        for name, t in types:
            v = keep.get(name)
            if v is None or plain_type([v]) == t:
                continue
            try:
                pa.array([v], type=t)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                raise RowError(f"keep column {name!r} value {v!r:.60} does not fit its type {t} "
                               "(read from the first rows); make the column consistent")

    return check


def check_context(tokens: List[int], max_context: Optional[int]) -> List[int]:
    """`tokens`, or a RowError when the prompt leaves no room to generate one token."""
    if max_context is not None and len(tokens) + 1 > max_context:
        raise RowError(
            f"prompt is {len(tokens)} tokens; the model's context holds {max_context} "
            "(prompt + at least 1 generated token). Shorten the prompt or use a longer-context model"
        )
    return tokens


PREPARE_BLOCK_ROWS = 256  # rows rendered, then tokenized together (renderer.tokens_many)


def prepare(rows: Iterable[SourceRow], renderer: PromptRenderer, id_column: Optional[str],
            keep_columns: Sequence[str], max_context: Optional[int], check_keep=None,
            limit: Optional[int] = None) -> Iterator[Item]:
    """Items in input order; rows that cannot be generated carry `error` and no tokens."""
    dupes = DuplicateIds()
    block: List[Tuple[Item, Optional[Dict[str, Any]]]] = []
    for src in rows:
        if limit is not None and src.index >= limit:
            break
        item = Item(index=src.index, id=None)
        data = None
        try:
            if src.error is not None:
                raise RowError(src.error)
            data = src.data
            item.keep = {k: data.get(k) for k in keep_columns}
            item.id = row_id(data, id_column)
            dupes.check(item.id, hashed=id_column is None)
            if check_keep is not None:
                check_keep(item.keep)
        except RowError as e:
            item.error, data = e.reason, None
        block.append((item, data))
        if len(block) >= PREPARE_BLOCK_ROWS:
            yield from _tokenized(block, renderer, max_context)
            block = []
    yield from _tokenized(block, renderer, max_context)


def _tokenized(block, renderer: PromptRenderer, max_context: Optional[int]) -> Iterator[Item]:
    todo = [(item, data) for item, data in block if data is not None]
    for (item, _), ids in zip(todo, renderer.tokens_many([data for _, data in todo])):
        try:
            if isinstance(ids, RowError):
                raise ids
            item.tokens = check_context(ids, max_context)
        except RowError as e:
            item.error = e.reason
    for item, _ in block:
        yield item
