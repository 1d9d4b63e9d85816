"""Live progress from the engine's rounds (Engine.on_progress), recorded progress, and the
report's throughput over time drawn from it."""

from __future__ import annotations

import io
import json

import pytest

from jobkit import job_dict, read_output, sample_rows, write_jsonl
from pipelines.job.config import build_job
from pipelines.cli.progress import Bars
from pipelines.cli.report_plots import throughput_intervals
from pipelines.execution.progress import Progress
from pipelines.execution.session import run_job
from pipelines.io.checkpoint import PROGRESS_FILE
from pipelines.io.run_stats import collect, read_progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", max_position_embeddings=256)


def test_tokens_rate_and_eta_before_any_row_finishes():
    stream, clock = io.StringIO(), Clock()
    p = Progress(total=4, stream=stream, clock=clock, max_tokens=10, view=Bars)
    for _ in range(4):
        p.submitted(30)
    p.engine_event("prefill", 120)
    clock.t = 1.0
    p.engine_event("decode", 4)  # first tokens of the 4 rows in flight
    clock.t = 2.0
    p.engine_event("decode", 4)
    assert p.rows == 0 and p.generated_tokens == 8
    assert p.recent_rate() == pytest.approx(4.0)  # 4 tokens over the last second
    # 4 rows x at most 10 tokens - 8 generated = 32 tokens at 4 tok/s
    assert p.eta_seconds() == pytest.approx(8.0)
    assert "8 tok" in p.view.postfix() and "ETA 8s" in p.view.postfix()
    text = stream.getvalue()
    assert "8 tok, 4.0 tok/s" in text and "120 prompt tokens" in text  # drawn, though no row is done
    # a finished row: its tokens are already counted; the mean of finished rows takes over
    clock.t = 3.0
    p.engine_event("decode", 4)
    p.finished({"finish_reason": "length", "completion_tokens": 3})
    assert p.generated_tokens == 12 and p.completion_tokens == 3
    # 3 rows left x 3 tokens - (12 - 3) in flight = 0: the rows in flight outran the estimate
    assert p.eta_seconds() is None and "ETA ?" in p.view.postfix()
    clock.t = 4.0
    p.finished({"finish_reason": "length", "completion_tokens": 10})
    # 2 rows left x 6.5 tokens - (12 - 13 -> 0) in flight = 13 tokens at 8 tokens / 3 s
    assert p.eta_seconds() == pytest.approx(13 / (8 / 3))
    p.close()


def test_log_json_reports_tokens_from_the_first_round(tmp_path, model, capsys):
    """All rows decode together and finish together: progress still shows tokens at once."""
    data = write_jsonl(tmp_path / "in.jsonl", sample_rows(6))
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"},
                             generation={"max_tokens": 12}, schedule={"max_batch": 8}, output={"shard_rows": 100}))
    capsys.readouterr()
    run_job(job, log_json=True, log_every=30)
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    first = next(e for e in events if e["event"] == "progress")
    assert first["rows_done"] == 0 and first["completion_tokens"] > 0, first
    assert first["prefill_tokens"] > 0 and first["eta_seconds"] is not None
    assert [e["event"] for e in events].index("progress") < [e["event"] for e in events].index("shard")

    rows = read_output(tmp_path / "run")
    recorded = read_progress(str(tmp_path / "run"))
    assert recorded[0]["generated"] == 0 and recorded[-1]["rows"] == 6
    # every generated token is in the record (stop strings could trim rows, not here: length/eos)
    assert recorded[-1]["generated"] == sum(r["completion_tokens"] for r in rows)
    assert recorded[-1]["prefilled"] == sum(r["prompt_tokens"] - r["cached_prompt_tokens"] for r in rows)


def test_report_throughput_comes_from_recorded_intervals(tmp_path):
    """One shard for a run whose rows decoded together: the report's rates are per interval."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"ts": 100.0 + t, "session": 100.0, "elapsed": t, "generated": g, "prefilled": 0, "rows": 0,
              "errors": 0} for t, g in [(0, 0), (2, 80), (4, 180), (6, 280)]]
    lines.append({"ts": 500.0, "session": 499.0, "elapsed": 1, "generated": 0, "prefilled": 0, "rows": 0, "errors": 0})
    lines.append({"ts": 502.0, "session": 499.0, "elapsed": 3, "generated": 60, "prefilled": 0, "rows": 1, "errors": 0})
    text = "\n".join(json.dumps(x) for x in lines) + "\n{\"ts\": 503"  # a torn last line
    (run / PROGRESS_FILE).write_text(text)
    got = throughput_intervals(read_progress(str(run)))
    # within each session only: no interval across the gap between sessions
    assert got == [(100.0, 102.0, 40.0), (102.0, 104.0, 50.0), (104.0, 106.0, 50.0), (500.0, 502.0, 30.0)]


def test_report_of_a_real_run_reads_its_progress(tmp_path, model):
    pytest.importorskip("matplotlib")
    from pipelines.cli.report import write_report

    data = write_jsonl(tmp_path / "in.jsonl", sample_rows(4))
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"},
                             generation={"max_tokens": 8}, output={"shard_rows": 100}))
    run_job(job)
    st = collect(str(tmp_path / "run"))
    assert len(st.progress) >= 2 and st.progress[-1]["rows"] == 4
    files = write_report(str(tmp_path / "run"))
    assert (tmp_path / "run" / "report" / "throughput.png").exists() and files.index
    assert PROGRESS_FILE in (tmp_path / "run" / "report" / "index.html").read_text()
