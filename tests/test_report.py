"""`report`, live progress (bars, --quiet, --log-json) on real runs of a tiny model."""

import io
import json
import re
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, sample_rows, write_job, write_jsonl
from pipelines.cli.commands import main
from pipelines.job.config import build_job
from pipelines.cli.progress import Bars, terminal_bars
from pipelines.cli.report import write_report
from pipelines.execution.progress import Progress
from pipelines.execution.session import run_job
from pipelines.io.run_stats import collect, error_kind

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    return len(data), width, height


def lines_with_errors():
    """Sample prompts (some with repeated text, so prompt lookup drafts get accepted) plus one
    row of each error kind the pipeline produces before the engine."""
    rows = sample_rows(10)
    rows[3]["prompt"] = "one two three four five one two three four five one two three four"
    return rows + [
        {"id": "null-prompt", "prompt": None},
        {"id": "too-long", "prompt": " ".join(["word"] * 300)},
        b'{"id": "broken", "prompt": ',
        {"id": "q1", "prompt": "a duplicate id"},
    ]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", max_position_embeddings=128)


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory, model):
    """A finished run with errors and ngram speculation, in several shards."""
    tmp = tmp_path_factory.mktemp("report_run")
    data = write_jsonl(tmp / "in.jsonl", lines_with_errors())
    job = build_job(job_dict(model, data, tmp / "run", fmt="jsonl", input={"chat_template": "off"},
                             speculative={"method": "ngram", "depth": 3, "adaptive_depth": False}, generation={"max_tokens": 24},
                             output={"shard_rows": 4}))
    run_job(job)
    return job


def test_tokens_per_verify_is_one_figure_everywhere(spec_run):
    """The column, `status` and `report` all show tokens committed per drafting verify,
    (accepted + verifies) / verifies: not completion tokens (the prefill token and rounds that
    drafted nothing are no verify of a draft) over verifies."""
    from pipelines.cli.status import run_status

    out = [r for r in read_output(spec_run.output.dir) if r["finish_reason"] != "error"]
    for r in out:
        want = (r["accepted_tokens"] + r["verify_calls"]) / r["verify_calls"] if r["verify_calls"] else None
        assert r["tokens_per_verify"] == want, r["id"]
    assert any(r["completion_tokens"] > r["accepted_tokens"] + r["verify_calls"] for r in out if r["verify_calls"])
    accepted, verifies = sum(r["accepted_tokens"] for r in out), sum(r["verify_calls"] for r in out)
    want = (accepted + verifies) / verifies
    assert run_status(spec_run.output.dir)["tokens_per_verify"] == pytest.approx(want)
    assert collect(spec_run.output.dir).tokens_per_verify == pytest.approx(want)


def test_columns_doc_lists_every_output_column():
    from pipelines.io.columns import OUTPUT_COLUMNS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "columns.md").read_text(encoding="utf-8")
    documented = re.findall(r"^\| `(\w+)` \|", doc, flags=re.M)
    assert sorted(documented) == sorted(n for n, _ in OUTPUT_COLUMNS)


def test_error_kinds():
    assert error_kind("in.jsonl line 3 is not valid JSON (x); fix or drop the line") == "unreadable input row"
    assert error_kind("data.csv line 4 has 3 fields, the header has 2") == "unreadable input row"
    assert error_kind("prompt is 600 tokens; the model's context holds 128 (prompt + ...)") == "too long for context"
    assert error_kind("row needs ~9 MiB of cache but schedule.memory_budget is 1 MiB") == "memory budget"
    assert error_kind("duplicate id 'q1': an earlier row has the same id") == "bad id"
    assert error_kind("prompt column 'prompt' is null") == "bad prompt"
    assert error_kind("openai-batch: body.tools=[] is not supported") == "unsupported request"
    assert error_kind("device lost") == "engine" and error_kind(None) == "engine"


def test_report_on_run_with_errors_and_speculation(spec_run):
    out = read_output(spec_run.output.dir)
    files = write_report(spec_run.output.dir)
    st = files.stats
    report_dir = files.out_dir
    # numbers agree with the shards
    ok = [r for r in out if r["finish_reason"] != "error"]
    errs = [r for r in out if r["finish_reason"] == "error"]
    assert st.rows == len(out) == 14 and st.errors == len(errs) == 4
    assert st.completion_tokens == sum(r["completion_tokens"] for r in ok)
    assert st.drafted == sum(r["drafted_tokens"] for r in ok) > 0
    assert st.accepted == sum(r["accepted_tokens"] for r in ok) > 0, "the repeated prompt should accept drafts"
    assert st.by_depth == [sum(r["accepted_by_depth"][d] for r in ok if r["accepted_by_depth"]) for d in range(3)]
    assert st.verify_calls == sum(r["verify_calls"] for r in ok)
    # every decode round of a row is one forward on one path, drafting or not
    assert st.compiled_calls + st.eager_calls >= st.verify_calls
    assert st.tokens_per_verify == (st.accepted + st.verify_calls) / st.verify_calls
    assert sum(n for _, n in st.verify_histogram()) == st.verify_calls
    assert sum((k - 1) * n for k, n in st.verify_histogram()) == st.accepted
    assert dict(st.error_kinds) == {"bad prompt": 1, "too long for context": 1, "unreadable input row": 1,
                                    "bad id": 1}
    assert len(st.timeline) == 4 and st.active_seconds > 0

    # the page mentions the numbers, ids and errors
    d = Path(report_dir)
    page = (d / "index.html").read_text(encoding="utf-8")
    for text in [f"{st.acceptance_rate:.1%}", f"{st.tokens_per_verify:.2f}", f"{st.completion_tokens:,}",
                 f"{st.prompt_tokens:,}", f"{st.compiled_calls:,} compiled", "parity failures",
                 "too long for context", "unreadable input row", "null-prompt", "too-long",
                 "duplicate id &#x27;q1&#x27;", "14 of 14 expected", "complete"]:
        assert text in page, text
    slowest = max(ok, key=lambda r: r["decode_seconds"])
    assert f"<td>{slowest['id']}</td>" in page
    assert page.count("data:image/png;base64,") == 4  # self-contained

    # PNGs beside it are real images of a readable size
    for name in ("throughput", "acceptance_by_depth", "tokens_per_verify", "lengths"):
        size, w, h = png_size(d / f"{name}.png")
        assert size > 5000 and w > 300 and h > 200, (name, size, w, h)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["rows"] == 14 and summary["rows_errored"] == 4 and summary["rows_left"] == 0
    assert summary["accepted_by_depth"] == st.by_depth
    errors = [json.loads(line) for line in (d / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["id"] or "" for e in errors) == sorted(r["id"] or "" for r in errs)


def test_report_without_speculation_and_of_an_unfinished_run(tmp_path, model):
    data = write_jsonl(tmp_path / "in.jsonl", sample_rows(6))
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"},
                             output={"shard_rows": 2}))
    run_job(job, limit=4)
    files = write_report(job.output.dir, str(tmp_path / "rep"))
    page = open(files.index, encoding="utf-8").read()
    assert "No drafted tokens" in page and "2 rows left" in page and "4 of 6 expected" in page
    names = sorted(p.rsplit("/", 1)[1] for p in files.images)
    assert names == ["lengths.png", "throughput.png"]
    assert page.count("data:image/png;base64,") == 2


def test_report_cli(spec_run, tmp_path):
    r = CliRunner().invoke(main, ["report", spec_run.output.dir, "--out", str(tmp_path / "r"), "--top", "3"])
    assert r.exit_code == 0, r.output
    assert "report: " in r.stdout and "acceptance:" in r.stdout
    page = (tmp_path / "r" / "index.html").read_text()
    assert "Slowest rows (top 3" in page
    r = CliRunner().invoke(main, ["report", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not a run directory" in r.stderr
    r = CliRunner().invoke(main, ["report", "--help"])
    assert r.exit_code == 0 and "Examples:" in r.stdout and "index.html" in r.stdout


# ------------------------------------------------------------------ live progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_bars_show_tokens_acceptance_and_eta():
    stream, clock = io.StringIO(), Clock()
    p = Progress(total=10, initial=2, stream=stream, clock=clock, view=Bars)
    clock.t = 0.5
    p.engine_event("prefill", 200)
    for i in range(4):
        p.submitted((i, 0), 50)
        clock.t += 1.0
        p.finished({"row": i, "sample": 0, "finish_reason": "length", "prompt_tokens": 50, "completion_tokens": 20,
                    "drafted_tokens": 10, "accepted_tokens": 5, "verify_calls": 10})
    p.finished({"row": 4, "sample": 0, "finish_reason": "error", "prompt_tokens": 0, "completion_tokens": 0},
               via_engine=False)
    assert p.acceptance_rate == 0.5 and p.tokens_per_verify == 1.5
    # 3 rows left, one at a time, 1 s each as every row so far; the last one a half row's time behind
    assert p.eta_seconds() == pytest.approx(3 + 0.5)
    assert re.search(r"\d+\.\d tok/s, acc 50%, 1\.50 tok/verify, 1 err, ETA 4s", p.view.postfix()), p.view.postfix()
    p.close()
    text = stream.getvalue()
    assert "prefill" in text and "decode" in text and "prompt tok/s" in text and "acc 50%" in text


def test_quiet_and_non_terminal_show_no_bars():
    stream = io.StringIO()
    for view in (None, terminal_bars):  # bars on a stream that is not a terminal: nothing either
        p = Progress(total=3, stream=stream, view=view)
        p.finished({"finish_reason": "stop", "completion_tokens": 3})
        p.close()
    assert stream.getvalue() == ""


class SlowEngine:
    """The real engine, pausing between results so a progress tick falls inside the run."""

    def __init__(self, engine, pause):
        self.engine, self.pause = engine, pause
        self.tokenizer, self.max_context = engine.tokenizer, engine.max_context

    def generate(self, requests):
        import time

        for result in self.engine.generate(requests):
            time.sleep(self.pause)
            yield result


def test_log_json_events(tmp_path, model, capsys):
    from mtplx.generation import Engine

    data = write_jsonl(tmp_path / "in.jsonl", lines_with_errors())
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"},
                             speculative={"method": "ngram"}, output={"shard_rows": 5}))
    engine = SlowEngine(Engine.load(model, job.speculative, job.schedule), 0.05)
    capsys.readouterr()
    summary = run_job(job, engine=engine, log_json=True, log_every=0.1)
    err = capsys.readouterr().err
    events = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "summary"
    assert "log" not in kinds
    assert kinds.count("shard") == summary.shards == 3
    assert "progress" in kinds
    prog = [e for e in events if e["event"] == "progress"][-1]
    assert {"rows_done", "rows_total", "completion_tokens", "tokens_per_second", "acceptance_rate",
            "eta_seconds"} <= set(prog)
    final = events[-1]
    assert final["status"] == "done" and final["outputs"] == 14 and final["errors"] == 4
    assert all("time" in e and "ts" in e for e in events)
    shards = [e for e in events if e["event"] == "shard"]
    assert shards[-1]["rows_committed"] == 14 and sum(e["rows"] for e in shards) == 14


def test_cli_log_json_and_quiet(tmp_path, model):
    data = write_jsonl(tmp_path / "in.jsonl", sample_rows(4))
    jobfile = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run", fmt="jsonl",
                                                       input={"chat_template": "off"}))
    r = CliRunner().invoke(main, ["run", str(jobfile), "--log-json", "--log-every", "0"])
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stderr.splitlines()]
    assert [e["event"] for e in events if e["event"] != "log"] == ["start", "startup", "shard", "summary"]
    assert events[-1]["status"] == "done" and events[-1]["outputs"] == 4
    # nothing left to do, and --quiet: no output at all
    r = CliRunner().invoke(main, ["resume", str(tmp_path / "run"), "--quiet"])
    assert r.exit_code == 0 and r.output == ""
    # a refused job is a JSON error line with the exit code
    bad = write_job(tmp_path / "bad.yaml", job_dict(model, data, tmp_path / "run", fmt="jsonl",
                                                   generation={"max_tokens": 0}))
    r = CliRunner().invoke(main, ["run", str(bad), "--log-json"])
    assert r.exit_code == 2
    (err,) = [json.loads(line) for line in r.stderr.splitlines()]
    assert err["event"] == "error" and err["exit_code"] == 2 and "generation.max_tokens" in err["message"]
