"""`mtplx-batch`: run, resume, inspect and validate batch generation jobs.

Exit codes: 0 success, 1 the run failed, 2 the job is invalid or a resume was refused, 130
interrupted (Ctrl-C, or SIGTERM for run and resume; finished rows are committed).
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import click

from ..errors import JobError, RunError
from .interrupt import INTERRUPTED, Group, stop_on_sigterm

EPILOG_RUN = """\b
Examples:
  mtplx-batch run jobs/eval.yaml
  mtplx-batch run jobs/eval.yaml --set generation.max_tokens=64 --set schedule.order=length
  mtplx-batch run jobs/eval.yaml --set 'generation.stop=["\\n\\n"]'   # stop at a blank line
  mtplx-batch run jobs/eval.yaml --set input.chat_template=off   # prompts as they are, no chat template
  mtplx-batch run jobs/eval.yaml --limit 20          # try the first 20 input rows
  mtplx-batch run jobs/eval.yaml --restart           # move the old run aside, start over
  mtplx-batch run jobs/eval.yaml --log-json 2>>run.log   # for cron: JSON lines, no bars

\b
--set values are YAML: 'generation.stop=["\\n"]' (double quotes) is a newline, while ['\\n'] or
an unquoted \\n is a backslash and an n.

\b
Running the same job again continues where it stopped: rows already in committed shards are
skipped. Changing anything that alters the output (model, generation settings, prompt
settings, input files) is refused with the changed keys named, unless --restart.
Speed settings (speculative, schedule, executor) may change between resumes.

\b
Progress: on a terminal, two bars: "prefill" (rows handed to the engine, prompt tok/s while
prefilling) and "decode" (rows finished, generated tok/s since generation began, draft
acceptance, tokens per verify, and an ETA from how long rows take, rows in flight counted).
The last tok/s is the summary's and `status`'s. --quiet shows nothing but errors.
Ctrl-C (or SIGTERM) commits the finished rows and exits 130.
--log-json writes one JSON object per line to stderr instead: start, log, startup
(seconds by phase, once the first token is out), shard (each commit), progress (every --log-every seconds),
summary (status done|interrupted|failed), error.
"""

EPILOG_GROUP = """\b
Examples:
  mtplx-batch validate jobs/eval.yaml     # check the job and its input without loading weights
  mtplx-batch run jobs/eval.yaml          # generate; Ctrl-C and run again to continue
  mtplx-batch status runs/eval            # rows done / errored / left, throughput, ETA
  mtplx-batch resume runs/eval            # continue from the job copy stored in the run dir
  mtplx-batch report runs/eval --open     # HTML report: summary, acceptance, throughput, errors
  mtplx-batch export runs/eval --format hf --out eval-ds    # a `datasets`-loadable directory

\b
A job file (YAML) names the model, the input and the output directory:
  name: eval
  model: {path: models/demo}
  input: {format: parquet, path: data/eval.parquet, id_column: id, prompt_column: prompt}
  generation: {max_tokens: 256, temperature: 0.0}
  output: {dir: runs/eval}

\b
OpenAI Batch API request files run as they are, with per-request max_tokens, temperature,
top_p, stop and seed; custom_id is the row id:
  input: {format: openai-batch, path: batch_requests.jsonl}
  then: mtplx-batch export runs/NAME --format openai-batch --out results.jsonl

\b
Exit codes: 0 success, 1 the run failed, 2 invalid job or refused resume, 130 interrupted
(Ctrl-C; SIGTERM too for run and resume, which commit the finished rows first).
"""


def _fail(err: Exception, as_json: bool = False) -> None:
    code = getattr(err, "exit_code", 1)
    if as_json:
        from ..execution.progress import json_line

        json_line("error", message=str(err), exit_code=code)
    else:
        click.echo(f"error: {err}", err=True)
    sys.exit(code)


def _blas_notice(log_json: bool, quiet: bool) -> None:
    """One line when MLX's CPU matmuls would run on the slow bundled BLAS (mtplx/blas.py)."""
    from mtplx.blas import slow_blas_notice

    note = slow_blas_notice()
    if note is None or quiet:
        return
    if log_json:
        from ..execution.progress import json_line

        json_line("log", message=note)
    else:
        click.echo(note, err=True)


def _run(job, restart: bool, limit: Optional[int], quiet: bool, log_json: bool = False,
         log_every: float = 30.0) -> None:
    from ..execution.session import run_job
    from .progress import terminal_bars

    stop_on_sigterm()  # finished rows get committed, as on Ctrl-C
    if log_json:
        log = None  # the runner writes {"event": "log"} lines
    else:
        log = None if quiet else lambda m: click.echo(m, err=True)
    _blas_notice(log_json, quiet)
    try:
        summary = run_job(job, restart=restart, limit=limit, quiet=quiet or log_json, log=log,
                          log_json=log_json, log_every=log_every, bars=terminal_bars)
    except (JobError, RunError) as e:
        _fail(e, log_json)
    except KeyboardInterrupt:
        msg = (f"interrupted: finished rows are committed to {job.output.dir}; run the same command again, "
               f"or `mtplx-batch resume {job.output.dir}`, to continue")
        if log_json:
            from ..execution.progress import json_line

            json_line("error", message=msg, exit_code=INTERRUPTED)
        else:
            click.echo(msg, err=True)
        sys.exit(INTERRUPTED)
    except Exception as e:  # an engine or I/O failure: say so plainly, keep the traceback for a bug report
        import traceback

        from mtplx.cache import UnsupportedArchitecture

        if isinstance(e, UnsupportedArchitecture):  # refused before any row ran: nothing to resume
            _fail(e, log_json)

        msg = (f"the run failed: {type(e).__name__}: {e}. Committed shards are kept; "
               "run the same command again to continue")
        if log_json:
            from ..execution.progress import json_line

            json_line("error", message=msg, exit_code=1, traceback=traceback.format_exc())
        else:
            traceback.print_exc()
            click.echo(f"error: {msg}", err=True)
        sys.exit(1)
    if not quiet and not log_json:
        click.echo(
            f"done: {summary.outputs} rows written (error rows: {summary.errors}), {summary.skipped} already done, "
            f"{summary.completion_tokens} tokens in {summary.seconds:.1f}s "
            f"({summary.tokens_per_second:.1f} tok/s), peak memory {summary.peak_rss_bytes / 1e9:.2f} GB "
            f"-> {summary.run_dir}",
            err=True,
        )


@click.group(cls=Group, epilog=EPILOG_GROUP, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Batch offline LLM generation on MLX, resumable, with speculative decoding.

    A job reads prompts from a dataset, generates completions, and writes Parquet shards
    to its run directory (output.dir). See `mtplx-batch COMMAND --help`.
    """
    from mtplx.process import prepare_process

    prepare_process()  # before anything imports mlx.core (mtplx/process.py)


@main.command(epilog=EPILOG_RUN)
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a job setting; the value is read as YAML, so quote it for the shell and write "
                   "escapes in YAML's double quotes: --set 'generation.stop=[\"\\n\\n\"]' stops at a blank line. "
                   "Repeatable.")
@click.option("--restart", is_flag=True, help="Move an existing run in output.dir aside and start over.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
              help="Run in this process (local) or as a Ray Data pipeline (ray, see docs/ray.md); "
                   "overrides the job's executor.type.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Only the first N input rows (a later run without --limit continues with the rest).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or messages; errors only.")
@click.option("--log-json", is_flag=True,
              help="For cron and log collectors: one JSON object per line on stderr (start, shard commits, "
                   "progress, summary, error) instead of bars and text.")
@click.option("--log-every", type=click.FloatRange(min=0), default=30.0, show_default=True, metavar="SECONDS",
              help="With --log-json: seconds between progress lines (0: none).")
def run(job_file: str, overrides: Sequence[str], restart: bool, limit: Optional[int], quiet: bool,
        log_json: bool, log_every: float, executor: Optional[str] = None):
    """Run JOB_FILE, or continue its earlier run in output.dir."""
    from ..job.config import load_job

    if executor:
        overrides = (*overrides, f"executor.type={executor}")
    try:
        job = load_job(job_file, overrides)
    except JobError as e:
        _fail(e, log_json)
    _run(job, restart, limit, quiet, log_json, log_every)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or messages; errors only.")
@click.option("--log-json", is_flag=True, help="One JSON object per line on stderr, as for `run`.")
@click.option("--log-every", type=click.FloatRange(min=0), default=30.0, show_default=True, metavar="SECONDS",
              help="With --log-json: seconds between progress lines (0: none).")
def resume(run_dir: str, quiet: bool, log_json: bool, log_every: float):
    """Continue the run in RUN_DIR from the job copy stored there (RUN_DIR/job.yaml).

    \b
    Examples:
      mtplx-batch resume runs/eval
      mtplx-batch resume runs/eval --log-json --log-every 60 2>>runs/eval.log   # from cron
    """
    from ..io.records import JOB_FILE
    from ..job.config import load_job

    path = os.path.join(run_dir, JOB_FILE)
    if not os.path.exists(path):
        _fail(JobError(f"{run_dir}: no {JOB_FILE}; not a run directory (start one with: mtplx-batch run JOB.yaml)"),
              log_json)
    try:
        job = load_job(path)
    except JobError as e:
        _fail(e, log_json)
    if os.path.abspath(job.output.dir) != os.path.abspath(run_dir):
        job.output.dir = os.path.abspath(run_dir)  # the directory was moved: follow it
    _run(job, False, None, quiet, log_json, log_every)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as one JSON object.")
def status(run_dir: str, as_json: bool):
    """Rows done / errored / left, tokens, acceptance, throughput and ETA of RUN_DIR.

    \b
    Example:
      mtplx-batch status runs/eval
    """
    from .status import format_status, run_status

    try:
        st = run_status(run_dir)
    except JobError as e:
        _fail(e)
    if as_json:
        import json

        click.echo(json.dumps(st, indent=1))
    else:
        click.echo(format_status(st))


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="As for `run`.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only check the first N rows.")
def validate(job_file: str, overrides: Sequence[str], limit: Optional[int]):
    """Check JOB_FILE without loading model weights.

    Checks the job's keys and values, that the input is readable and has the columns the job
    reads, id uniqueness, every prompt (rendered and tokenized) against the model's context,
    whether output.dir can be started or resumed, and estimates the work. Exit 0 when every
    row can run, 1 when some rows would become error rows (they are listed), 2 when the job
    is invalid or its output directory would be refused.

    \b
    Example:
      mtplx-batch validate jobs/eval.yaml --set input.path=data/other.parquet
    """
    from ..job.config import load_job
    from .validate import format_report, validate_job

    try:
        job = load_job(job_file, overrides)
        report = validate_job(job, limit=limit)
    except (JobError, RunError) as e:
        _fail(e)
    click.echo(format_report(report))
    sys.exit(2 if report.refused else 0 if report.ok else 1)


EPILOG_REPORT = """\b
Examples:
  mtplx-batch report runs/eval                 # writes runs/eval/report/index.html
  mtplx-batch report runs/eval --open          # ... and opens it in the browser
  mtplx-batch report runs/eval --out /tmp/eval-report --top 50

\b
Files written to the report directory:
  index.html               the report (plots embedded; the file can be mailed or moved alone)
  summary.json             every number in the report, for scripts
  errors.jsonl             all errored rows: id, row, sample, kind, error
  throughput.png           generated tok/s per interval (RUN_DIR/progress.jsonl) and rows committed, over time
  acceptance_by_depth.png  draft acceptance at each depth     (runs with speculation)
  tokens_per_verify.png    histogram of tokens per verify     (runs with speculation)
  lengths.png              prompt and completion lengths

\b
It works on a run in progress too: only committed shards are read.
"""


@main.command(epilog=EPILOG_REPORT)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the report files [default: RUN_DIR/report].")
@click.option("--open", "open_browser", is_flag=True, help="Open index.html in the default browser afterwards.")
@click.option("--top", type=click.IntRange(min=1), default=20, show_default=True,
              help="How many of the slowest rows to list.")
def report(run_dir: str, out_dir: Optional[str], open_browser: bool, top: int):
    """Write an HTML report of RUN_DIR: run summary, errors by kind, speculative health
    (acceptance by depth, tokens per verify, compiled vs eager verifies, parity failures),
    throughput over time, the slowest rows and the errored rows."""
    from .report import text_summary, write_report

    try:
        files = write_report(run_dir, out_dir, top=top)
    except JobError as e:
        _fail(e)
    click.echo(text_summary(files.stats))
    click.echo(f"report: {files.index}")
    if open_browser:
        import pathlib
        import webbrowser

        if not webbrowser.open(pathlib.Path(files.index).as_uri()):
            click.echo("could not open a browser here; open the file above yourself", err=True)


EPILOG_EXPORT = """\b
Examples:
  mtplx-batch export runs/eval --format jsonl      # -> runs/eval/export/results.jsonl
  mtplx-batch export runs/eval --format jsonl --out eval.jsonl
  mtplx-batch export runs/batch --format openai-batch --out results.jsonl
        # also writes results_errors.jsonl (failed rows); choose it with --errors-out
  mtplx-batch export runs/eval --format hf --out eval-dataset
        # then: datasets.load_dataset("eval-dataset", split="train")

\b
Formats:
  jsonl         one JSON object per output row, every column, errors included
  openai-batch  OpenAI Batch API output lines {id, custom_id, response: {status_code, body:
                {choices: [{message, finish_reason}], usage}}, error} for the rows that
                succeeded, and an error file with one line per failed row (always written)
  hf            a directory of parquet files (data/train-*.parquet) and a README.md dataset
                card (model, job settings, counts, acceptance), loadable with
                datasets.load_dataset(DIR) and ready for the Hugging Face Hub

\b
Rows come out in input order. A run in progress exports what is committed so far, and the
command says how many rows are still missing. An existing --out is refused unless --overwrite
(the default paths under RUN_DIR/export/ are replaced).
"""


@main.command(epilog=EPILOG_EXPORT)
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["openai-batch", "jsonl", "hf"]), required=True,
              help="Output format (see below).")
@click.option("--out", default=None, type=click.Path(),
              help="Output file (jsonl, openai-batch) or directory (hf) [default: RUN_DIR/export/results.jsonl, "
                   "RUN_DIR/export/openai-batch.jsonl, RUN_DIR/export/hf; replaced on each export].")
@click.option("--errors-out", type=click.Path(dir_okay=False), default=None,
              help="openai-batch: file for failed rows [default: OUT with _errors before the extension].")
@click.option("--overwrite", is_flag=True, help="Replace --out (and --errors-out) if they exist.")
def export(run_dir: str, fmt: str, out: Optional[str], errors_out: Optional[str], overwrite: bool):
    """Write the committed output of RUN_DIR as OpenAI Batch results, JSONL, or a Hugging Face dataset."""
    from ..io.export import export_run

    if errors_out is not None and fmt != "openai-batch":
        _fail(JobError("--errors-out only applies to --format openai-batch"))
    try:
        res = export_run(run_dir, fmt, out, errors_out=errors_out, overwrite=overwrite)
    except JobError as e:
        _fail(e)
    out = res.files[0] if fmt != "hf" else os.path.dirname(res.files[-1])  # the path written (--out or default)
    if fmt == "openai-batch":
        click.echo(f"exported {res.written} responses and {res.failed} failed requests "
                   f"({res.rows} output rows) -> {res.files[0]}, errors -> {res.files[1]}")
    else:
        where = out if fmt == "jsonl" else f"{out} ({len(res.files) - 1} parquet file(s) + README.md)"
        click.echo(f"exported {res.rows} rows -> {where}")
    if res.left:
        click.echo(f"note: the run is not complete: {res.left} of {res.expected} output rows are not generated "
                   f"yet (continue it with: mtplx-batch resume {run_dir}, then export again)", err=True)


def _register_extra_commands():
    from .assets import convert, fetch
    from .calibrate import calibrate
    from .train_head import train_head

    for command in (fetch, convert, train_head, calibrate):
        main.add_command(command)


_register_extra_commands()

def entry():
    """The `mtplx-batch` console script."""
    main(prog_name="mtplx-batch")


if __name__ == "__main__":
    main(prog_name="mtplx-batch")
