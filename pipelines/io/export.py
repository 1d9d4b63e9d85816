"""`mtplx-batch export RUN_DIR --format openai-batch|jsonl|hf --out PATH`.

Every format reads only the shards recorded in the manifest, each checked against its recorded
sha256 first (a corrupt shard is refused, naming it), and writes rows in input order
(by `row`, then `sample`), whatever order they were generated in. Rows are gathered a chunk at
a time, so a run larger than memory exports in bounded memory. Output is written under a
temporary name and renamed into place, so PATH is either the complete export or untouched.

    jsonl         PATH: one JSON object per output row, every column (errors included,
                  finish_reason "error", completion null).
    openai-batch  PATH: OpenAI Batch API output lines for the rows that succeeded, and an error
                  file (--errors-out, default PATH with `_errors` before the extension) with one
                  line per failed row; see openai_batch.py for both formats. The error file is
                  always written, empty when nothing failed.
    hf            PATH is a directory: data/train-NNNNN-of-NNNNN.parquet plus README.md, a
                  dataset card (model, job settings, counts, acceptance, columns). Load it with
                  datasets.load_dataset(PATH, split="train"), or upload it to the Hub as is.

A run that is not complete exports what is committed; the command says how many rows are left.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import JobError
from .records import planned_outputs, read_manifest, verify_shards
from .run_stats import collect, error_kind, read_job

FORMATS = ("openai-batch", "jsonl", "hf")
CHUNK_ROWS = 50_000  # rows gathered at once while re-ordering
HF_FILE_ROWS = 200_000  # rows per parquet file of an hf export


@dataclass
class ExportResult:
    format: str
    files: List[str] = field(default_factory=list)
    rows: int = 0  # output rows read from the run
    written: int = 0  # lines / rows written to the main output
    failed: int = 0  # openai-batch: lines in the error file
    expected: Optional[int] = None

    @property
    def left(self) -> Optional[int]:
        return None if self.expected is None else max(self.expected - self.rows, 0)


# ------------------------------------------------------------------------------ reading in order
class OrderedRun:
    """The committed output rows of a run, in (row, sample) order, read chunk by chunk."""

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.manifest = read_manifest(run_dir)
        self.committed = verify_shards(run_dir, self.manifest, checksums=True)  # before any row is used
        self.files = self.committed.files
        self.schema: Optional[pa.Schema] = pq.read_schema(self.files[0]) if self.files else None
        self._shard, self._offset, self.order = self.committed.shard, self.committed.offset, self.committed.order
        m = self.manifest
        self.expected = planned_outputs(m)
        commits = [e.get("committed") for e in m.get("shards", []) if e.get("committed")]
        self.finished = int(max(commits)) if commits else int(time.time())

    def __len__(self) -> int:
        return int(self.order.size)

    def tables(self, chunk_rows: int = CHUNK_ROWS, columns: Optional[List[str]] = None) -> Iterator[pa.Table]:
        """Tables of up to `chunk_rows` rows, in order."""
        for start in range(0, len(self), chunk_rows):
            idx = self.order[start:start + chunk_rows]
            parts, positions = [], []
            for s in np.unique(self._shard[idx]):
                mine = np.nonzero(self._shard[idx] == s)[0]
                t = pq.read_table(self.files[int(s)], columns=columns)
                parts.append(t.take(pa.array(self._offset[idx][mine])))
                positions.append(mine)
            table = pa.concat_tables(parts)
            inverse = np.empty(len(idx), dtype=np.int64)
            inverse[np.concatenate(positions)] = np.arange(len(idx))
            yield table.take(pa.array(inverse))

    def rows(self, chunk_rows: int = CHUNK_ROWS) -> Iterator[Dict[str, Any]]:
        for t in self.tables(chunk_rows):
            yield from t.to_pylist()

    def grouped(self, chunk_rows: int = CHUNK_ROWS) -> Iterator[List[Dict[str, Any]]]:
        """All samples of one input row at a time."""
        group: List[Dict[str, Any]] = []
        for r in self.rows(chunk_rows):
            if group and r["row"] != group[0]["row"]:
                yield group
                group = []
            group.append(r)
        if group:
            yield group


# ------------------------------------------------------------------------------ writing safely
def _check_target(path: str, overwrite: bool, is_dir: bool) -> None:
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise JobError(f"--out {path}: the directory {parent} does not exist; create it first")
        return
    if is_dir != os.path.isdir(path):
        kind = "a directory" if os.path.isdir(path) else "a file"
        raise JobError(f"--out {path} is {kind}; give a {'directory' if is_dir else 'file'} path")
    if not overwrite:
        raise JobError(f"--out {path} already exists; pass --overwrite to replace it, or choose another path")
    if is_dir and os.listdir(path) and not os.path.exists(os.path.join(path, "README.md")):
        raise JobError(f"--out {path} is a non-empty directory that is not an earlier hf export (no README.md); "
                       "refusing to replace it even with --overwrite")


def _install(tmp: str, final: str) -> None:
    if os.path.isdir(final) and not os.path.islink(final):
        aside = final + ".old-export"
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _tmp_file(final: str) -> str:
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(final) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(final)))
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; an export is an ordinary file
    return tmp


# ------------------------------------------------------------------------------ formats
def export_jsonl(run: OrderedRun, out: str) -> ExportResult:
    res = ExportResult("jsonl", expected=run.expected)
    tmp = _tmp_file(out)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in run.rows():
                f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
                res.rows += 1
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    res.written = res.rows
    res.files = [os.path.abspath(out)]
    return res


def default_errors_path(out: str) -> str:
    root, ext = os.path.splitext(out)
    return f"{root}_errors{ext or '.jsonl'}"


def export_openai(run: OrderedRun, out: str, errors_out: Optional[str] = None) -> ExportResult:
    from .openai_batch import model_name, write_lines

    errors_out = errors_out or default_errors_path(out)
    if os.path.abspath(errors_out) == os.path.abspath(out):
        raise JobError("--errors-out must differ from --out")
    job = read_job(run.run_dir)
    res = ExportResult("openai-batch", expected=run.expected)
    fp = run.manifest.get("fingerprint", "")
    tmp_out, tmp_err = _tmp_file(out), _tmp_file(errors_out)
    try:
        with open(tmp_out, "w", encoding="utf-8") as f, open(tmp_err, "w", encoding="utf-8") as g:

            def groups():
                for grp in run.grouped():
                    res.rows += len(grp)
                    yield grp

            res.written, res.failed = write_lines(groups(), f, g, fp, model_name(job), run.finished, error_kind)
        os.replace(tmp_out, out)
        os.replace(tmp_err, errors_out)
    finally:
        for t in (tmp_out, tmp_err):
            if os.path.exists(t):
                os.remove(t)
    res.files = [os.path.abspath(out), os.path.abspath(errors_out)]
    return res


def export_hf(run: OrderedRun, out: str, file_rows: int = HF_FILE_ROWS) -> ExportResult:
    res = ExportResult("hf", expected=run.expected)
    parent = os.path.dirname(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(os.path.abspath(out)) + ".", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        os.makedirs(os.path.join(tmp, "data"))
        n_files = max(1, -(-len(run) // file_rows))
        names = []
        for i, table in enumerate(run.tables(chunk_rows=file_rows)):
            name = f"data/train-{i:05d}-of-{n_files:05d}.parquet"
            pq.write_table(table, os.path.join(tmp, name), row_group_size=min(file_rows, 10_000))
            names.append(name)
            res.rows += table.num_rows
        if not names and run.schema is not None:  # an empty run still yields a loadable dataset
            name = "data/train-00000-of-00001.parquet"
            pq.write_table(run.schema.empty_table(), os.path.join(tmp, name))
            names.append(name)
        stats = collect(run.run_dir, top=0, committed=run.committed)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(dataset_card(stats, run, res.rows))
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    res.written = res.rows
    res.files = [os.path.join(os.path.abspath(out), n) for n in names + ["README.md"]]
    return res


COLUMN_DOCS = {
    "id": "row id (input.id_column, or a stable hash of the row)",
    "row": "index of the input row (0-based, input order)",
    "sample": "sample number, 0..n-1",
    "completion": "generated text (null for error rows)",
    "finish_reason": "stop, length or error",
    "error": "why the row failed (null unless failed)",
    "prompt_tokens": "tokens in the rendered prompt",
    "completion_tokens": "generated tokens",
    "cached_prompt_tokens": "prompt tokens reused from a shared prefix",
    "prefill_chunks": "prefill spans",
    "verify_calls": "rounds that drafted for the row (verifies of a draft)",
    "drafted_tokens": "tokens proposed by the drafter",
    "accepted_tokens": "drafted tokens accepted",
    "acceptance_rate": "accepted / drafted",
    "tokens_per_verify": "(accepted + verify calls) / verify calls: tokens committed per verify",
    "accepted_by_depth": "per draft depth: verifies that accepted the draft at that depth",
    "compiled_verify_calls": "decode forwards (every round) run by the compiled verify bank",
    "eager_verify_calls": "decode forwards (every round) run eagerly",
    "parity_failures": "compiled/eager verify disagreements (parity modes)",
    "seed": "the row's sampling seed",
    "batch_width": "mean rows decoded alongside",
    "decode_seconds": "admission to finish, seconds",
}


def _yaml_block(obj: Any) -> str:
    import yaml

    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False).strip()


def dataset_card(st, run: OrderedRun, rows: int) -> str:
    job = st.job
    name = job.get("name", "run")
    model = (job.get("model") or {}).get("path", "?")
    model_short = os.path.basename(str(model).rstrip("/")) or model
    inp = dict(job.get("input") or {})
    if inp.get("path"):
        inp["path"] = os.path.basename(str(inp["path"]).rstrip("/"))  # no local directory layout in a card
    settings = {"generation": job.get("generation") or {}, "speculative": job.get("speculative") or {},
                "input": inp}
    size = "n<1K" if rows < 1000 else "1K<n<10K" if rows < 10_000 else "10K<n<100K" if rows < 100_000 else \
        "100K<n<1M" if rows < 1_000_000 else "n>1M"
    acc = "n/a (no drafting)" if st.acceptance_rate is None else \
        f"{st.acceptance_rate:.1%} of {st.drafted:,} drafted tokens ({st.tokens_per_verify:.2f} tokens per verify)"
    kinds = ", ".join(f"{k}: {v}" for k, v in st.error_kinds.most_common()) or "none"
    names = run.schema.names if run.schema is not None else []
    cols = "\n".join(f"| `{c}` | {COLUMN_DOCS.get(c, 'kept from the input (output.keep_columns)')} |" for c in names)
    left = "" if run.expected is None or rows >= run.expected else \
        f"\n> This export was taken before the run finished: {run.expected - rows:,} of {run.expected:,} rows are missing.\n"
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
size_categories:
- {size}
tags:
- synthetic
- mtplx-batch
---

# {name}: generations from {model_short}

Generated offline with [mtplx-batch](https://pypi.org/project/mtplx-batch/) (batch generation on MLX)
from the job `{name}`. One row per (input row, sample), in input order.
{left}
## Counts

| | |
|---|---|
| rows | {rows:,} ({st.ok:,} generated, {st.errors:,} errors) |
| errors by kind | {kinds} |
| prompt tokens | {st.prompt_tokens:,} |
| generated tokens | {st.completion_tokens:,} |
| throughput | {st.tokens_per_second:,.1f} generated tok/s over {st.active_seconds:,.1f} s |
| speculative acceptance | {acc} |

## Model and job settings

Model: `{model_short}`

```yaml
{_yaml_block(settings)}
```

## Columns

| column | meaning |
|---|---|
{cols}

## Loading

```python
from datasets import load_dataset

ds = load_dataset("path/to/this/directory", split="train")
ok = ds.filter(lambda r: r["finish_reason"] != "error")
```
"""


DEFAULT_OUT = {"jsonl": "results.jsonl", "openai-batch": "openai-batch.jsonl", "hf": "hf"}


def default_out(run_dir: str, fmt: str) -> str:
    """Where `export` writes without --out: RUN_DIR/export/results.jsonl, .../openai-batch.jsonl
    (+ openai-batch_errors.jsonl), or the directory .../hf."""
    return os.path.join(run_dir, "export", DEFAULT_OUT[fmt])


def export_run(run_dir: str, fmt: str, out: Optional[str] = None, errors_out: Optional[str] = None,
               overwrite: bool = False) -> ExportResult:
    """Export the committed rows of `run_dir`. Without `out`, into RUN_DIR/export/ (`default_out`),
    replacing an earlier export there."""
    if fmt not in FORMATS:
        raise JobError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    run = OrderedRun(run_dir)
    if out is None:
        out = default_out(run_dir, fmt)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        overwrite = True
    if fmt == "hf":
        _check_target(out, overwrite, is_dir=True)
        return export_hf(run, out)
    _check_target(out, overwrite, is_dir=False)
    if fmt == "jsonl":
        return export_jsonl(run, out)
    errors_out = errors_out or default_errors_path(out)
    _check_target(errors_out, overwrite, is_dir=False)
    return export_openai(run, out, errors_out)
