"""Shards, the manifest and the commit log: fixed schema, commits that append one line, what a
resume and an export verify, cleanup on start, and runs written in the earlier format."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from pipelines.io.checkpoint import RunDir

from pipelines.io.records import CommittedKeys, read_manifest, totals, verify_shards
from pipelines.errors import JobError
from pipelines.job.fingerprint import fingerprint, sha256_file
from pipelines.io.columns import OUTPUT_COLUMNS, output_schema
from jobkit import flip_column_byte
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
    assert set(run.committed_keys()) == {(0, 0), (0, 1), (1, 0), (1, 1)}
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
    assert set(run.committed_keys()) == {(0, 0)}
    run.close()


def two_shards(run_dir):
    """A run of two one-row shards (rows 0 and 1), closed."""
    schema = output_schema()
    run, _ = open_run(run_dir)
    sink = ShardWriter(run, schema, shard_rows=1)
    sink.add(row(schema, 0))
    sink.add(row(schema, 1))
    run.close()
    return schema


def test_missing_or_corrupt_recorded_shard_refuses(tmp_path):
    """A resume reads the keys (page checksums verified) but hashes no shard; export hashes each."""
    two_shards(tmp_path / "run")
    shard = tmp_path / "run" / "shards" / "part-00001.parquet"
    good = shard.read_bytes()
    flip_column_byte(shard, "completion")  # bytes a resume does not read
    run, _ = open_run(tmp_path / "run")
    assert set(run.committed_keys()) == {(0, 0), (1, 0)}
    run.close()
    # the resume's manifest lists the shards the log held
    with pytest.raises(JobError, match="part-00001.parquet: its sha256 does not match manifest.json"):
        verify_shards(str(tmp_path / "run"), read_manifest(str(tmp_path / "run")), checksums=True)
    shard.write_bytes(good)
    flip_column_byte(shard, "row")  # a key: caught by the page checksum
    with pytest.raises(JobError, match="part-00001.parquet: unreadable as a shard .*checksum"):
        open_run(tmp_path / "run")
    shard.write_bytes(good[:-1])
    with pytest.raises(JobError, match=r"part-00001.parquet: \d+ bytes, manifest.json records \d+; the shard is torn"):
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


def test_a_commit_appends_one_line_and_rewrites_nothing(tmp_path):
    """The cost of a commit does not grow with the run: the shard plus one line of commits.jsonl."""
    schema = output_schema()
    run, _ = open_run(tmp_path / "run")
    manifest, log = tmp_path / "run" / "manifest.json", tmp_path / "run" / "commits.jsonl"
    before = (manifest.stat().st_ino, manifest.stat().st_mtime_ns, manifest.read_bytes())
    sink = ShardWriter(run, schema, shard_rows=1)
    sizes = [log.stat().st_size]
    for i in range(5):
        sink.add(row(schema, i))
        sizes.append(log.stat().st_size)
    run.close()
    assert (manifest.stat().st_ino, manifest.stat().st_mtime_ns, manifest.read_bytes()) == before
    lines = log.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x) for x in lines[:-1]] == read_manifest(str(tmp_path / "run"))["shards"]
    assert [b - a for a, b in zip(sizes, sizes[1:])] == [len(x) + 1 for x in lines[:-1]]
    assert json.loads(manifest.read_text())["shards"] == []  # what the opening listed: nothing yet


def test_an_interrupted_commit_is_no_commit_and_is_cut_on_start(tmp_path):
    """A power cut mid-append leaves a last line without its newline: readers ignore it, the next
    start cuts it off and deletes its shard, and commits go on from there."""
    schema = output_schema()
    run, _ = open_run(tmp_path / "run")
    sink = ShardWriter(run, schema, shard_rows=1)
    sink.add(row(schema, 0))
    sink.add(row(schema, 1))
    run.close()
    shards, log = tmp_path / "run" / "shards", tmp_path / "run" / "commits.jsonl"
    whole = log.read_bytes()
    (shards / "part-00002.parquet").write_bytes((shards / "part-00001.parquet").read_bytes())
    record = json.loads(whole.split(b"\n")[1])
    log.write_bytes(whole + json.dumps({**record, "file": "shards/part-00002.parquet"}).encode()[:40])
    assert len(read_manifest(str(tmp_path / "run"))["shards"]) == 2
    run, messages = open_run(tmp_path / "run")
    assert sorted(os.listdir(shards)) == ["part-00000.parquet", "part-00001.parquet"]
    assert log.read_bytes() == b""  # the resume's manifest lists the two committed shards
    assert [e["file"] for e in read_manifest(str(tmp_path / "run"))["shards"]] == [
        "shards/part-00000.parquet", "shards/part-00001.parquet"]
    assert any("cut an incomplete last line" in m for m in messages)
    assert set(run.committed_keys()) == {(0, 0), (1, 0)}
    ShardWriter(run, schema, shard_rows=1).add(row(schema, 2))
    run.close()
    m = read_manifest(str(tmp_path / "run"))
    assert [e["file"] for e in m["shards"]][-1] == "shards/part-00002.parquet" and len(m["shards"]) == 3


def test_a_damaged_commit_line_is_refused(tmp_path):
    two_shards(tmp_path / "run")
    log = tmp_path / "run" / "commits.jsonl"
    lines = log.read_bytes().split(b"\n")
    log.write_bytes(b"\n".join([lines[0], lines[1][:30], *lines[2:]]))
    with pytest.raises(JobError, match="commits.jsonl line 2: not a commit record"):
        open_run(tmp_path / "run")
    log.unlink()
    with pytest.raises(JobError, match="commits.jsonl: missing, so which shards were committed is unknown"):
        open_run(tmp_path / "run")


def to_format_1(run_dir):
    """The layout earlier versions wrote: every shard record inside manifest.json, no commit log."""
    m = json.loads((run_dir / "manifest.json").read_text())
    log = run_dir / "commits.jsonl"
    m.update(format=1, shards=[json.loads(x) for x in log.read_text().splitlines()])
    (run_dir / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
    log.unlink()
    return m["shards"]


def test_a_run_of_the_earlier_format_is_read_and_resumed(tmp_path):
    from pipelines.cli.status import run_status

    schema = output_schema()
    run_dir = tmp_path / "run"
    run, _ = open_run(run_dir)
    sink = ShardWriter(run, schema, shard_rows=2)
    for i in range(4):
        sink.add(row(schema, i))
    run.close()
    records = to_format_1(run_dir)
    assert read_manifest(str(run_dir))["shards"] == records  # status, report and export read it as it is
    assert run_status(str(run_dir))["shards"] == 2
    (run_dir / "commits.jsonl").write_text('{"file": "shards/part-0')  # a conversion cut short by a crash
    run, _ = open_run(run_dir)
    assert set(run.committed_keys()) == {(i, 0) for i in range(4)}
    ShardWriter(run, schema, shard_rows=1).add(row(schema, 4))
    run.close()
    header = json.loads((run_dir / "manifest.json").read_text())
    assert header["format"] == 3 and header["shards"] == records  # listed by the resume
    m = read_manifest(str(run_dir))
    assert m["shards"][:2] == records and m["shards"][2]["file"] == "shards/part-00002.parquet"
    (run_dir / "manifest.json").write_text(json.dumps({**header, "format": 4}))
    with pytest.raises(JobError, match="format 4, which this mtplx-batch does not read"):
        open_run(run_dir)


def test_a_run_whose_log_holds_every_shard_is_read_and_resumed(tmp_path):
    """Format 2: manifest.json lists no shard, the log holds them all."""
    run_dir = tmp_path / "run"
    two_shards(run_dir)
    header = json.loads((run_dir / "manifest.json").read_text())
    del header["shards"]
    (run_dir / "manifest.json").write_text(json.dumps({**header, "format": 2}))
    assert [e["file"] for e in read_manifest(str(run_dir))["shards"]] == ["shards/part-00000.parquet",
                                                                          "shards/part-00001.parquet"]
    run, _ = open_run(run_dir)
    assert set(run.committed_keys()) == {(0, 0), (1, 0)}
    run.close()
    assert len(json.loads((run_dir / "manifest.json").read_text())["shards"]) == 2


def test_a_finished_session_lists_every_shard_in_the_manifest(tmp_path):
    """The log empties once manifest.json lists its shards; a rewrite cut off before the log
    emptied leaves a record in both files, which counts once."""
    schema = output_schema()
    run_dir = tmp_path / "run"
    manifest, log = run_dir / "manifest.json", run_dir / "commits.jsonl"
    run, _ = open_run(run_dir)
    sink = ShardWriter(run, schema, shard_rows=1)
    for i in range(3):
        sink.add(row(schema, i))
    logged = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(logged) == 3 and json.loads(manifest.read_text())["shards"] == []
    run.finish()
    assert json.loads(manifest.read_text())["shards"] == logged and log.read_bytes() == b""
    assert json.loads(manifest.read_text())["sessions"][-1]["finished"] > 0
    sink.add(row(schema, 3))  # a commit after it goes to the log again
    run.close()
    assert len(log.read_text().splitlines()) == 1
    m = read_manifest(str(run_dir))
    assert [e["file"] for e in m["shards"]] == [f"shards/part-{i:05d}.parquet" for i in range(4)]
    log.write_text("".join(json.dumps(e) + "\n" for e in m["shards"]))  # as if the log never emptied
    assert read_manifest(str(run_dir))["shards"] == m["shards"]
    run, _ = open_run(run_dir)
    assert len(run.committed_keys()) == 4 and log.read_bytes() == b""
    run.close()
    changed = {**m["shards"][0], "rows": 2}  # the same shard, recorded otherwise: damage, not a repeat
    log.write_text(json.dumps(changed) + "\n")
    with pytest.raises(JobError, match="part-00000.parquet is recorded twice"):
        read_manifest(str(run_dir))


def test_rows_outside_the_input_and_an_output_dir_that_is_a_file_are_refused(tmp_path):
    schema = output_schema()
    run, _ = open_run(tmp_path / "run")
    run.update(input_rows=2, samples=1)
    sink = ShardWriter(run, schema, shard_rows=1)
    sink.add(row(schema, 0))
    sink.add(row(schema, 5))  # a row the input does not have: a shard from another run, say
    run.close()
    with pytest.raises(JobError, match=r"part-00001.parquet: holds row 5 sample 0, outside the input \(2 rows x 1"):
        open_run(tmp_path / "run")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(JobError, match="output.dir .*file exists and is not a directory"):
        open_run(tmp_path / "file")


def test_manifest_benchmark_runs_and_counts_a_constant_cost(tmp_path, capsys):
    from benchmarks import manifest as bench

    res = bench.main(["--shards", "4", "--rows", "2", "--chars", "40", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "bytes written per commit" in out and "resume" in out
    shards = sorted((tmp_path / "run" / "shards").iterdir())
    records = read_manifest(str(tmp_path / "run"))["shards"]  # listed by the resume: the log's lines
    assert len(shards) == len(records) == 4
    lines = sum(len(json.dumps(e, sort_keys=True)) + 1 for e in records)
    assert res["total_bytes"] == sum(p.stat().st_size for p in shards) + lines


def test_committed_keys_answer_as_a_set_of_row_sample_pairs_would():
    rng = np.random.default_rng(0)
    keys = {(int(r), int(s)) for r, s in zip(rng.integers(0, 50, 300), rng.integers(0, 3, 300))}
    rows, samples = (np.array(c) for c in zip(*keys))
    got = CommittedKeys.of(rows, samples)
    assert len(got) == len(keys) and set(got) == keys
    assert all(((r, s) in got) == ((r, s) in keys) for r in range(-1, 52) for s in range(4))
    assert got.rows_below(20) == sum(r < 20 for r, _ in keys)
    full = CommittedKeys.of(np.repeat(np.arange(5), 3), np.tile(np.arange(3), 5))
    assert full.has_all(5, 3) and full.has_all(4, 2) and not full.has_all(6, 3) and not full.has_all(5, 4)
    assert sorted(full.flat(3).tolist()) == list(range(15))
    assert len(CommittedKeys.of([], [])) == 0
