"""A damaged run directory is detected, then repaired or refused with a clear message; a row is
never silently counted twice, and a refused directory is left exactly as it was.

- a shard file that no record names (a kill between rename and commit, a stray
  copy, a torn leftover, temp files): deleted on the next start, its rows generated again;
- a recorded shard torn, missing, its keys altered, or a link out of the run directory; a torn /
  wrong manifest, shards without a manifest, a missing or damaged commit log; one shard recorded
  twice, one row in two shards, a record pointing outside the run directory, a row count that
  lies, is huge or is not a count; shards/ a link to another directory: refused (exit 2) naming
  the file and the fix, before any weights load, nothing changed on disk;
- a recorded shard altered where a resume does not read (a completion): export and report
  refuse it by its sha256, and dropping its record (the fix they name) regenerates its rows.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobkit import flip_column_byte, job_dict, read_output, sample_rows, write_job, write_parquet
from pipelines.io.checkpoint import RunDir
from pipelines.cli.commands import main

SETTINGS = dict(generation={"max_tokens": 4, "n": 1}, output={"shard_rows": 2})


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model):
    """A complete run, whose manifest.json lists its shards, and a partial one (3 of 8 rows) of the
    same job whose records are in its commit log, as a run killed after its commits leaves them."""
    root = tmp_path_factory.mktemp("damage")
    data = write_parquet(root / "in.parquet", sample_rows(8))
    model = tiny_model("llama")
    for name, extra in (("complete", []), ("partial", ["--limit", "3"])):
        job = write_job(root / f"{name}.yaml", job_dict(model, data, root / name, **SETTINGS))
        out = cli("run", job, "-q", *extra)
        assert out.exit_code == 0, out.output
    run = root / "partial"
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "commits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in manifest["shards"]))
    (run / "manifest.json").write_text(json.dumps({**manifest, "shards": []}))
    return root, model, data


def copy_run(base, tmp_path, which: str):
    root, model, data = base
    run = tmp_path / "run"
    shutil.copytree(root / which, run)
    job = write_job(tmp_path / "job.yaml", job_dict(model, data, run, **SETTINGS))
    return run, job


def snapshot(run: Path):
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def records(run: Path):
    listed = json.loads((run / "manifest.json").read_text())["shards"]
    return listed + [json.loads(line) for line in (run / "commits.jsonl").read_text().splitlines()]


def where(run: Path) -> str:
    """The file that holds the run's records: manifest.json once a session ended, else the log."""
    return "manifest.json" if json.loads((run / "manifest.json").read_text())["shards"] else "commits.jsonl"


def write_records(run: Path, recs):
    if where(run) == "manifest.json":
        manifest = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps({**manifest, "shards": recs}))
    else:
        (run / "commits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _truncate(run):
    f = run / "shards" / "part-00001.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _key_bitflip(run):
    flip_column_byte(run / "shards" / "part-00001.parquet", "row")


def _delete_shard(run):
    (run / "shards" / "part-00001.parquet").unlink()


def _torn_manifest(run):
    text = (run / "manifest.json").read_bytes()
    (run / "manifest.json").write_bytes(text[: len(text) // 2])


def _not_a_manifest(run):
    (run / "manifest.json").write_text("[]")


def _no_manifest(run):
    (run / "manifest.json").unlink()


def _no_commit_log(run):
    (run / "commits.jsonl").unlink()


def _damaged_commit_line(run):
    lines = (run / "commits.jsonl").read_text().splitlines() or [json.dumps(records(run)[0])]
    lines[0] = lines[0][:25]
    (run / "commits.jsonl").write_text("".join(x + "\n" for x in lines))


def _same_shard_twice(run):
    recs = records(run)
    write_records(run, recs + [recs[0]])


def _copied_shard_recorded(run):
    recs = records(run)
    src = run / recs[0]["file"]
    dst = run / "shards" / "part-00042.parquet"
    shutil.copy(src, dst)
    write_records(run, recs + [{**recs[0], "file": "shards/part-00042.parquet", "sha256": sha(dst)}])


def _entry_escapes(run):
    recs = records(run)
    recs[0]["file"] = "../../../../etc/passwd"
    write_records(run, recs)


def _shard_links_out(run):
    f = run / "shards" / "part-00001.parquet"
    outside = run.parent / "outside.parquet"
    shutil.move(f, outside)  # the very same bytes, size and checksum: only where it lives is wrong
    f.symlink_to(outside)


def _shards_dir_links_out(run):
    elsewhere = run.parent / "elsewhere"
    shutil.move(run / "shards", elsewhere)
    (elsewhere / "precious.txt").write_text("not a shard: must never be deleted")
    (run / "shards").symlink_to(elsewhere)


def _row_count_lies(run):
    recs = records(run)
    recs[0]["rows"] += 1
    write_records(run, recs)


def _row_count_huge(run):
    recs = records(run)
    recs[0]["rows"] = 10 ** 15
    write_records(run, recs)


def _row_count_not_a_count(run):
    recs = records(run)
    recs[0]["rows"] = "2"
    write_records(run, recs)


REFUSED = [
    ("recorded shard truncated", _truncate, "{where} records 70"),
    ("recorded shard's keys altered", _key_bitflip, "part-00001.parquet: unreadable as a shard"),
    ("recorded shard missing", _delete_shard, "part-00001.parquet: recorded in {where} but missing"),
    ("manifest torn", _torn_manifest, "manifest.json: unreadable"),
    ("manifest not a manifest", _not_a_manifest, "manifest.json: not a manifest"),
    ("shards without a manifest", _no_manifest, "holds shards but no manifest.json"),
    ("commit log missing", _no_commit_log, "commits.jsonl: missing, so which shards were committed is unknown"),
    ("commit log line damaged", _damaged_commit_line, "commits.jsonl line 1: not a commit record"),
    ("one shard recorded twice", _same_shard_twice, "part-00000.parquet is recorded twice"),
    ("a copied shard recorded", _copied_shard_recorded, "sample 0 is committed twice"),
    ("record outside the run dir", _entry_escapes, "is not a shard of this run directory"),
    ("recorded shard is a link out", _shard_links_out, "part-00001.parquet: a link to"),
    ("shards/ is a link out", _shards_dir_links_out, "shards is a symbolic link"),
    ("row count disagrees", _row_count_lies, "{where} says 3"),
    ("row count huge", _row_count_huge, "{where} says 1000000000000000"),
    ("row count not a count", _row_count_not_a_count, "has no valid rows"),
]


@pytest.mark.parametrize("damage, expected", [(d, e) for _, d, e in REFUSED], ids=[k for k, _, _ in REFUSED])
@pytest.mark.parametrize("which", ["complete", "partial"])
def test_damage_is_refused_and_nothing_is_touched(base, tmp_path, damage, expected, which):
    run, job = copy_run(base, tmp_path, which)
    expected = expected.format(where=where(run))
    damage(run)
    before = snapshot(run)
    out = cli("run", job, "-q")
    assert out.exit_code == 2, out.output
    assert expected in out.output, out.output
    assert "--restart" in out.output or "restore" in out.output.lower()
    assert snapshot(run) == before
    assert cli("validate", job).exit_code == 2
    # the advertised fix works: --restart moves the damaged run aside (kept) and starts over
    out = cli("run", job, "-q", "--restart")
    assert out.exit_code == 0, out.output
    aside = [p for p in run.parent.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and snapshot(aside[0]) == before
    assert len(read_output(run)) == 8
    if (run.parent / "elsewhere").exists():  # what a link led to is never touched
        assert (run.parent / "elsewhere" / "precious.txt").exists()


def test_status_reads_no_shard_but_refuses_counts_the_input_cannot_hold(base, tmp_path):
    run, _ = copy_run(base, tmp_path, "partial")
    _row_count_huge(run)
    out = cli("status", run)
    assert out.exit_code == 2 and "records 1000000000000001 output rows, more than the input has (8 rows x 1 " \
        "samples)" in out.output, out.output


def test_a_corrupt_shard_is_refused_on_export_and_regenerated_once_its_record_is_dropped(base, tmp_path):
    """A resume reads only a shard's keys, so a flipped byte in a completion passes it; export and
    report hash every shard first and refuse, naming it and the fix, which works."""
    root, _, _ = base
    run, job = copy_run(base, tmp_path, "complete")
    flip_column_byte(run / "shards" / "part-00001.parquet", "completion")
    assert cli("status", run).exit_code == 0
    assert cli("run", job, "-q").exit_code == 0
    for args in (("export", run, "--format", "jsonl", "--out", tmp_path / "out.jsonl"),
                 ("export", run, "--format", "hf", "--out", tmp_path / "hf"),
                 ("report", run, "--out", tmp_path / "report")):
        out = cli(*args)
        assert out.exit_code == 2, out.output
        assert "part-00001.parquet: its sha256 does not match manifest.json" in out.output, out.output
        assert "delete its record from manifest.json" in out.output
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "hf").exists()
    write_records(run, [r for r in records(run) if r["file"] != "shards/part-00001.parquet"])
    out = cli("run", job)
    assert out.exit_code == 0 and "2 rows written" in out.output, out.output
    assert cli("export", run, "--format", "jsonl", "--out", tmp_path / "out.jsonl").exit_code == 0
    key = ("id", "row", "sample", "completion", "finish_reason", "error", "seed")
    want = [{k: r[k] for k in key} for r in read_output(root / "complete")]
    assert [{k: r[k] for k in key} for r in read_output(run)] == want
    assert [{k: r[k] for k in key} for r in map(json.loads, open(tmp_path / "out.jsonl"))] == want


def test_unrecorded_files_are_removed_and_their_rows_generated_once(base, tmp_path):
    """Leftovers of interrupted commits, including a complete, valid shard that duplicates
    committed rows and sits exactly where the next shard will be written."""
    root, _, _ = base
    run, job = copy_run(base, tmp_path, "partial")
    assert [e["file"] for e in records(run)] == ["shards/part-00000.parquet", "shards/part-00001.parquet"]
    shards = run / "shards"
    shutil.copy(shards / "part-00000.parquet", shards / "part-00002.parquet")  # valid, unrecorded
    torn = (shards / "part-00001.parquet").read_bytes()
    (shards / "part-00007.parquet").write_bytes(torn[:100])  # torn, unrecorded
    (shards / ".part-00003.parquet.tmp").write_bytes(torn[:50])  # a temp file mid-write
    (run / "manifest.json.tmp").write_text('{"fingerprint": ')  # a manifest temp mid-write
    (run / "commits.jsonl.tmp").write_text('{"file": ')
    (run / "job.yaml.tmp").write_text("name: x")
    out = cli("run", job)
    assert out.exit_code == 0, out.output
    for name in ("part-00002.parquet", "part-00007.parquet", ".part-00003.parquet.tmp"):
        assert f"removed {shards / name}: written but never committed" in out.output
    assert "5 rows written" in out.output and "3 already done" in out.output
    got = read_output(run)
    want = read_output(root / "complete")
    key = ("id", "row", "sample", "completion", "finish_reason", "error", "seed")
    assert [{k: r[k] for k in key} for r in got] == [{k: r[k] for k in key} for r in want]
    assert not list(run.rglob("*.tmp"))
    recorded = {Path(e["file"]).name for e in records(run)}
    assert {p.name for p in shards.iterdir()} == recorded
    st = json.loads(cli("status", run, "--json").output)
    assert st["rows_done"] == 8 and st["rows_left"] == 0


def test_a_second_process_on_the_same_run_dir_is_refused(base, tmp_path):
    run, job = copy_run(base, tmp_path, "partial")
    holder = RunDir._lock(str(run))  # another process holding the run directory
    try:
        before = snapshot(run)
        out = cli("run", job, "-q")
        assert out.exit_code == 2 and "in use by another mtplx-batch process" in out.output, out.output
        assert snapshot(run) == before
    finally:
        import os

        os.close(holder)
    assert cli("run", job, "-q").exit_code == 0


def test_report_skips_progress_lines_whose_figures_are_not_numbers(base, tmp_path):
    run, _ = copy_run(base, tmp_path, "complete")
    with open(run / "progress.jsonl", "a") as f:
        f.write('{"ts": "soon", "session": 1, "generated": 5}\n{"ts": 1.0, "session": 1, "generated": null}\n')
    out = cli("report", run, "--out", tmp_path / "report")
    assert out.exit_code == 0, out.output
