"""A run limited by input.limit (or --limit) is finished when its planned rows are committed,
and running a finished job again loads no model."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, records, sample_rows, write_job, write_parquet
from pipelines.cli.commands import main


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def limited(tmp_path, llama):
    """A job of 10 input rows with input.limit: 4, run once."""
    data = write_parquet(tmp_path / "in.parquet", sample_rows(10))
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run", input={"limit": 4},
                                                    generation={"max_tokens": 4}, output={"shard_rows": 3}))
    r = cli("run", job)
    assert r.exit_code == 0, r.output
    return job, tmp_path / "run"


def test_status_report_export_call_a_finished_limited_run_finished(limited, tmp_path):
    job, run = limited
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["input_rows"] == 10 and manifest["planned_rows"] == 4 and manifest["limit"] == 4
    r = cli("status", run, "--json")
    st = json.loads(r.output)
    assert st["complete"] and st["rows_left"] == 0 and st["rows_expected"] == 4 and not st["eta_seconds"]
    text = cli("status", run).output
    assert "COMPLETE" in text and "0 left (limit: the first 4 of 10 input rows)" in text and "ETA: done" in text
    r = cli("export", run, "--format", "jsonl")
    assert r.exit_code == 0 and "not complete" not in r.output, r.output
    assert len((run / "export" / "results.jsonl").read_text().splitlines()) == 4
    pytest.importorskip("matplotlib")
    r = cli("report", run)
    assert r.exit_code == 0, r.output
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert summary["rows_left"] == 0 and summary["rows_expected"] == 4
    assert "rows left</span>" not in (run / "report" / "index.html").read_text()


def test_rerun_and_resume_of_a_finished_run_load_no_model(limited, no_weights):
    job, run = limited
    before = records(run)
    for args in (("run", job), ("resume", run)):
        r = cli(*args)
        assert r.exit_code == 0, r.output
        assert "finished: all 4 output rows are committed" in r.output
    assert records(run) == before
    r = cli("run", job, "--log-json")
    events = [json.loads(line) for line in r.stderr.splitlines()]
    assert [e["event"] for e in events if e["event"] != "log"] == ["start", "summary"]
    assert events[-1]["status"] == "done" and events[-1]["skipped"] == 4


def test_lifting_the_limit_continues_and_then_is_finished(limited):
    job, run = limited
    r = cli("run", job, "--set", "input.limit=null")
    assert r.exit_code == 0, r.output
    assert [x["row"] for x in read_output(run)] == list(range(10))
    st = json.loads(cli("status", run, "--json").output)
    assert st["complete"] and st["rows_expected"] == 10 and st["limit"] is None


def test_a_limited_run_not_yet_finished_is_not_finished(tmp_path, llama):
    data = write_parquet(tmp_path / "in.parquet", sample_rows(10))
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run", input={"limit": 6},
                                                    generation={"max_tokens": 4}, output={"shard_rows": 3}))
    assert cli("run", job, "--limit", "3").exit_code == 0  # --limit bounds the session, not the run
    st = json.loads(cli("status", tmp_path / "run", "--json").output)
    assert not st["complete"] and st["rows_expected"] == 6 and st["rows_left"] == 3
    r = cli("run", job, "--limit", "3")
    assert "finished: all 3 output rows are committed" in r.output  # nothing left for that session
    r = cli("run", job)  # input.limit: 6 plans 3 more
    assert r.exit_code == 0 and "loading" in r.output
    st = json.loads(cli("status", tmp_path / "run", "--json").output)
    assert st["complete"] and st["rows_expected"] == 6 and st["rows_done"] == 6
