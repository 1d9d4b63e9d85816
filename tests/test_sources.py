"""Every input format streams the same rows with a running index; fatal vs per-row problems."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.job.config import InputConfig
from pipelines.errors import JobError
from pipelines.io.sources import open_source

ROWS = [{"id": f"r{i}", "prompt": f"question {i}", "n": i} for i in range(7)]


def read(fmt, path, columns=None, **kw):
    src = open_source(InputConfig(path=str(path), format=fmt, **kw), columns)
    rows = list(src.rows())
    assert [r.index for r in rows] == list(range(len(rows)))
    return src, rows


def datas(rows):
    return [r.data for r in rows]


def test_parquet_file_dir_and_glob_stream_in_order(tmp_path):
    table = pa.Table.from_pylist(ROWS)
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(table.slice(0, 4), d / "a.parquet", row_group_size=2)
    pq.write_table(table.slice(4), d / "b.parquet")
    (d / "notes.txt").write_text("ignored")
    for path in (d, d / "*.parquet"):
        src, rows = read("parquet", path)
        assert datas(rows) == ROWS
        assert src.count_rows() == 7 and len(src.files) == 2
    src, rows = read("parquet", d / "a.parquet", columns=["prompt"])
    assert datas(rows) == [{"prompt": r["prompt"]} for r in ROWS[:4]]
    assert src.column_type("n") == pa.int64()


def test_parquet_rows_are_lazy(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS * 500), tmp_path / "big.parquet", row_group_size=100)
    src = open_source(InputConfig(path=str(tmp_path / "big.parquet")), None)
    it = src.rows()
    assert next(it).data == ROWS[0]  # nothing forces the whole file into a list


def test_parquet_schema_change_and_missing_column_are_fatal(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"id": 1, "prompt": "x", "n": 1}]), tmp_path / "b.parquet")
    with pytest.raises(JobError, match=r"b.parquet: column 'id' is int64, but string"):
        open_source(InputConfig(path=str(tmp_path)), ["id", "prompt"])
    with pytest.raises(JobError, match=r"a.parquet: no column 'question'"):
        open_source(InputConfig(path=str(tmp_path / "a.parquet")), ["question"])
    # only the columns the job reads must agree
    open_source(InputConfig(path=str(tmp_path)), ["prompt"])


def test_unreadable_and_missing_inputs_are_fatal(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(JobError, match="broken.parquet: not a readable parquet file"):
        open_source(InputConfig(path=str(tmp_path / "broken.parquet")), None)
    with pytest.raises(JobError, match="does not exist"):
        open_source(InputConfig(path=str(tmp_path / "nope.parquet")), None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="matched no parquet files"):
        open_source(InputConfig(path=str(tmp_path / "empty")), None)
    with pytest.raises(JobError, match="matched no jsonl files"):
        open_source(InputConfig(path=str(tmp_path / "*.jsonl"), format="jsonl"), None)


def test_arrow_ipc_file_and_stream(tmp_path):
    table = pa.Table.from_pylist(ROWS)
    with pa.ipc.new_file(tmp_path / "a.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=3)
    with pa.ipc.new_stream(tmp_path / "b.arrow", table.schema) as w:
        w.write_table(table)
    for name in ("a.arrow", "b.arrow"):
        src, rows = read("arrow", tmp_path / name)
        assert datas(rows) == ROWS and src.count_rows() == 7
    src, rows = read("arrow", tmp_path, columns=["id"])
    assert len(rows) == 14 and rows[7].data == {"id": "r0"}
    (tmp_path / "c.arrow").write_bytes(b"garbage")
    with pytest.raises(JobError, match="c.arrow: not a readable Arrow IPC"):
        open_source(InputConfig(path=str(tmp_path / "c.arrow"), format="arrow"), None)


def test_jsonl_bad_lines_are_row_errors(tmp_path):
    lines = [json.dumps(r).encode() for r in ROWS[:3]]
    lines.insert(1, b'{"id": "x", "prompt": ')  # truncated JSON
    lines.insert(3, b"")  # blank lines are not rows
    lines.append(b'{"id": "bad", "prompt": "caf\xe9"}')  # latin-1 byte
    lines.append(b'["a", "list"]')
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    src, rows = read("jsonl", tmp_path / "in.jsonl")
    assert src.count_rows() == len(rows) == 6
    assert [r.data["id"] if r.data else None for r in rows] == ["r0", None, "r1", "r2", None, None]
    assert "line 2 is not valid JSON" in rows[1].error
    assert "line 6 is not UTF-8" in rows[4].error
    assert "is a JSON list, not an object" in rows[5].error
    assert src.schema() is None and src.column_type("n") == pa.int64()


def test_jsonl_gz_and_projection(tmp_path):
    import gzip

    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    _, rows = read("jsonl", tmp_path / "in.jsonl.gz", columns=["prompt", "missing"])
    assert datas(rows) == [{"prompt": r["prompt"]} for r in ROWS]


def test_csv_keeps_text_exactly_and_flags_bad_records(tmp_path):
    (tmp_path / "in.csv").write_bytes(
        b'id,prompt,n\n'
        b'007,"multi\nline, quoted",1\n'
        b'8,too,many,fields\n'
        b'9,"caf\xe9",3\n'
        b'10,,4\n'
    )
    src, rows = read("csv", tmp_path / "in.csv")
    assert src.count_rows() == 4
    assert rows[0].data == {"id": "007", "prompt": "multi\nline, quoted", "n": "1"}
    assert "has 4 fields, the header has 3" in rows[1].error
    assert "not UTF-8" in rows[2].error
    assert rows[3].data["prompt"] == ""
    assert src.column_type("n") == pa.string()
    with pytest.raises(JobError, match="no column 'question'"):
        open_source(InputConfig(path=str(tmp_path / "in.csv"), format="csv"), ["question"])


def test_tsv(tmp_path):
    (tmp_path / "in.tsv").write_text("id\tprompt\na\tb, c\n")
    _, rows = read("csv", tmp_path / "in.tsv")
    assert datas(rows) == [{"id": "a", "prompt": "b, c"}]


def test_hf_saved_dataset_and_local_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "saved"))
    src, rows = read("hf", tmp_path / "saved")
    assert datas(rows) == ROWS and src.count_rows() == 7
    assert src.column_type("n") == pa.int64()

    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dd"))
    _, rows = read("hf", tmp_path / "dd", split="test", columns=["prompt"])
    assert datas(rows) == [{"prompt": r["prompt"]} for r in ROWS]
    with pytest.raises(JobError, match="input.split: 'train' not in"):
        open_source(InputConfig(path=str(tmp_path / "dd"), format="hf"), None)

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "one.parquet")
    _, rows = read("hf", tmp_path / "one.parquet")
    assert datas(rows) == ROWS
    (tmp_path / "jdir").mkdir()
    with open(tmp_path / "jdir" / "data.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    _, rows = read("hf", tmp_path / "jdir")
    assert datas(rows) == ROWS
    with pytest.raises(JobError, match="cannot load"):
        open_source(InputConfig(path=str(tmp_path / "no_such_dataset_dir"), format="hf"), None)


def test_hf_resume_refuses_a_dataset_that_moved(tmp_path, tiny_model):
    """The revision `datasets` resolved is pinned (a saved dataset's fingerprint; on the Hub, the
    commit): a resume over changed data is refused by name instead of re-keying the rows."""
    import shutil

    from click.testing import CliRunner

    from jobkit import job_dict, write_job
    from pipelines.cli.commands import main

    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    before = datasets.load_from_disk(str(saved))._fingerprint
    job = write_job(tmp_path / "job.yaml", job_dict(tiny_model("llama"), saved, tmp_path / "run", fmt="hf",
                                                    generation={"max_tokens": 2}))
    cli = lambda *a: CliRunner().invoke(main, [str(x) for x in a], catch_exceptions=False)  # noqa: E731
    assert cli("run", job, "-q", "--limit", "3").exit_code == 0
    shutil.rmtree(saved)  # the data changes: one prompt edited, the dataset saved again in its place
    datasets.Dataset.from_list([{**r, "prompt": "edited"} if r["id"] == "r5" else r for r in ROWS]).save_to_disk(str(saved))
    after = datasets.load_from_disk(str(saved))._fingerprint
    assert after != before
    for cmd in ("run", "validate"):
        out = cli(cmd, job)
        assert out.exit_code == 2, out.output
        assert f"input.revision (was {before}, now {after})" in out.output, out.output
