"""The run directory: what has been committed, and whether this job may continue it.

Layout (RUN_DIR = output.dir):
    job.yaml        the resolved job (absolute paths), what `resume RUN_DIR` runs
    manifest.json   fingerprint, versions, and the committed shards with row counts and checksums
    shards/part-NNNNN.parquet

Only shards recorded in the manifest count. A shard is written to a temp name, fsynced, renamed,
and then recorded by rewriting the manifest atomically (temp + fsync + rename + dir fsync). A
kill at any point leaves either a recorded shard or a leftover file, which the next start
deletes (its rows are simply generated again). Row ids are never used in file names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import re
import shutil
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import pyarrow.parquet as pq

from ..errors import JobError, RunError
from ..job.columns import SUMMED_COLUMNS
from ..job.fingerprint import diff_fingerprint_parts, fingerprint, refusal_note, sha256_file
from .fsutil import atomic_write, make_dirs

MANIFEST = "manifest.json"
JOB_FILE = "job.yaml"
SHARDS = "shards"
LOCK = ".lock"
PROGRESS_FILE = "progress.jsonl"  # throughput over time, written by the session (execution/progress.py)
MANIFEST_FORMAT = 1
OWN_FILES = {MANIFEST, JOB_FILE, SHARDS, LOCK, PROGRESS_FILE, MANIFEST + ".tmp", JOB_FILE + ".tmp"}
SHARD_FILE = re.compile(r"shards/part-\d{5,}\.parquet")  # the only names a manifest may record


def io_failure(e: OSError, what: str) -> RunError:
    """A RunError for a failed write in the run directory, saying how to continue."""
    cause = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
    return RunError(f"cannot write {what}: {cause} ({e}). Committed shards are kept and rows not yet "
                    "committed will be generated again: fix the cause (free some space), then run the "
                    "same command again to continue")


def versions() -> Dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("mtplx-batch", "mlx", "mlx-lm", "pyarrow"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def read_manifest(run_dir: str) -> Dict:
    path = os.path.join(run_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise JobError(f"{run_dir}: no {MANIFEST}; not a run directory (run a job first: mtplx-batch run JOB.yaml)")
    except (OSError, ValueError) as e:
        raise JobError(f"{path}: unreadable ({e}); the run directory is damaged, start over with --restart")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise JobError(f"{path}: not a manifest (no list of shards); the run directory is damaged, "
                       "start over with --restart")
    return manifest


def _aside_name(path: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, k = f"{path}.old-{stamp}", 1
    while os.path.exists(candidate):
        k += 1
        candidate = f"{path}.old-{stamp}-{k}"
    return candidate


class RunDir:
    def __init__(self, path: str, manifest: Dict, lock_fd: int):
        self.path = path
        self.manifest = manifest
        self._lock_fd = lock_fd
        self._keys = None  # committed (row, sample) keys as verified on opening

    # ---------------------------------------------------------------- opening
    @classmethod
    def prepare(cls, path: str, job_yaml: str, parts: Dict[str, str], restart: bool = False,
                log: Callable[[str], None] = print) -> "RunDir":
        """Open RUN_DIR for this job: create, resume, refuse, or (with restart) start over."""
        path = os.path.abspath(path)
        fp = fingerprint(parts)
        if os.path.isdir(path) and os.listdir(path):
            has_manifest = os.path.exists(os.path.join(path, MANIFEST))
            if restart:
                fd = cls._lock(path)
                aside = _aside_name(path)
                os.rename(path, aside)
                os.close(fd)
                log(f"--restart: moved the previous run to {aside}")
            elif has_manifest:
                old = read_manifest(path)
                if old.get("fingerprint") != fp:
                    changed = diff_fingerprint_parts(old.get("fingerprint_parts", {}), parts)
                    raise JobError(
                        f"{path} holds a run of a different job; changed: {', '.join(changed) or 'fingerprint'}"
                        f"{refusal_note(changed)}. "
                        "Use another output.dir, undo the change, or pass --restart to move the old run "
                        "aside and start over"
                    )
            elif set(os.listdir(path)) - OWN_FILES:
                raise JobError(
                    f"output.dir {path} exists and is not a run directory (no {MANIFEST}); "
                    "choose an empty or new directory, or pass --restart to move it aside"
                )
            elif _shard_files(path):
                # Shards are only written after the manifest exists, so this is damage (a deleted
                # manifest), not an interrupted run: which shards were committed is unknown.
                raise JobError(
                    f"{path} holds shards but no {MANIFEST}, so which of them were committed is unknown; "
                    "restore the manifest, or pass --restart to move this run aside and start over"
                )
        make_dirs(os.path.join(path, SHARDS))  # fsyncs the parents: a power cut cannot lose the run directory
        fd = cls._lock(path)
        manifest_path = os.path.join(path, MANIFEST)
        if os.path.exists(manifest_path):
            try:
                manifest = read_manifest(path)
            except JobError:
                os.close(fd)
                raise
        else:
            manifest = {
                "format": MANIFEST_FORMAT,
                "fingerprint": fp,
                "fingerprint_parts": parts,
                "created": time.time(),
                "input_rows": None,
                "samples": None,
                "shards": [],
            }
        run = cls(path, manifest, fd)
        try:
            run._verify(log)
            manifest["versions"] = versions()
            manifest.setdefault("sessions", []).append({"started": time.time(), "pid": os.getpid()})
            try:
                atomic_write(os.path.join(path, JOB_FILE), job_yaml.encode("utf-8"), fault="job")
            except OSError as e:
                raise io_failure(e, os.path.join(path, JOB_FILE)) from e
            run._save()
        except BaseException:
            run.close()
            raise
        return run

    @staticmethod
    def _lock(path: str) -> int:
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobError(f"{path} is in use by another mtplx-batch process; wait for it or stop it first")
        return fd

    def _verify(self, log: Callable[[str], None]) -> None:
        self._keys = verify_shards(self.path, self.manifest)
        recorded = {os.path.basename(e["file"]) for e in self.manifest["shards"]}
        shard_dir = os.path.join(self.path, SHARDS)
        for name in sorted(os.listdir(shard_dir)):
            if name not in recorded:
                p = os.path.join(shard_dir, name)
                if os.path.isdir(p):
                    shutil.rmtree(p)
                else:
                    os.remove(p)
                log(f"removed {p}: written but never committed by an earlier, interrupted run")
        for tmp in (MANIFEST + ".tmp", JOB_FILE + ".tmp"):
            if os.path.exists(os.path.join(self.path, tmp)):
                os.remove(os.path.join(self.path, tmp))

    # ---------------------------------------------------------------- state
    @property
    def shards(self) -> List[Dict]:
        return self.manifest["shards"]

    def committed_keys(self) -> Set[Tuple[int, int]]:
        """(row, sample) of every committed output row (checked when the run directory opened)."""
        if self._keys is None:
            self._keys = verify_shards(self.path, self.manifest)
        return set(self._keys)

    def next_shard_file(self) -> str:
        n = max((int(e["file"].rsplit("-", 1)[1].split(".")[0]) for e in self.shards), default=-1) + 1
        return f"{SHARDS}/part-{n:05d}.parquet"

    def record_shard(self, entry: Dict) -> None:
        self._keys = None
        self.manifest["shards"].append(entry)
        try:
            self._save()
        except BaseException:
            self.manifest["shards"].pop()  # not on disk: the next start deletes the shard file
            raise

    def update(self, **fields) -> None:
        self.manifest.update(fields)
        self._save()

    def _save(self) -> None:
        self.manifest["updated"] = time.time()
        data = json.dumps(self.manifest, indent=1, sort_keys=True).encode("utf-8")
        try:
            atomic_write(os.path.join(self.path, MANIFEST), data, fault="manifest")
        except OSError as e:
            raise io_failure(e, os.path.join(self.path, MANIFEST)) from e

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def verify_shards(path: str, manifest: Dict) -> Set[Tuple[int, int]]:
    """Read-only check of every shard the manifest records: a name inside RUN_DIR/shards, the
    file present with its recorded size and checksum, its row count as recorded, and no
    (row, sample) in two shards. Returns the committed (row, sample) keys; JobError otherwise."""
    keys: Set[Tuple[int, int]] = set()
    where: Dict[Tuple[int, int], str] = {}
    fix = "start over with --restart (the old run is moved aside, not deleted)"
    for entry in manifest["shards"]:
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
            raise JobError(f"{os.path.join(path, MANIFEST)}: shard entry {name!r} is not a shard of this run "
                           f"directory (shards/part-NNNNN.parquet); the manifest is damaged, {fix}")
        f = os.path.join(path, name)
        if not os.path.exists(f):
            raise JobError(f"{f}: recorded in {MANIFEST} but missing; its rows cannot be counted. Restore the "
                           f"file, or {fix}")
        size = os.path.getsize(f)
        if size != entry.get("bytes") or sha256_file(f) != entry.get("sha256"):
            raise JobError(f"{f}: checksum does not match {MANIFEST}; the shard is torn or corrupt ({size} bytes, "
                           f"{entry.get('bytes')} recorded). Restore it, or {fix}")
        t = pq.read_table(f, columns=["row", "sample"])
        if t.num_rows != entry.get("rows"):
            raise JobError(f"{f}: holds {t.num_rows} rows, {MANIFEST} says {entry.get('rows')}; the run "
                           f"directory is damaged, {fix}")
        for key in zip(t.column("row").to_pylist(), t.column("sample").to_pylist()):
            if key in keys:
                raise JobError(
                    f"{path}: row {key[0]} sample {key[1]} is committed twice ({where[key]} and {name}); the "
                    "run directory is damaged (a shard copied in by hand?). Remove the extra shard's entry "
                    f"from {MANIFEST}, or {fix}"
                )
            keys.add(key)
            where[key] = name
    return keys


def _shard_files(path: str) -> List[str]:
    """Committed-looking shard files (not temp files) under RUN_DIR/shards."""
    try:
        names = os.listdir(os.path.join(path, SHARDS))
    except OSError:
        return []
    return [n for n in names if n.endswith(".parquet") and not n.startswith(".")]


def planned_outputs(manifest: Dict) -> Optional[int]:
    """Output rows the run is to write: the input rows it plans (`planned_rows`, fewer than
    `input_rows` under input.limit / --limit) x samples per row; None while unknown."""
    rows = manifest.get("planned_rows", manifest.get("input_rows"))
    return None if rows is None else rows * (manifest.get("samples") or 1)


def totals(manifest: Dict) -> Dict[str, float]:
    """Sums of the per-shard counters kept in the manifest (what `status` reports)."""
    keys = ("rows", "errors", *SUMMED_COLUMNS, "elapsed")
    out = {k: 0 for k in keys}
    for entry in manifest.get("shards", []):
        for k in keys:
            out[k] += entry.get(k, 0)
    return out
