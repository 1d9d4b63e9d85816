"""Helpers for pipeline tests: small inputs, job files, and reading a run's committed output."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

PREAMBLE = ("You are a careful assistant. Read the question, think about it step by step, "
            "and answer in one short sentence. ")


def sample_rows(n: int = 12) -> List[Dict[str, Any]]:
    """Prompts of mixed lengths; odd rows share a long preamble (a prefix group)."""
    return [
        {"id": f"q{i}", "prompt": (PREAMBLE if i % 2 else "") + f"What is {i} times {i + 1}?" + " Why?" * (i % 4),
         "topic": ["math", "logic", "trivia"][i % 3], "weight": i * 0.5}
        for i in range(n)
    ]


def write_parquet(path: Path, rows: List[Dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, lines: List[Any]) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            f.write(b"\n")
    return path


def job_dict(model: Path, input_path: Path, out_dir: Path, fmt: str = "parquet", **sections) -> Dict[str, Any]:
    job = {
        "name": "test",
        "model": {"path": str(model)},
        "input": {"format": fmt, "path": str(input_path), "id_column": "id", "prompt_column": "prompt"},
        "generation": {"max_tokens": 8},
        "schedule": {"order": "prefix", "max_batch": 4},
        "output": {"dir": str(out_dir), "shard_rows": 5},
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(job.get(section), dict):
            job[section] = {**job[section], **values}
        else:
            job[section] = values
    return job


def write_job(path: Path, job: Dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def flip_column_byte(path, column: str) -> None:
    """Flip a bit in the last byte of `column`'s data in a one-row-group parquet file (a shard)."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    col = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == column)
    data = bytearray(Path(path).read_bytes())
    data[col.data_page_offset + col.total_compressed_size - 1] ^= 0x01
    Path(path).write_bytes(bytes(data))


def records(run_dir) -> List[Dict[str, Any]]:
    """The committed shards' records (manifest.json's and commits.jsonl's, through the reader every command uses)."""
    from pipelines.io.records import read_manifest

    return read_manifest(str(run_dir))["shards"]


def read_output(run_dir) -> List[Dict[str, Any]]:
    """Rows of the shards recorded in the manifest (the only ones that count), by (row, sample)."""
    rows = []
    for entry in records(run_dir):
        rows += pq.read_table(os.path.join(run_dir, entry["file"])).to_pylist()
    return sorted(rows, key=lambda r: (r["row"], r["sample"]))
