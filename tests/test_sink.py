"""Shards and the manifest: fixed schema, atomic commits, verification and cleanup on start."""

import json
import os

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from pipelines.io.checkpoint import RunDir, read_manifest, totals
from pipelines.errors import JobError
from pipelines.job.fingerprint import fingerprint, sha256_file
from pipelines.io.columns import OUTPUT_COLUMNS, output_schema
from pipelines.io.sink import ShardWriter, empty_row

PARTS = {"generation.max_tokens": "8", "input.files": "abc"}


def row(schema, index, sample=0, error=None, **kw):
    r = empty_row(schema)
    r.update(id=f"r{index}", row=index, sample=sample, finish_reason="error" if error else "stop",
             completion=None if error else f"text {index}", error=error, prompt_tokens=3,
             completion_tokens=0 if error else 2, accepted_by_depth=[] if error else [1, 0], seed=index)
    r.update(kw)
    return r


def open_run(path, parts=PARTS, restart=False, log=None):
    messages = []
    run = RunDir.prepare(str(path), "name: t\n", parts, restart=restart, log=log or messages.append)
    return run, messages


def test_design_columns_present():
    names = [n for n, _ in OUTPUT_COLUMNS]
    for col in ("id", "sample", "completion", "finish_reason", "error", "prompt_tokens", "completion_tokens",
                "cached_prompt_tokens", "prefill_chunks", "verify_calls", "drafted_tokens", "accepted_tokens",
                "acceptance_rate", "tokens_per_verify", "accepted_by_depth", "compiled_verify_calls",
                "eager_verify_calls", "parity_failures", "seed", "batch_width", "decode_seconds"):
        assert col in names
    assert output_schema().field("accepted_by_depth").type == pa.list_(pa.int64())


def test_shards_flush_every_n_rows_and_record_checksums(tmp_path):
    schema = output_schema([("topic", pa.string())])
    run, _ = open_run(tmp_path / "run")
    sink = ShardWriter(run, schema, shard_rows=3)
    for i in range(7):
        sink.add(row(schema, i, topic="t", error="bad row" if i == 4 else None))
    assert len(run.shards) == 2  # 3 + 3 committed, 1 buffered
    sink.flush()
    run.close()
    m = read_manifest(str(tmp_path / "run"))
    assert [e["rows"] for e in m["shards"]] == [3, 3, 1]
    assert [e["file"] for e in m["shards"]] == [f"shards/part-0000{i}.parquet" for i in range(3)]
    for e in m["shards"]:
        assert sha256_file(str(tmp_path / "run" / e["file"])) == e["sha256"]
    assert totals(m)["errors"] == 1 and totals(m)["completion_tokens"] == 12
    assert m["fingerprint"] == fingerprint(PARTS) and m["fingerprint_parts"] == PARTS
    assert "mlx-lm" in m["versions"]
    # an all-error shard and an all-success shard share one schema
    schemas = {pq.read_schema(tmp_path / "run" / e["file"]) for e in m["shards"]}
    assert len(schemas) == 1 and schemas.pop().equals(schema)
    table = pads.dataset(str(tmp_path / "run" / "shards")).to_table()
    assert sorted(table.column("row").to_pylist()) == list(range(7))


def test_output_readable_by_pandas_and_datasets(tmp_path):
    schema = output_schema()
    run, _ = open_run(tmp_path / "run")
    sink = ShardWriter(run, schema, shard_rows=2)
    for i in range(3):
        sink.add(row(schema, i, error="x" if i == 0 else None))
    sink.flush()
    run.close()
    import pandas as pd

    df = pd.read_parquet(tmp_path / "run" / "shards")
    assert len(df) == 3
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "run" / "shards"), split="train")
    assert sorted(ds["row"]) == [0, 1, 2]


def test_committed_keys_and_resume_numbering(tmp_path):
    schema = output_schema()
    run, _ = open_run(tmp_path / "run")
    sink = ShardWriter(run, schema, shard_rows=2)
    for i in range(4):
        sink.add(row(schema, i // 2, sample=i % 2))
    run.close()
    run, _ = open_run(tmp_path / "run")
    assert run.committed_keys() == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert run.next_shard_file() == "shards/part-00002.parquet"
    assert len(read_manifest(str(tmp_path / "run"))["sessions"]) == 2
    run.close()


def test_leftovers_from_a_kill_are_removed(tmp_path):
    schema = output_schema()
    run, _ = open_run(tmp_path / "run")
    ShardWriter(run, schema, shard_rows=1).add(row(schema, 0))
    run.close()
    shards = tmp_path / "run" / "shards"
    # killed after the rename but before the manifest recorded the shard, and mid-write of another
    pq.write_table(pa.Table.from_pylist([row(schema, 1)], schema=schema), shards / "part-00001.parquet")
    (shards / ".part-00002.parquet.tmp").write_bytes(b"partial")
    (tmp_path / "run" / "manifest.json.tmp").write_text("{")
    run, messages = open_run(tmp_path / "run")
    assert sorted(os.listdir(shards)) == ["part-00000.parquet"]
    assert not (tmp_path / "run" / "manifest.json.tmp").exists()
    assert any("part-00001.parquet" in m and "never committed" in m for m in messages)
    assert run.committed_keys() == {(0, 0)}
    run.close()


def test_missing_or_corrupt_recorded_shard_refuses(tmp_path):
    schema = output_schema()
    run, _ = open_run(tmp_path / "run")
    sink = ShardWriter(run, schema, shard_rows=1)
    sink.add(row(schema, 0))
    sink.add(row(schema, 1))
    run.close()
    shard = tmp_path / "run" / "shards" / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(JobError, match="part-00001.parquet: checksum does not match"):
        open_run(tmp_path / "run")
    shard.unlink()
    with pytest.raises(JobError, match="part-00001.parquet: recorded in manifest.json but missing"):
        open_run(tmp_path / "run")
    run, messages = open_run(tmp_path / "run", restart=True)
    assert run.shards == [] and any("moved the previous run" in m for m in messages)
    run.close()


def test_fingerprint_change_refused_unless_restart(tmp_path):
    run, _ = open_run(tmp_path / "run")
    run.close()
    changed = {**PARTS, "generation.max_tokens": "9"}
    with pytest.raises(JobError, match="changed: generation.max_tokens"):
        open_run(tmp_path / "run", changed)
    run, _ = open_run(tmp_path / "run", changed, restart=True)
    run.close()
    assert read_manifest(str(tmp_path / "run"))["fingerprint_parts"] == changed
    aside = [p for p in os.listdir(tmp_path) if p.startswith("run.old-")]
    assert len(aside) == 1
    assert json.loads((tmp_path / aside[0] / "manifest.json").read_text())["fingerprint_parts"] == PARTS


def test_foreign_directory_and_concurrent_runs_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(JobError, match="is not a run directory"):
        open_run(tmp_path / "mine")
    run, _ = open_run(tmp_path / "run")
    with pytest.raises(JobError, match="in use by another mtplx-batch process"):
        open_run(tmp_path / "run")
    run.close()
    open_run(tmp_path / "run")[0].close()


def test_config_knows_the_output_column_names():
    from pipelines.job.columns import OUTPUT_COLUMN_NAMES

    assert tuple(n for n, _ in OUTPUT_COLUMNS) == OUTPUT_COLUMN_NAMES
