"""`mtplx-batch`: run, resume, inspect and validate batch generation jobs.

Exit codes: 0 success, 1 the run failed, 2 the job is invalid or a resume was refused.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional, Sequence

import click

from .errors import JobError, RunError

EPILOG_RUN = """\b
Examples:
  mtplx-batch run jobs/eval.yaml
  mtplx-batch run jobs/eval.yaml --set generation.max_tokens=64 --set schedule.order=length
  mtplx-batch run jobs/eval.yaml --limit 20          # try the first 20 input rows
  mtplx-batch run jobs/eval.yaml --restart           # move the old run aside, start over

\b
Running the same job again continues where it stopped: rows already in committed shards are
skipped. Changing anything that alters the output (model, generation settings, prompt
settings, input files) is refused with the changed keys named, unless --restart.
Speed settings (speculative, schedule, executor) may change between resumes.
"""

EPILOG_GROUP = """\b
Examples:
  mtplx-batch validate jobs/eval.yaml     # check the job and its input without loading weights
  mtplx-batch run jobs/eval.yaml          # generate; Ctrl-C and run again to continue
  mtplx-batch status runs/eval            # rows done / errored / left, throughput, ETA
  mtplx-batch resume runs/eval            # continue from the job copy stored in the run dir

\b
A job file (YAML) names the model, the input and the output directory:
  name: eval
  model: {path: models/demo}
  input: {format: parquet, path: data/eval.parquet, id_column: id, prompt_column: prompt}
  generation: {max_tokens: 256, temperature: 0.0}
  output: {dir: runs/eval}

\b
Exit codes: 0 success, 1 the run failed, 2 invalid job or refused resume.
"""


def _fail(err: Exception) -> None:
    click.echo(f"error: {err}", err=True)
    sys.exit(getattr(err, "exit_code", 1))


def _terminate_as_interrupt(signum, frame):
    # SIGTERM (a scheduler stopping us) takes the same path as Ctrl-C: finished rows get committed.
    raise KeyboardInterrupt


def _run(job, restart: bool, limit: Optional[int], quiet: bool) -> None:
    from .runner import run_job

    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        summary = run_job(job, restart=restart, limit=limit, quiet=quiet,
                          log=None if quiet else lambda m: click.echo(m, err=True))
    except (JobError, RunError) as e:
        _fail(e)
    except KeyboardInterrupt:
        click.echo("interrupted: finished rows are committed; run the same command again to continue", err=True)
        sys.exit(1)
    except Exception as e:  # an engine or I/O failure: say so plainly, keep the traceback for a bug report
        import traceback

        traceback.print_exc()
        click.echo(f"error: the run failed: {type(e).__name__}: {e}. Committed shards are kept; "
                   "run the same command again to continue", err=True)
        sys.exit(1)
    if not quiet:
        click.echo(
            f"done: {summary.outputs} rows written ({summary.errors} errors), {summary.skipped} already done, "
            f"{summary.completion_tokens} tokens in {summary.seconds:.1f}s "
            f"({summary.tokens_per_second:.1f} tok/s) -> {summary.run_dir}",
            err=True,
        )


@click.group(epilog=EPILOG_GROUP, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Batch offline LLM generation on MLX, resumable, with speculative decoding.

    A job reads prompts from a dataset, generates completions, and writes Parquet shards
    to its run directory (output.dir). See `mtplx-batch COMMAND --help`.
    """


@main.command(epilog=EPILOG_RUN)
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a job setting; the value is read as YAML (e.g. generation.stop=['\\n']). Repeatable.")
@click.option("--restart", is_flag=True, help="Move an existing run in output.dir aside and start over.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Only the first N input rows (a later run without --limit continues with the rest).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or messages; errors only.")
def run(job_file: str, overrides: Sequence[str], restart: bool, limit: Optional[int], quiet: bool):
    """Run JOB_FILE, or continue its earlier run in output.dir."""
    from .config import load_job

    try:
        job = load_job(job_file, overrides)
    except JobError as e:
        _fail(e)
    _run(job, restart, limit, quiet)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or messages; errors only.")
def resume(run_dir: str, quiet: bool):
    """Continue the run in RUN_DIR from the job copy stored there (RUN_DIR/job.yaml).

    \b
    Example:
      mtplx-batch resume runs/eval
    """
    from .checkpoint import JOB_FILE
    from .config import load_job

    path = os.path.join(run_dir, JOB_FILE)
    if not os.path.exists(path):
        _fail(JobError(f"{run_dir}: no {JOB_FILE}; not a run directory (start one with: mtplx-batch run JOB.yaml)"))
    try:
        job = load_job(path)
    except JobError as e:
        _fail(e)
    if os.path.abspath(job.output.dir) != os.path.abspath(run_dir):
        job.output.dir = os.path.abspath(run_dir)  # the directory was moved: follow it
    _run(job, False, None, quiet)


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
    from .config import load_job
    from .validate import format_report, validate_job

    try:
        job = load_job(job_file, overrides)
        report = validate_job(job, limit=limit)
    except (JobError, RunError) as e:
        _fail(e)
    click.echo(format_report(report))
    sys.exit(2 if report.refused else 0 if report.ok else 1)


if __name__ == "__main__":
    main()
