"""Live progress from the engine's rounds (Engine.on_progress), recorded progress, and the
report's throughput over time drawn from it."""

from __future__ import annotations

import io
import json
import re

import pytest

from jobkit import job_dict, read_output, sample_rows, write_jsonl
from pipelines.job.config import build_job
from pipelines.cli.progress import Bars
from pipelines.cli.report_plots import throughput_intervals
from pipelines.execution.progress import Progress
from pipelines.execution.session import run_job
from pipelines.io.records import PROGRESS_FILE
from pipelines.io.run_stats import collect, read_progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", max_position_embeddings=256)


def test_rates_and_eta_from_the_first_round():
    stream, clock = io.StringIO(), Clock()
    p = Progress(total=4, stream=stream, clock=clock, max_tokens=10, view=Bars)
    for i in range(4):
        p.submitted((i, 0), 30)
    clock.t = 0.5
    p.engine_event("prefill", 120)
    clock.t = 1.0
    p.engine_event("decode", 4)  # first tokens of the 4 rows in flight
    clock.t = 2.0
    p.engine_event("decode", 4)
    assert p.rows == 0 and p.generated_tokens == 8 and p.tokens_per_second() == pytest.approx(4.0)
    # the prefill rate is over the prefill's own time, and stays put once decoding runs
    assert p.prefill_tokens_per_second() == pytest.approx(240.0)
    # before any row finishes every row runs to max_tokens: 8 tokens in 8 row-seconds, so 10 s a row
    assert p.eta_seconds() == pytest.approx(8.0)
    assert "8 tok, 4.0 tok/s" in p.view.postfix() and "ETA 8s" in p.view.postfix()
    assert "120 prompt tokens, 240 prompt tok/s" in stream.getvalue()
    clock.t = 3.0
    p.engine_event("decode", 4)
    p.finished({"row": 0, "sample": 0, "finish_reason": "stop", "completion_tokens": 3})
    eta = p.eta_seconds()
    assert eta is not None and 0 < eta < 7  # one row took 3 s: the others are expected sooner than max_tokens
    for i in (1, 2, 3):
        clock.t += 1.0
        p.finished({"row": i, "sample": 0, "finish_reason": "length", "completion_tokens": 10})
    assert p.eta_seconds() == 0.0
    p.committed({"rows": 4, "completion_tokens": 33, "elapsed": 5.5})
    p.close()
    assert p.tokens_per_second() == pytest.approx(6.0)  # closed: committed tokens per active second


def test_the_line_says_when_the_engine_builds_kernels():
    """A program's first call (on a machine's first run, seconds of kernel builds) shows on the bar
    and in --log-json's progress lines until the engine's next prefill or round; the prefill rate
    does not count it."""
    stream, clock = io.StringIO(), Clock()
    p = Progress(total=2, stream=stream, clock=clock, max_tokens=10, view=Bars)
    p.submitted((0, 0), 30)
    clock.t = 0.5
    p.engine_event("prefill", 30)
    clock.t = 0.6
    p.engine_event("build", 1)
    assert p.building and p.snapshot()["building"] is True
    assert "building kernels" in p.view.postfix() and "building kernels" in stream.getvalue()
    clock.t = 20.0
    p.engine_event("decode", 1)
    assert not p.building and "building kernels" not in p.view.postfix()
    assert p.prefill_tokens_per_second() == pytest.approx(60.0)
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
    assert first["prefill_tokens"] > 0 and first["prefill_tokens_per_second"] > 0 and first["eta_seconds"] is not None
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


def test_the_bar_the_summary_status_and_report_agree_on_tokens_per_second(tmp_path, model, capsys):
    """One run, one tok/s: the bar's last figure, the summary's, `status`'s and `report`'s."""
    from pipelines.cli.status import format_status, run_status

    data = write_jsonl(tmp_path / "in.jsonl", sample_rows(10))
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"},
                             generation={"max_tokens": 12, "stop": ["("]}, schedule={"max_batch": 4},
                             output={"shard_rows": 3}))
    capsys.readouterr()
    summary = run_job(job, quiet=False, bars=Bars)
    bar = re.findall(r"([0-9.]+) tok/s", capsys.readouterr().err)[-1]
    status = run_status(str(tmp_path / "run"))
    assert summary.completion_tokens == status["completion_tokens"] > 0
    assert bar == f"{summary.tokens_per_second:.1f}" == f"{status['tokens_per_second']:.1f}" \
        == f"{collect(str(tmp_path / 'run')).tokens_per_second:.1f}", bar
    assert f"{summary.tokens_per_second:.1f} tok/s" in format_status(status)
    assert summary.seconds == pytest.approx(status["active_seconds"])


class Rounds:
    """A clock that advances one unit per engine report (a prefill span or a decode round), so a
    run's ETA can be checked against what was really left, in rounds, with no wall-clock timing."""

    def __init__(self, progress):
        self.t = 0.0
        progress.clock, progress.started = self, 0.0
        self.progress, self.etas, self.finishes = progress, [], []

    def __call__(self):
        return self.t

    def submitted(self):
        pass

    def finished(self, via_engine):
        self.finishes.append(self.t)
        self.etas.append((self.t, self.progress.eta_seconds()))

    def engine_event(self, now, first_round):
        self.etas.append((self.t, self.progress.eta_seconds()))
        self.t += 1.0

    def close(self):
        pass


def test_the_eta_is_sane_from_the_first_rows_on(tmp_path, model):
    """A real run with rows of many lengths (a stop string ends some early, others run to
    max_tokens): from the first finished row on, the ETA is always a number, never 0 while rows
    remain, and within a factor of two of the rounds really left, or a few rows' time at the end."""
    data = write_jsonl(tmp_path / "in.jsonl", sample_rows(40))
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"},
                             generation={"max_tokens": 40, "stop": ["("]},
                             schedule={"max_batch": 4, "order": "input"}, output={"shard_rows": 100}))
    views = []
    run_job(job, quiet=False, bars=lambda p: views.append(Rounds(p)) or views[-1])
    lengths = [r["completion_tokens"] for r in read_output(tmp_path / "run")]
    assert min(lengths) < 10 and lengths.count(40) >= 8  # short and long rows
    clock = views[0]
    end, first = max(clock.finishes), min(clock.finishes)
    checked = 0
    for t, eta in clock.etas:
        if first <= t < end:
            left = end - t
            assert eta is not None and eta > 0, (t, eta, left)
            assert left / 2 <= eta <= 2 * left or abs(eta - left) <= 20, (t, eta, left)
            checked += 1
    assert checked > 100
