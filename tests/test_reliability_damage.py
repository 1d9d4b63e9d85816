"""A damaged run directory is detected, then repaired or refused with a clear message; a row is
never silently counted twice, and a refused directory is left exactly as it was.

- a shard file that is not in the manifest (a kill between rename and commit, a stray copy, a
  torn leftover, temp files): deleted on the next start, its rows generated again;
- a recorded shard torn, altered or missing, a torn / wrong manifest, shards without a
  manifest, one row recorded twice, an entry pointing outside the run directory: refused
  (exit 2) naming the file and the fix, before any weights load, nothing changed on disk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, sample_rows, write_job, write_parquet
from pipelines.io.checkpoint import RunDir
from pipelines.cli.commands import main

SETTINGS = dict(generation={"max_tokens": 4, "n": 1}, output={"shard_rows": 2})


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model):
    """A complete run and a partial one (3 of 8 rows) of the same job, to copy and damage."""
    root = tmp_path_factory.mktemp("damage")
    data = write_parquet(root / "in.parquet", sample_rows(8))
    model = tiny_model("llama")
    for name, extra in (("complete", []), ("partial", ["--limit", "3"])):
        job = write_job(root / f"{name}.yaml", job_dict(model, data, root / name, **SETTINGS))
        out = cli("run", job, "-q", *extra)
        assert out.exit_code == 0, out.output
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


def manifest(run: Path):
    return json.loads((run / "manifest.json").read_text())


def write_manifest(run: Path, m):
    (run / "manifest.json").write_text(json.dumps(m))


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _truncate(run):
    f = run / "shards" / "part-00001.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _bitflip(run):
    f = run / "shards" / "part-00001.parquet"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))


def _delete_shard(run):
    (run / "shards" / "part-00001.parquet").unlink()


def _torn_manifest(run):
    text = (run / "manifest.json").read_bytes()
    (run / "manifest.json").write_bytes(text[: len(text) // 2])


def _not_a_manifest(run):
    (run / "manifest.json").write_text("[]")


def _no_manifest(run):
    (run / "manifest.json").unlink()


def _same_shard_twice(run):
    m = manifest(run)
    m["shards"].append(dict(m["shards"][0]))
    write_manifest(run, m)


def _copied_shard_recorded(run):
    m = manifest(run)
    src = run / m["shards"][0]["file"]
    dst = run / "shards" / "part-00042.parquet"
    shutil.copy(src, dst)
    m["shards"].append({**m["shards"][0], "file": "shards/part-00042.parquet", "sha256": sha(dst)})
    write_manifest(run, m)


def _entry_escapes(run):
    m = manifest(run)
    m["shards"][0]["file"] = "../../../../etc/passwd"
    write_manifest(run, m)


def _row_count_lies(run):
    m = manifest(run)
    m["shards"][0]["rows"] += 1
    write_manifest(run, m)


REFUSED = [
    ("recorded shard truncated", _truncate, "part-00001.parquet: checksum does not match manifest.json; the shard is torn"),
    ("recorded shard altered", _bitflip, "part-00001.parquet: checksum does not match manifest.json"),
    ("recorded shard missing", _delete_shard, "part-00001.parquet: recorded in manifest.json but missing"),
    ("manifest torn", _torn_manifest, "manifest.json: unreadable"),
    ("manifest not a manifest", _not_a_manifest, "manifest.json: not a manifest"),
    ("shards without a manifest", _no_manifest, "holds shards but no manifest.json"),
    ("one shard recorded twice", _same_shard_twice, "sample 0 is committed twice"),
    ("a copied shard recorded", _copied_shard_recorded, "sample 0 is committed twice"),
    ("manifest entry outside the run dir", _entry_escapes, "is not a shard of this run directory"),
    ("row count disagrees", _row_count_lies, "manifest.json says 3"),
]


@pytest.mark.parametrize("damage, expected", [(d, e) for _, d, e in REFUSED], ids=[k for k, _, _ in REFUSED])
@pytest.mark.parametrize("which", ["complete", "partial"])
def test_damage_is_refused_and_nothing_is_touched(base, tmp_path, damage, expected, which):
    run, job = copy_run(base, tmp_path, which)
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


def test_unrecorded_files_are_removed_and_their_rows_generated_once(base, tmp_path):
    """Leftovers of interrupted commits, including a complete, valid shard that duplicates
    committed rows and sits exactly where the next shard will be written."""
    root, _, _ = base
    run, job = copy_run(base, tmp_path, "partial")
    m = manifest(run)
    assert [e["file"] for e in m["shards"]] == ["shards/part-00000.parquet", "shards/part-00001.parquet"]
    shards = run / "shards"
    shutil.copy(shards / "part-00000.parquet", shards / "part-00002.parquet")  # valid, unrecorded
    torn = (shards / "part-00001.parquet").read_bytes()
    (shards / "part-00007.parquet").write_bytes(torn[:100])  # torn, unrecorded
    (shards / ".part-00003.parquet.tmp").write_bytes(torn[:50])  # a temp file mid-write
    (run / "manifest.json.tmp").write_text('{"shards": [')  # a manifest temp mid-write
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
    recorded = {Path(e["file"]).name for e in manifest(run)["shards"]}
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
