"""The CLI: exit codes, refusals before weights load, status, resume, and SIGKILL-then-resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, records, sample_rows, write_job, write_parquet
from pipelines.cli.commands import main
from pipelines.errors import JobError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def job_file(tmp_path, llama):
    data = write_parquet(tmp_path / "in.parquet", sample_rows())
    return write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run"))


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_help_teaches_with_examples():
    for args in ([], ["run"], ["validate"], ["status"], ["resume"]):
        out = cli(*args, "--help")
        assert out.exit_code == 0 and "Example" in out.output, args
    assert "--set" in cli("run", "--help").output and "Exit codes" in cli("--help").output


def test_the_set_examples_in_help_work_as_shown(job_file):
    """Every `--set 'generation.stop=...'` that `run --help` shows, split as a shell splits it,
    gives the stop string it says (a newline, not a backslash and an n)."""
    import shlex

    from pipelines.job.config import load_job

    shown = [line for line in cli("run", "--help").output.splitlines() if "generation.stop=" in line]
    assert len(shown) >= 2
    for line in shown:
        value = next(w for w in shlex.split(line.split("#")[0], posix=True) if w.startswith("generation.stop="))
        stop = load_job(job_file, [value]).generation.stop
        assert stop and all("\\" not in s and "\n" in s for s in stop), (line, stop)
    assert load_job(job_file, [shlex.split("generation.stop=['\\n']")[0]]).generation.stop == ["\\n"]  # as help warns


def test_ctrl_c_exits_130_and_commits_finished_rows(tmp_path, job_file, monkeypatch):
    monkeypatch.setenv("MTPLX_FAULT_POINT", "row.emitted:6:int")  # a real SIGINT after the 6th finished row
    out = cli("run", job_file)
    assert out.exit_code == 130 and "interrupted: finished rows are committed" in out.output, out.output
    assert len(read_output(tmp_path / "run")) >= 5  # the first shard (5 rows), at least
    monkeypatch.delenv("MTPLX_FAULT_POINT")


def test_ctrl_c_exits_130_in_every_command(tmp_path):
    """`validate` blocked reading its job file (a FIFO) gets a real SIGINT: 130, not click's 'Aborted!' and 1."""
    import threading

    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)

    def interrupt():
        with open(fifo, "w"):  # returns once the command has opened the file to read it
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt)
    thread.start()
    out = cli("validate", fifo)
    thread.join()
    assert out.exit_code == 130 and "interrupted" in out.output and "Aborted" not in out.output, out.output


def test_malformed_job_refused_before_model_load(tmp_path, job_file, no_weights):
    text = job_file.read_text().replace("max_tokens: 8", "max_tokens: lots")
    job_file.write_text(text)
    out = cli("run", job_file)
    assert out.exit_code == 2
    assert "generation.max_tokens: expected an integer >= 1, got 'lots'" in out.output
    assert not (tmp_path / "run").exists()
    out = cli("run", tmp_path / "missing.yaml")
    assert out.exit_code == 2 and "cannot read" in out.output


def test_unreadable_input_refused_before_model_load(tmp_path, job_file, no_weights):
    out = cli("run", job_file, "--set", f"input.path={tmp_path}/nothing-*.parquet")
    assert out.exit_code == 2 and "matched no parquet files" in out.output


@pytest.fixture(scope="module")
def llama_head(llama, tmp_path_factory):
    from mtplx.models.loading import load
    from tiny_models import untrained_head

    return untrained_head(load(llama), tmp_path_factory.mktemp("head") / "head")


def _foreign_head(path: Path) -> Path:
    path.mkdir()
    (path / "mtp_head.json").write_text(json.dumps({"trunk": {"model_type": "qwen3", "hidden_size": 64}}))
    (path / "mtp_head.safetensors").write_bytes(b"")
    return path


def _with_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def _without_chat_template(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def _with_swapped_tokens(src: Path, dst: Path) -> Path:
    """A copy of a model whose tokenizer has the same size but two tokens' ids swapped."""
    import shutil

    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def test_what_cannot_work_is_refused_before_the_model_loads(tmp_path, job_file, llama, tiny_model, no_weights,
                                                          monkeypatch):
    """Each of these used to load the model and fail with a traceback and exit 1 ("run the same
    command again"); `run` and `validate` refuse them with exit 2, naming the key, and a relative
    path names the directory it was looked up in."""
    monkeypatch.chdir(tmp_path)
    cases = [
        (["speculative.method=mtp", "speculative.mtp_head=heads/none"],
         f"speculative.mtp_head: 'heads/none' (relative to the working directory {tmp_path}"),
        (["speculative.method=mtp", f"speculative.mtp_head={tmp_path}"],
         "has no mtp_head.json and no mtp_head.safetensors"),
        (["speculative.method=mtp", f"speculative.mtp_head={_foreign_head(tmp_path / 'foreign')}"],
         "speculative.mtp_head: MTP head was trained for a different trunk (model_type: head 'qwen3' vs model 'llama'"),
        (["speculative.method=mtp"], "speculative.method: mtp: model"),  # no head of its own, none given
        (["speculative.method=draft", "speculative.draft_model=drafts/none"],
         f"speculative.draft_model: 'drafts/none' (relative to the working directory {tmp_path}"),
        (["speculative.method=draft", f"speculative.draft_model={tiny_model('llama', vocab_size=2048)}"],
         "speculative.draft_model: draft model"),
        (["speculative.method=draft", f"speculative.draft_model={_with_swapped_tokens(llama, tmp_path / 'swapped')}"],
         "has a different tokenizer: 2 of its"),  # one size, other tokens
        ([f"model.path={_with_config(llama, tmp_path / 'odd', model_type='no_such_arch')}"],
         "model.path: " + str(tmp_path / "odd") + ": Model type no_such_arch not supported"),
        (["schedule.calibration=profiles/none.json"],
         f"schedule.calibration: '{tmp_path}/profiles/none.json' does not exist"),
        ([f"model.path={_without_chat_template(llama, tmp_path / 'plain')}", "input.chat_template=on"],
         "input.chat_template: on, but the model's tokenizer has no chat template"),
    ]
    for overrides, message in cases:
        args = [a for o in overrides for a in ("--set", o)]
        for command in ("run", "validate"):
            out = cli(command, job_file, *args)
            assert out.exit_code == 2, (command, overrides, out.output)
            assert message in out.output and "Traceback" not in out.output, (command, out.output)
        assert not (tmp_path / "run").exists(), overrides


def test_a_head_or_draft_model_that_fits_passes_and_relative_paths_resolve(tmp_path, job_file, llama, llama_head,
                                                                           tiny_model, no_weights, monkeypatch):
    import shutil

    shutil.copytree(llama_head, tmp_path / "heads" / "mine")
    monkeypatch.chdir(tmp_path)
    out = cli("validate", job_file, "--set", "speculative.method=mtp", "--set", "speculative.mtp_head=heads/mine")
    assert out.exit_code == 0, out.output
    from pipelines.job.config import load_job

    job = load_job(job_file, ["speculative.mtp_head=heads/mine", f"speculative.draft_model={llama}"])
    assert job.speculative.mtp_head == str(tmp_path / "heads" / "mine")  # pinned: resume works from anywhere
    out = cli("validate", job_file, "--set", "speculative.method=draft",
              "--set", f"speculative.draft_model={tiny_model('llama', seed=1)}")
    assert out.exit_code == 0, out.output


def test_validate_exit_codes(tmp_path, job_file, no_weights):
    out = cli("validate", job_file)
    assert out.exit_code == 0, out.output
    assert "12 ready, 0 would be error rows" in out.output and "at most 96 tokens to generate" in out.output
    rows = sample_rows(3) + [{"id": "q0", "prompt": "again", "topic": "x", "weight": 1.0},
                             {"id": "z", "prompt": "", "topic": "x", "weight": 1.0}]
    write_parquet(tmp_path / "in.parquet", rows)
    out = cli("validate", job_file)
    assert out.exit_code == 1
    assert "duplicate id 'q0'" in out.output and "prompt is empty" in out.output and "PROBLEMS" in out.output
    out = cli("validate", job_file, "--set", "schedule.order=fastest")
    assert out.exit_code == 2 and "schedule.order" in out.output


def test_validate_reports_what_run_would_do_with_the_output_dir(tmp_path, job_file):
    assert "a new run" in cli("validate", job_file).output
    assert cli("run", job_file, "--limit", "3", "-q").exit_code == 0
    out = cli("validate", job_file)
    assert out.exit_code == 0 and "run would resume (3 output rows already committed)" in out.output
    out = cli("validate", job_file, "--set", "generation.temperature=0.5")
    assert out.exit_code == 2 and "changed: generation.temperature" in out.output


def test_run_status_resume_and_refusals(tmp_path, job_file):
    out = cli("run", job_file)
    assert out.exit_code == 0, out.output
    assert "12 rows written" in out.output
    out = cli("status", tmp_path / "run")
    assert out.exit_code == 0 and "12 done, 0 errored, 0 left" in out.output and "COMPLETE" in out.output
    st = json.loads(cli("status", tmp_path / "run", "--json").output)
    assert st["rows_done"] == 12 and st["completion_tokens"] > 0 and st["eta_seconds"] == 0
    # same job again: nothing to do
    assert "0 rows written" in cli("run", job_file).output
    # an output-changing setting is refused, naming the key; --restart starts over
    out = cli("run", job_file, "--set", "generation.max_tokens=4")
    assert out.exit_code == 2 and "changed: generation.max_tokens" in out.output
    out = cli("run", job_file, "--set", "generation.max_tokens=4", "--restart")
    assert out.exit_code == 0 and "moved the previous run" in out.output
    assert all(r["completion_tokens"] <= 4 for r in read_output(tmp_path / "run"))
    # a speed-only setting may change between resumes
    assert cli("run", job_file, "--set", "generation.max_tokens=4", "--set", "schedule.order=input").exit_code == 0
    # resume uses the stored job, from any directory
    os.chdir(tmp_path / "run" / "shards")
    out = cli("resume", tmp_path / "run")
    assert out.exit_code == 0 and "0 rows written" in out.output
    assert cli("status", tmp_path).exit_code == 2
    assert cli("resume", tmp_path).exit_code == 2


def test_sampled_resume_refuses_changed_speculative_settings(tmp_path, job_file):
    """Sampled text depends on the speculative method and depth (they consume the row's draws
    differently): resuming a sampled job under other settings is refused, naming the key; a
    greedy job may change them (its text is the same under all of them)."""
    sampled = ["--set", "generation.temperature=0.8", "--set", "speculative.method=ngram"]
    assert cli("run", job_file, *sampled, "--limit", "4", "-q").exit_code == 0
    for change, key in (("speculative.depth=2", "speculative.depth"), ("speculative.method=none", "speculative.method"),
                        ("speculative.ngram_size=2", "speculative.ngram_size")):
        out = cli("run", job_file, *sampled, "--set", change)
        assert out.exit_code == 2 and key in out.output and "random draws" in out.output, out.output
        out = cli("validate", job_file, *sampled, "--set", change)
        assert out.exit_code == 2 and key in out.output and "random draws" in out.output, out.output
    assert cli("run", job_file, *sampled, "--set", "schedule.max_batch=2").exit_code == 0  # speed only
    out = cli("run", job_file, *sampled, "--set", "speculative.depth=2", "--restart")
    assert out.exit_code == 0 and "moved the previous run" in out.output
    greedy = tmp_path / "greedy"
    assert cli("run", job_file, "--set", f"output.dir={greedy}", "--limit", "4", "-q").exit_code == 0
    out = cli("run", job_file, "--set", f"output.dir={greedy}", "--set", "speculative.method=ngram")
    assert out.exit_code == 0, out.output


def test_error_rows_are_counted_and_a_run_of_only_errors_fails(tmp_path, llama):
    rows = sample_rows(4)
    rows[2]["prompt"] = None
    some = write_job(tmp_path / "some.yaml", job_dict(llama, write_parquet(tmp_path / "some.parquet", rows),
                                                      tmp_path / "some"))
    out = cli("run", some)
    assert out.exit_code == 0 and "4 rows written (error rows: 1)" in out.output, out.output
    assert "3 done, 1 errored, 0 left" in cli("status", tmp_path / "some").output
    bad = write_parquet(tmp_path / "bad.parquet", [{**r, "prompt": None} for r in rows])
    job = write_job(tmp_path / "bad.yaml", job_dict(llama, bad, tmp_path / "bad"))
    out = cli("run", job)
    assert out.exit_code == 1 and "every one of the 4 output rows is an error row (row 0: " in out.output
    assert "FAILED: every row is an error row" in cli("status", tmp_path / "bad").output


def test_partial_run_status_shows_rows_left(tmp_path, job_file):
    assert cli("run", job_file, "--limit", "5", "-q").exit_code == 0
    st = json.loads(cli("status", tmp_path / "run", "--json").output)
    assert st["rows_done"] == 5 and st["rows_left"] == 7 and st["eta_seconds"] is not None


# ------------------------------------------------------------------ kill -9, then resume


def _start(job_file):
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(job_file), "-q"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _shards(run_dir):
    try:
        return len(records(run_dir))
    except JobError:  # not started yet
        return 0


def _kill_when(proc, condition, timeout=60.0):
    """SIGKILL `proc` as soon as `condition()` holds; False if it finished first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    proc.kill()
    raise AssertionError("condition never held")


KEY_COLUMNS = ("id", "row", "sample", "completion", "finish_reason", "error", "seed")


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume_matches_uninterrupted(tmp_path, llama):
    rows = sample_rows(30)
    rows[7]["prompt"] = None  # an error row must also come out exactly once
    data = write_parquet(tmp_path / "in.parquet", rows)
    settings = dict(generation={"max_tokens": 12, "n": 2, "temperature": 0.7, "seed": 3},
                    output={"shard_rows": 3, "keep_columns": ["topic"]})
    ref_job = write_job(tmp_path / "ref.yaml", job_dict(llama, data, tmp_path / "ref", **settings))
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run", **settings))
    assert cli("run", ref_job, "-q").exit_code == 0  # the uninterrupted reference, in-process
    expected = [{k: r[k] for k in KEY_COLUMNS + ("topic",)} for r in read_output(tmp_path / "ref")]
    assert len(expected) == 60

    run_dir = tmp_path / "run"
    shard_dir = run_dir / "shards"
    points = [
        lambda: (run_dir / "manifest.json").exists(),  # started, nothing generated yet
        lambda: _shards(run_dir) >= 1,  # right after a commit
        lambda: shard_dir.exists() and any(p.name.endswith(".tmp") for p in shard_dir.iterdir()),  # mid-write
        lambda: _shards(run_dir) >= 8,
    ]
    kills = 0
    for point in points:
        if _kill_when(_start(job), point):
            kills += 1
            print("killed at", _shards(run_dir), "shards")
    assert kills >= 3  # the run is slow enough that most kill points land
    final = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(job), "-q"], cwd=REPO,
                           capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    got = [{k: r[k] for k in KEY_COLUMNS + ("topic",)} for r in read_output(run_dir)]
    assert got == expected
    assert not any(p.name.endswith(".tmp") for p in shard_dir.iterdir())
    recorded = {Path(e["file"]).name for e in records(run_dir)}
    assert recorded == {p.name for p in shard_dir.iterdir()}


@pytest.mark.slow
def test_sigterm_commits_finished_rows_and_exits_130(tmp_path, llama):
    data = write_parquet(tmp_path / "in.parquet", sample_rows(30))
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run", generation={"max_tokens": 12},
                                                    output={"shard_rows": 1000}))
    # SIGTERM from inside, right after the 10th finished row (pipelines/io/faults.py): a signal sent
    # after a sleep lands anywhere from model loading to interpreter shutdown, depending on the
    # machine. Random-time external SIGTERMs are in tests/test_reliability.py.
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(job), "-q"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "MTPLX_FAULT_POINT": "row.emitted:10:term"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and b"interrupted" in err, err
    done = read_output(tmp_path / "run")
    assert len(done) >= 10  # the rows finished before the signal are committed
    final = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(job), "-q"], cwd=REPO)
    assert final.returncode == 0
    assert [r["row"] for r in read_output(tmp_path / "run")] == list(range(30)) and len(done) < 30


def test_a_run_records_the_compiled_verify_figures(tmp_path, llama):
    """The bank's capture backend, growth budget and prompt tokens restored from shared prefixes
    are in the run's manifest; the restored count is the output rows' cached_prompt_tokens."""
    common = "the same long instruction that every row of this job starts with, word for word. " * 2
    rows = [{"id": f"r{i}", "prompt": common + tail} for i, tail in enumerate(["one", "two two", "three", "four"])]
    data = write_parquet(tmp_path / "in.parquet", rows)
    job = job_dict(llama, data, tmp_path / "run", speculative={"method": "ngram", "compiled_verify": "on"},
                   generation={"max_tokens": 5})
    res = cli("run", write_job(tmp_path / "job.yaml", job), "-q")
    assert res.exit_code == 0, res.output
    figures = json.loads((tmp_path / "run" / "manifest.json").read_text())["compiled_verify"]
    out = read_output(tmp_path / "run")
    restored = sum(r["cached_prompt_tokens"] for r in out)
    assert restored > 0 and figures["restored_tokens"] == restored, figures
    assert figures["capture_backend"] is None
    assert figures["request_max_tokens"] == max(r["prompt_tokens"] for r in out) + 5
