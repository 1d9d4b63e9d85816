"""`export`: jsonl, openai-batch and hf round trips of a real run (errors, speculation, shards
committed out of input order)."""

import json

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, records, sample_rows, write_jsonl
from pipelines.cli.commands import main
from pipelines.job.config import build_job
from pipelines.errors import JobError
from pipelines.io.export import OrderedRun, export_run
from pipelines.execution.session import run_job

OUTPUT_KEYS = {"id", "row", "sample", "completion", "finish_reason", "error", "prompt_tokens", "completion_tokens",
               "accepted_by_depth", "acceptance_rate", "decode_seconds", "topic"}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", max_position_embeddings=128)


def rows_with_errors():
    return sample_rows(10) + [{"id": "empty", "prompt": "", "topic": "x"},
                              {"id": "too-long", "prompt": " ".join(["word"] * 300), "topic": "x"},
                              b"not json at all"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("export_run")
    data = write_jsonl(tmp / "in.jsonl", rows_with_errors())
    # prefix order and small shards: rows are committed far from input order
    job = build_job(job_dict(model, data, tmp / "run", fmt="jsonl", input={"chat_template": "off"},
                             speculative={"method": "ngram", "adaptive_depth": False},  # every round drafts
                             generation={"max_tokens": 6, "n": 2, "temperature": 0.7},
                             output={"shard_rows": 3, "keep_columns": ["topic"]}))
    run_job(job)
    return job


def ids_in_input_order():
    out = []
    for r in rows_with_errors():
        out.append(r["id"] if isinstance(r, dict) else None)
    return out


def test_ordered_run_is_input_order_whatever_the_chunking(run):
    committed = []
    for t in OrderedRun(run.output.dir).tables(chunk_rows=1000):
        committed += list(zip(t.column("row").to_pylist(), t.column("sample").to_pylist()))
    assert committed == [(i, s) for i in range(13) for s in range(2)]
    shard_order = [(r["row"], r["sample"]) for r in _shard_order(run.output.dir)]
    assert shard_order != committed, "the fixture should commit rows out of input order"
    small = [r for t in OrderedRun(run.output.dir).tables(chunk_rows=5) for r in t.to_pylist()]
    assert small == read_output(run.output.dir)


def _shard_order(run_dir):
    import pyarrow.parquet as pq

    return [r for e in records(run_dir) for r in pq.read_table(f"{run_dir}/{e['file']}").to_pylist()]


def test_jsonl_round_trip(run, tmp_path):
    out = tmp_path / "out.jsonl"
    res = export_run(run.output.dir, "jsonl", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert res.rows == len(lines) == 26 and res.left == 0
    assert lines == read_output(run.output.dir)  # every column, every row, same values
    assert OUTPUT_KEYS <= set(lines[0])
    assert [r["id"] for r in lines[::2]] == ids_in_input_order()
    assert [r["error"] is not None for r in lines[::2]] == [False] * 10 + [True] * 3


def test_hf_directory_loads_with_datasets(run, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "ds"
    res = export_run(run.output.dir, "hf", str(out))
    assert (out / "README.md").exists() and res.files[-1].endswith("README.md")
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf_cache"))
    want = read_output(run.output.dir)
    assert ds.num_rows == len(want) == 26
    assert ds["id"] == [r["id"] for r in want] and ds["sample"] == [r["sample"] for r in want]
    assert ds["completion"] == [r["completion"] for r in want]
    assert ds["accepted_by_depth"] == [r["accepted_by_depth"] for r in want]
    assert ds.features["accepted_by_depth"].feature.dtype == "int64"
    # also as plain parquet files
    again = datasets.load_dataset("parquet", data_dir=str(out / "data"), split="train",
                                  cache_dir=str(tmp_path / "hf_cache2"))
    assert again["id"] == ds["id"]
    card = (out / "README.md").read_text()
    errors = sum(r["finish_reason"] == "error" for r in want)
    drafted = sum(r["drafted_tokens"] for r in want)
    accepted = sum(r["accepted_tokens"] for r in want)
    for text in ["configs:", "path: data/train-*.parquet", "generations from llama", f"26 ({26 - errors} generated, "
                 f"{errors} errors)", f"{accepted / drafted:.1%} of {drafted:,} drafted", "method: ngram",
                 "max_tokens: 6", "`topic` | kept from the input", "path: in.jsonl"]:
        assert text in card, text
    assert str(tmp_path) not in card  # no local paths in a card meant for sharing


def test_openai_batch_export_of_a_plain_run(run, tmp_path):
    out = tmp_path / "results.jsonl"
    res = export_run(run.output.dir, "openai-batch", str(out))
    ok = [json.loads(line) for line in out.read_text().splitlines()]
    bad = [json.loads(line) for line in (tmp_path / "results_errors.jsonl").read_text().splitlines()]
    assert (res.written, res.failed) == (10, 3) and len(ok) == 10 and len(bad) == 3
    assert [x["custom_id"] for x in ok] == ids_in_input_order()[:10]
    want = {(r["id"], r["sample"]): r for r in read_output(run.output.dir)}
    for line in ok:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert [c["index"] for c in body["choices"]] == [0, 1]  # n = 2 samples -> 2 choices
        for c in body["choices"]:
            r = want[(line["custom_id"], c["index"])]
            assert c["message"] == {"role": "assistant", "content": r["completion"], "refusal": None}
            assert c["finish_reason"] == r["finish_reason"]
        assert body["usage"]["completion_tokens"] == sum(want[(line["custom_id"], s)]["completion_tokens"]
                                                         for s in (0, 1))
    assert [x["custom_id"] for x in bad] == ["empty", "too-long", None]
    assert bad[0]["response"]["status_code"] == 400 and "prompt is empty" in \
        bad[0]["response"]["body"]["error"]["message"]
    assert bad[1]["response"]["body"]["error"]["code"] == "too_long_for_context"
    assert bad[2]["response"] is None and "not valid JSON" in bad[2]["error"]["message"]


def test_refusals_overwrite_and_unfinished_runs(run, tmp_path, model):
    out = tmp_path / "x.jsonl"
    export_run(run.output.dir, "jsonl", str(out))
    with pytest.raises(JobError, match="already exists; pass --overwrite"):
        export_run(run.output.dir, "jsonl", str(out))
    export_run(run.output.dir, "jsonl", str(out), overwrite=True)
    with pytest.raises(JobError, match="does not exist"):
        export_run(run.output.dir, "jsonl", str(tmp_path / "no" / "x.jsonl"))
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "precious.txt").write_text("x")
    with pytest.raises(JobError, match="not an earlier hf export"):
        export_run(run.output.dir, "hf", str(tmp_path / "keep"), overwrite=True)
    with pytest.raises(JobError, match="not a run directory"):
        export_run(str(tmp_path), "jsonl", str(tmp_path / "y.jsonl"))
    # an unfinished run exports what is committed and says what is missing
    data = write_jsonl(tmp_path / "in.jsonl", sample_rows(5))
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"}))
    run_job(job, limit=2)
    r = CliRunner().invoke(main, ["export", job.output.dir, "--format", "hf", "--out", str(tmp_path / "part")])
    assert r.exit_code == 0, r.output
    assert "exported 2 rows" in r.stdout and "3 of 5 output rows are not generated yet" in r.stderr
    assert "3 of 5 rows are missing" in (tmp_path / "part" / "README.md").read_text()
    r = CliRunner().invoke(main, ["export", job.output.dir, "--format", "hf", "--out", str(tmp_path / "part"),
                                  "--overwrite"])
    assert r.exit_code == 0


def test_export_cli(run, tmp_path):
    r = CliRunner().invoke(main, ["export", run.output.dir, "--format", "openai-batch", "--out",
                                  str(tmp_path / "res.jsonl"), "--errors-out", str(tmp_path / "err.jsonl")])
    assert r.exit_code == 0, r.output
    assert "exported 10 responses and 3 failed requests" in r.stdout
    assert len((tmp_path / "err.jsonl").read_text().splitlines()) == 3
    r = CliRunner().invoke(main, ["export", run.output.dir, "--format", "jsonl", "--out", str(tmp_path / "res.jsonl")])
    assert r.exit_code == 2 and "--overwrite" in r.stderr
    r = CliRunner().invoke(main, ["export", run.output.dir, "--format", "parquet", "--out", "x"])
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["export", "--help"])
    assert r.exit_code == 0 and "Examples:" in r.stdout and "load_dataset" in r.stdout
