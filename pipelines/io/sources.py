"""Readers: parquet, arrow (IPC file or stream), jsonl, csv, Hugging Face datasets, and
OpenAI Batch API request files (openai-batch, see openai_batch.py).

Each reader streams its input in record batches and yields `SourceRow`s with a running row
index over all files (files in sorted order), so no dataset is ever held in memory whole.

What is fatal and what is per-row:
- fatal (`JobError`, exit 2, checked before the model loads): no file matches, a file cannot be
  opened, a file lacks a column the job reads, a read column changes type between files, or a
  file cannot be read as its format at all (a Parquet file given as jsonl or csv, a jsonl file
  none of whose lines is a JSON object);
- per row (an error row, the job goes on): a jsonl line that is not valid JSON / UTF-8 or not an
  object, a csv record with the wrong number of fields or undecodable bytes. Those rows still
  take their row index, so resumes and reruns agree on numbering.
A file that breaks in the middle of a read (a corrupt page) stops the run (`RunError`, exit 1);
shards written so far stay valid and a resume picks up after them.
"""

from __future__ import annotations

import csv
import glob
import gzip
import io
import json
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ..job.config import InputConfig
from ..errors import JobError, RunError

BATCH_ROWS = 1024
# What reading a damaged file raises: I/O errors, and for .gz a truncated (EOFError) or corrupt
# (zlib.error) stream.
READ_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)
INFER_ROWS = 1000  # rows sampled to type keep_columns of schema-less formats (jsonl)
INT64 = range(-(2**63), 2**63)


def plain_type(values: Sequence[Any]) -> Optional[pa.DataType]:
    """The type `pa.array(values)` infers when every value is a str, a bool, an int64 or a float
    (ints among floats: float64), or None for anything else. `pa.array` imports pandas when it is
    installed (a quarter of a second of startup), so the common cases skip it."""
    kinds = {type(v) for v in values}
    if kinds == {str}:
        return pa.string()
    if kinds == {bool}:
        return pa.bool_()
    if kinds and kinds <= {int, float} and all(v in INT64 for v in values if type(v) is int):
        return pa.float64() if float in kinds else pa.int64()
    return None
EXTENSIONS = {
    "parquet": (".parquet", ".pq"),
    "arrow": (".arrow", ".feather", ".ipc"),
    "jsonl": (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz"),
    "csv": (".csv", ".tsv", ".csv.gz", ".tsv.gz"),
}


@dataclass
class SourceRow:
    index: int
    data: Optional[Dict[str, Any]]
    error: Optional[str] = None  # set when the row itself could not be read


def _known_dataset(path: str) -> str:
    """A known dataset name (`humaneval`, `gsm8k-100`, `mmlu-1k`) -> its fetched JSONL file."""
    from mtplx.models.assets import ASSETS, AssetError, resolve_asset

    if path in ASSETS and not os.path.exists(path):
        try:
            return resolve_asset(path, "dataset")
        except AssetError as e:
            raise JobError(f"input.path: {e}") from None
    return path


def expand_paths(path: str, fmt: str) -> List[str]:
    """A file, every matching file under a directory, or a glob; sorted for a stable row order."""
    exts = EXTENSIONS[fmt]
    path = _known_dataset(path)
    if any(ch in path for ch in "*?["):
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    elif os.path.isdir(path):
        files = [
            os.path.join(root, f)
            for root, _, names in os.walk(path)
            for f in names
            if f.lower().endswith(exts) and not f.startswith(".")
        ]
    elif os.path.isfile(path):
        files = [path]
    else:
        raise JobError(f"input.path: {path!r} does not exist; give a file, a directory or a glob")
    if not files:
        raise JobError(f"input.path: {path!r} matched no {fmt} files ({', '.join(exts)})")
    return sorted(files)


def _open_text(path: str) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


# Leading bytes of files that are not text, and what they are: a text reader would turn every line
# of them into an error row.
BINARY_MAGIC = {b"PAR1": "a Parquet file (input.format: parquet)", b"ARROW1": "an Arrow IPC file (input.format: arrow)",
                b"\xff\xff\xff\xff": "an Arrow IPC stream (input.format: arrow)",
                b"\x1f\x8b": "gzip-compressed (name it *.gz)", b"PK\x03\x04": "a zip archive (unpack it first)"}


def check_text_file(path: str, fmt: str) -> None:
    """Refuse a file a text reader (jsonl, csv) cannot read at all: unopenable, or a known binary format."""
    try:
        with _open_text(path) as f:
            head = f.read(8)
    except READ_ERRORS as e:
        raise JobError(f"input file {path}: cannot read it ({e})")
    kind = next((what for magic, what in BINARY_MAGIC.items() if head.startswith(magic)), None)
    if kind is not None:
        raise JobError(f"input file {path}: is {kind}, not {fmt} text; no row of it could be read as input.format: {fmt}")


def is_json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except (UnicodeDecodeError, ValueError):
        return False


class Source:
    """Base of all readers. Subclasses set `files` and implement `_rows`, `schema`."""

    files: List[str] = []
    revision: Optional[str] = None  # the source's resolved revision, pinned by the fingerprint (hf)

    def __init__(self, inp: InputConfig, columns: Optional[Sequence[str]]):
        self.inp = inp
        # None: every column (the row id is a hash of the whole row); else only these.
        self.columns = list(columns) if columns is not None else None

    def schema(self) -> Optional[pa.Schema]:
        """Arrow schema of the rows, or None when the format has none (jsonl)."""
        return None

    def column_type(self, name: str) -> pa.DataType:
        schema = self.schema()
        if schema is not None and name in schema.names:
            return schema.field(name).type
        return self._infer_type(name)

    def count_rows(self) -> Optional[int]:
        return None

    def rows(self) -> Iterator[SourceRow]:
        index = 0
        for path in self.files:
            try:
                for data, error in self._rows(path):
                    yield SourceRow(index, data, error)
                    index += 1
            except READ_ERRORS as e:
                raise RunError(f"input file {path}: read failed at row {index}: {e}") from e

    def _rows(self, path: str):
        raise NotImplementedError

    def _infer_type(self, name: str) -> pa.DataType:
        values = []
        for row in self.rows():
            if row.data is not None and row.data.get(name) is not None:
                values.append(row.data[name])
            if row.index >= INFER_ROWS:
                break
        try:
            t = plain_type(values) or (pa.array(values).type if values else pa.string())
        except (pa.ArrowException, TypeError, OverflowError):
            raise JobError(f"output.keep_columns: column {name!r} mixes value types in the first "
                           f"{INFER_ROWS} rows; make it consistent or use a typed format (parquet)")
        return pa.string() if pa.types.is_null(t) else t

    def _check_columns(self, path: str, schema: pa.Schema, first: Optional[pa.Schema]):
        """Fatal when a read column is missing, or its type differs from the first file's."""
        names = self.columns if self.columns is not None else (first or schema).names
        for name in names:
            if name not in schema.names:
                raise JobError(f"input file {path}: no column {name!r} (has: {', '.join(schema.names)})")
            if first is not None and name in first.names and not schema.field(name).type.equals(first.field(name).type):
                raise JobError(
                    f"input file {path}: column {name!r} is {schema.field(name).type}, but "
                    f"{first.field(name).type} in {self.files[0]}; make the files' schemas agree"
                )


class ParquetSource(Source):
    def __init__(self, inp, columns):
        super().__init__(inp, columns)
        self.files = expand_paths(inp.path, "parquet")
        self._schema = None
        self._num_rows = 0
        for path in self.files:
            try:
                meta = pq.read_metadata(path)
                schema = meta.schema.to_arrow_schema()
            except (OSError, pa.ArrowException) as e:
                raise JobError(f"input file {path}: not a readable parquet file ({e})")
            self._check_columns(path, schema, self._schema)
            self._schema = self._schema or schema
            self._num_rows += meta.num_rows

    def schema(self):
        return self._schema

    def count_rows(self):
        return self._num_rows

    def _rows(self, path):
        f = pq.ParquetFile(path)
        for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=self.columns):
            for data in batch.to_pylist():
                yield data, None


def _open_ipc(path: str):
    source = pa.memory_map(path, "r")
    if source.read(6) == b"ARROW1":
        source.seek(0)
        return pa.ipc.open_file(source)
    source.seek(0)
    return pa.ipc.open_stream(source)


def _ipc_batches(reader) -> Iterator[pa.RecordBatch]:
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


class ArrowSource(Source):
    def __init__(self, inp, columns):
        super().__init__(inp, columns)
        self.files = expand_paths(inp.path, "arrow")
        self._schema = None
        for path in self.files:
            try:
                schema = _open_ipc(path).schema
            except (OSError, pa.ArrowException) as e:
                raise JobError(f"input file {path}: not a readable Arrow IPC file or stream ({e})")
            self._check_columns(path, schema, self._schema)
            self._schema = self._schema or schema

    def schema(self):
        return self._schema

    def count_rows(self):
        # Memory-mapped, so this touches batch headers rather than reading the data.
        return sum(b.num_rows for path in self.files for b in _ipc_batches(_open_ipc(path)))

    def _rows(self, path):
        for batch in _ipc_batches(_open_ipc(path)):
            if self.columns is not None:
                batch = batch.select(self.columns)
            for data in batch.to_pylist():
                yield data, None


class JsonlSource(Source):
    """Parsed line by line with `json`, so one broken line is one error row, not a dead job."""

    def __init__(self, inp, columns):
        super().__init__(inp, columns)
        self.files = expand_paths(inp.path, "jsonl")
        for path in self.files:
            check_text_file(path, "jsonl")

    def count_rows(self):
        """Rows in every file, read to the end; a file none of whose lines is a JSON object is refused
        (one broken line is an error row, a file of them is the wrong file or format)."""
        n = 0
        for path in self.files:
            rows, readable = 0, False
            try:
                with _open_text(path) as f:
                    for i, line in enumerate(f):
                        line = line[3:] if i == 0 and line.startswith(b"\xef\xbb\xbf") else line
                        if line.strip():
                            rows += 1
                            readable = readable or is_json_object(line)
            except READ_ERRORS as e:  # e.g. a truncated .gz: refused before any work
                raise JobError(f"input file {path}: cannot read it to the end ({type(e).__name__}: {e})")
            if rows and not readable:
                raise JobError(f"input file {path}: none of its {rows} lines is a JSON object, so no row can be "
                               "read; input.format: jsonl takes one JSON object per line (a JSON array or a "
                               "pretty-printed file is not JSONL)")
            n += rows
        return n

    def _shape(self, data: Dict[str, Any]) -> Dict[str, Any]:
        """Hook for JSONL dialects (openai-batch flattens each request here)."""
        return data

    def _rows(self, path):
        with _open_text(path) as f:
            for lineno, raw in enumerate(f, 1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte order mark (Windows editors) is not part of the row
                if not raw.strip():
                    continue
                where = f"{os.path.basename(path)} line {lineno}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield None, f"{where} is not UTF-8 (byte {e.start}); re-encode the file as UTF-8"
                    continue
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as e:
                    yield None, f"{where} is not valid JSON ({e.msg} at column {e.colno}); fix or drop the line"
                    continue
                if not isinstance(data, dict):
                    yield None, f"{where} is a JSON {type(data).__name__}, not an object"
                    continue
                data = self._shape(data)
                if self.columns is not None:
                    data = {k: data[k] for k in self.columns if k in data}
                yield data, None


class OpenAIBatchSource(JsonlSource):
    """JSONL lines flattened to {custom_id, method, url, model, messages, body}: the checks are
    the renderer's, so a bad request still keeps its custom_id as the row id."""

    def _shape(self, data: Dict[str, Any]) -> Dict[str, Any]:
        return flatten(data)


def flatten(line: Dict[str, Any]) -> Dict[str, Any]:
    body = line.get("body")
    out = {
        "custom_id": line.get("custom_id"),
        "method": line.get("method"),
        "url": line.get("url"),
        "model": body.get("model") if isinstance(body, dict) else None,
        "messages": body.get("messages") if isinstance(body, dict) else None,
        "body": body,
    }
    return out


class CsvSource(Source):
    """Read with the csv module: every value stays the exact text of the file (no type guessing
    that would turn "007" into 7), and a bad record is one error row."""

    def __init__(self, inp, columns):
        super().__init__(inp, columns)
        self.files = expand_paths(inp.path, "csv")
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # prompts can be far longer than 128 KiB
        self._header = None
        for path in self.files:
            check_text_file(path, "csv")
            try:
                with self._reader(path) as (_, reader):
                    header = next(reader, None)
            except READ_ERRORS + (csv.Error,) as e:
                raise JobError(f"input file {path}: not readable as CSV ({e})")
            if not header:
                raise JobError(f"input file {path}: empty, no header line")
            schema = pa.schema([(h, pa.string()) for h in header])
            first = pa.schema([(h, pa.string()) for h in self._header]) if self._header else None
            self._check_columns(path, schema, first)
            self._header = self._header or header

    def schema(self):
        return pa.schema([(h, pa.string()) for h in self._header])

    class _reader:
        def __init__(self, path):
            self.path = path

        def __enter__(self):
            self.f = io.TextIOWrapper(_open_text(self.path), encoding="utf-8-sig", errors="surrogateescape", newline="")
            dialect = "excel-tab" if self.path.lower().removesuffix(".gz").endswith(".tsv") else "excel"
            return self.f, csv.reader(self.f, dialect=dialect)

        def __exit__(self, *exc):
            self.f.close()

    def count_rows(self):
        n = 0
        for path in self.files:
            try:
                with self._reader(path) as (_, reader):
                    next(reader, None)
                    while True:
                        try:
                            rec = next(reader)
                        except StopIteration:
                            break
                        except csv.Error:  # one error row, as in _rows
                            n += 1
                            continue
                        n += bool(rec)
            except READ_ERRORS as e:
                raise JobError(f"input file {path}: cannot read it to the end ({type(e).__name__}: {e})")
        return n

    def _rows(self, path):
        with self._reader(path) as (_, reader):
            header = next(reader)
            wanted = self.columns if self.columns is not None else header
            pos = {h: i for i, h in enumerate(header)}
            while True:
                try:
                    rec = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    yield None, f"{os.path.basename(path)} line {reader.line_num}: {e}"
                    continue
                if not rec:
                    continue
                where = f"{os.path.basename(path)} line {reader.line_num}"
                if len(rec) != len(header):
                    yield None, f"{where} has {len(rec)} fields, the header has {len(header)}"
                    continue
                data = {k: rec[pos[k]] for k in wanted}
                bad = [k for k, v in data.items() if any("\udc80" <= ch <= "\udcff" for ch in v)]
                if bad:
                    yield None, f"{where}: column {bad[0]!r} is not UTF-8; re-encode the file as UTF-8"
                    continue
                yield data, None


class HfSource(Source):
    """`datasets`: a `save_to_disk` directory (memory-mapped), or local files / a dataset
    directory / a Hub dataset streamed (`load_dataset(..., streaming=True)`), which reads without
    building a cache. `revision`: a saved dataset's fingerprint, or the Hub commit resolved."""

    def __init__(self, inp, columns):
        super().__init__(inp, columns)
        try:
            import datasets
        except ImportError:
            raise JobError("input.format: hf needs the `datasets` package (a dependency of mtplx-batch): "
                           "pip install datasets")
        path = inp.path
        self.files = []
        try:
            if os.path.isdir(path) and any(
                os.path.exists(os.path.join(path, m)) for m in ("state.json", "dataset_dict.json")
            ):
                ds = datasets.load_from_disk(path)
                if isinstance(ds, datasets.DatasetDict):
                    if inp.split not in ds:
                        raise JobError(f"input.split: {inp.split!r} not in {path} (has: {', '.join(ds)})")
                    ds = ds[inp.split]
                self.revision = ds._fingerprint  # changes with the data, as `datasets` tracks it
            elif os.path.isfile(path):
                builder = next((b for b, exts in _HF_BUILDERS.items() if path.lower().endswith(exts)), None)
                if builder is None:
                    raise JobError(f"input.path: {path!r}: hf reads .parquet, .arrow, .json(l), .csv files")
                ds = datasets.load_dataset(builder, data_files=path, split=inp.split, streaming=True)
            else:
                builder = datasets.load_dataset_builder(path)
                ds = builder.as_streaming_dataset(split=inp.split)
                if not os.path.exists(path):  # the Hub: the commit resolved now (local files are pinned by content)
                    self.revision = builder.hash
        except JobError:
            raise
        except Exception as e:  # datasets raises many kinds; all mean "cannot read this input"
            raise JobError(f"input.path: cannot load {path!r} as a Hugging Face dataset: {type(e).__name__}: {e}")
        if os.path.exists(path):
            self.files = sorted(
                os.path.join(r, f) for r, _, names in os.walk(path) for f in names
            ) if os.path.isdir(path) else [path]
        self.ds = ds
        feats = getattr(ds, "features", None)
        self._schema = feats.arrow_schema if feats is not None else None
        if self._schema is not None and self.columns is not None:
            self._check_columns(path, self._schema, None)

    def schema(self):
        return self._schema

    def count_rows(self):
        try:
            return len(self.ds)
        except TypeError:  # streaming datasets have no length
            return None

    def rows(self):
        index = 0
        try:
            for batch in self.ds.iter(batch_size=BATCH_ROWS):
                names = list(batch)
                for i in range(len(batch[names[0]]) if names else 0):
                    data = {k: batch[k][i] for k in (self.columns if self.columns is not None else names) if k in batch}
                    yield SourceRow(index, data)
                    index += 1
        except Exception as e:
            raise RunError(f"input {self.inp.path}: read failed at row {index}: {e}") from e


_HF_BUILDERS = {
    "parquet": (".parquet",),
    "arrow": (".arrow",),
    "json": (".json", ".jsonl", ".json.gz", ".jsonl.gz"),
    "csv": (".csv",),
}

READERS = {"parquet": ParquetSource, "arrow": ArrowSource, "jsonl": JsonlSource, "csv": CsvSource, "hf": HfSource,
           "openai-batch": OpenAIBatchSource}


def open_source(inp: InputConfig, columns: Optional[Sequence[str]]) -> Source:
    """The reader for `input.format`; `columns=None` reads every column."""
    return READERS[inp.format](inp, columns)
