"""Power loss: what was not fsynced is gone, after every step of a run's commits.

tests/test_reliability.py kills the process: the kernel keeps every write it was given. A power
cut keeps only what reached the disk, and that is what the commit protocol (temp write, fsync,
rename, directory fsync, then the manifest the same way) is for. This test checks it by running
the real job in-process over a file layer that keeps, as the disk would, only what was made
durable:
- a file's content is durable as of its last fsync (of any descriptor of that inode); data
  written after it, or never fsynced, is lost (the file is empty after the cut);
- a directory's entries (creations, renames, removals) are durable as of its last fsync; a
  directory never fsynced since an entry appeared does not have that entry after the cut.
The layer intercepts the calls that change what is durable (`os.fsync`, `os.replace`,
`os.rename`, `os.remove`, `os.unlink`); the power is cut before the k-th of them, for every k
from the first to past the last: before a shard's fsync (its temp file written), before its
rename, before the shard directory's fsync, before the manifest's temp fsync, its rename, the run
directory's fsync, and the same for job.yaml and the run directory's own creation. The disk image
at the cut is rebuilt in a fresh directory; then the job runs there again and must complete to the
reference output, every (row, sample) exactly once, and every shard whose commit had returned
before the cut must still be there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from jobkit import job_dict, read_output, records, sample_rows, write_parquet
from pipelines.io import faults
from pipelines.job.config import build_job
from pipelines.execution.session import run_job

COLUMNS = ("id", "row", "sample", "completion", "finish_reason", "seed", "completion_tokens")


class PowerCut(BaseException):
    """The machine is off: nothing after this runs (a BaseException so no handler swallows it)."""


class Disk:
    """What is durable under `base`: directory entries and file contents as of their last fsync."""

    def __init__(self, base: Path):
        self.base = os.path.realpath(base)
        self.dirs, self.files = {}, {}  # inode -> {name: (inode, is_dir)}, inode -> bytes
        self.base_ino = os.stat(self.base).st_ino
        self._sync_tree(self.base)  # what is there at the start is on the disk
        self.steps = []  # the intercepted calls, in order
        self.cut_at = None  # cut the power before this step

    def _listing(self, path):
        out = {}
        with os.scandir(path) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                out[e.name] = (st.st_ino, stat.S_ISDIR(st.st_mode))
        return out

    def _sync_tree(self, path):
        listing = self._listing(path)
        self.dirs[os.stat(path).st_ino] = listing
        for name, (ino, is_dir) in listing.items():
            p = os.path.join(path, name)
            if is_dir:
                self._sync_tree(p)
            else:
                self.files[ino] = Path(p).read_bytes()

    def _inside(self, path) -> bool:
        return os.path.realpath(path).startswith(self.base)

    def step(self, what: str):
        if self.cut_at is not None and len(self.steps) >= self.cut_at:
            raise PowerCut(what)
        self.steps.append(what)

    def fsync(self, real, fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not self._inside(path):
            return real(fd)
        self.step(f"fsync {os.path.relpath(path, self.base)}")
        real(fd)
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            self.dirs[st.st_ino] = self._listing(path)
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                self.files[st.st_ino] = f.read()

    def rebuild(self, out: Path, ino=None):
        """The tree as a power cut now would leave it, written under `out`."""
        out.mkdir(parents=True, exist_ok=True)
        for name, (child, is_dir) in self.dirs.get(self.base_ino if ino is None else ino, {}).items():
            if is_dir:
                self.rebuild(out / name, child)
            else:
                (out / name).write_bytes(self.files.get(child, b""))


@pytest.fixture
def on_disk(monkeypatch):
    """Install the durable-file layer for one Disk at a time; returns a function that does so."""
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename", "remove", "unlink")}

    def install(disk: Disk):
        monkeypatch.setattr(os, "fsync", lambda fd: disk.fsync(real["fsync"], fd))

        def moving(name):
            def op(src, dst=None, *a, **k):
                if disk._inside(src):
                    disk.step(f"{name} {os.path.relpath(src, disk.base)}")
                return real[name](src, *a, **k) if dst is None else real[name](src, dst, *a, **k)
            return op

        for name in ("replace", "rename", "remove", "unlink"):
            monkeypatch.setattr(os, name, moving(name))

    def uninstall():
        for name, fn in real.items():
            monkeypatch.setattr(os, name, fn)

    install.uninstall = uninstall
    return install


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    from mtplx.generation import Engine

    tmp = tmp_path_factory.mktemp("power")
    rows = sample_rows(5)
    rows[2]["prompt"] = ""  # an error row: it must come out once too
    data = write_parquet(tmp / "in.parquet", rows)
    job = build_job(job_dict(tiny_model("llama"), data, tmp / "reference",
                             generation={"max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 5},
                             output={"shard_rows": 3}))
    engine = Engine.load(job.model.path, job.speculative, job.schedule)
    run_job(job, engine=engine)
    ref = {(r["row"], r["sample"]): {k: r[k] for k in COLUMNS} for r in read_output(tmp / "reference")}
    assert len(ref) == 10 and sum(r["finish_reason"] == "error" for r in ref.values()) == 2
    return job, engine, ref


def _run(job, engine, out_dir):
    job.output.dir = str(out_dir)
    return run_job(job, engine=engine)


def test_power_cut_after_any_step_resumes_with_nothing_lost_or_doubled(setup, on_disk, tmp_path, monkeypatch):
    job, engine, ref = setup
    commits = []
    real_hit = faults.hit

    def hit(point):
        if point == "shard.recorded":
            commits.append(point)
        real_hit(point)

    monkeypatch.setattr(faults, "hit", hit)

    # an uncut run: how many steps, and which
    (tmp_path / "count").mkdir()
    disk = Disk(tmp_path / "count")
    on_disk(disk)
    _run(job, engine, tmp_path / "count" / "run")
    on_disk.uninstall()
    steps = list(disk.steps)
    assert any(s.startswith("fsync run/shards/.part-") for s in steps), steps  # a shard's temp file
    assert any(s.startswith("fsync run/manifest.json.tmp") for s in steps) and "fsync run" in steps, steps
    # each of the 4 commits: one append, fsynced; and the log emptied once a rewrite of the manifest
    # lists its shards (the compiled-verify figures' update, the session's end)
    assert steps.count("fsync run/commits.jsonl") == 4 + 2, steps
    assert len(steps) >= 30, steps

    lost_commits = []
    for k in range(len(steps) + 1):
        base = tmp_path / f"cut{k}"
        (base / "disk").mkdir(parents=True)
        disk = Disk(base / "disk")
        disk.cut_at = k
        commits.clear()
        on_disk(disk)
        try:
            _run(job, engine, base / "disk" / "run")
            assert k == len(steps), f"the run passed fewer steps than counted ({k} of {len(steps)})"
        except PowerCut:
            pass
        finally:
            on_disk.uninstall()
        returned = len(commits)  # shard commits that had returned before the cut
        disk.rebuild(base / "image")
        run_dir = base / "image" / "run"
        where = f"power cut before step {k} ({steps[k] if k < len(steps) else 'after the last step'})"
        durable = len(read_output_manifest(run_dir))
        if durable < returned:
            lost_commits.append(f"{where}: {returned} commits had returned, {durable} survived")
        _run(job, engine, run_dir)
        out = read_output(run_dir)
        keys = [(r["row"], r["sample"]) for r in out]
        assert len(keys) == len(set(keys)), f"{where}: a row was committed twice"
        assert {(r["row"], r["sample"]): {c: r[c] for c in COLUMNS} for r in out} == ref, f"{where}: output differs"
    assert not lost_commits, lost_commits


def read_output_manifest(run_dir: Path):
    return records(run_dir) if (run_dir / "manifest.json").exists() else []
