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

import fcntl
import json
import os
import platform
import shutil
import time
from typing import Callable, Dict, List, Set, Tuple

import pyarrow.parquet as pq

from .errors import JobError
from .fingerprint import diff_fingerprint_parts, fingerprint
from .fsutil import atomic_write, sha256_file

MANIFEST = "manifest.json"
JOB_FILE = "job.yaml"
SHARDS = "shards"
LOCK = ".lock"
MANIFEST_FORMAT = 1
OWN_FILES = {MANIFEST, JOB_FILE, SHARDS, LOCK, MANIFEST + ".tmp", JOB_FILE + ".tmp"}


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
            return json.load(f)
    except FileNotFoundError:
        raise JobError(f"{run_dir}: no {MANIFEST}; not a run directory (run a job first: mtplx-batch run JOB.yaml)")
    except (OSError, ValueError) as e:
        raise JobError(f"{path}: unreadable ({e}); the run directory is damaged, start over with --restart")


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
                        f"{path} holds a run of a different job; changed: {', '.join(changed) or 'fingerprint'}. "
                        "Use another output.dir, undo the change, or pass --restart to move the old run "
                        "aside and start over"
                    )
            elif set(os.listdir(path)) - OWN_FILES:
                raise JobError(
                    f"output.dir {path} exists and is not a run directory (no {MANIFEST}); "
                    "choose an empty or new directory, or pass --restart to move it aside"
                )
        os.makedirs(os.path.join(path, SHARDS), exist_ok=True)
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
            atomic_write(os.path.join(path, JOB_FILE), job_yaml.encode("utf-8"))
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
        recorded = set()
        for entry in self.manifest["shards"]:
            f = os.path.join(self.path, entry["file"])
            recorded.add(os.path.basename(f))
            if not os.path.exists(f):
                raise JobError(
                    f"{f}: recorded in {MANIFEST} but missing. Restore the file, or start over with --restart"
                )
            if os.path.getsize(f) != entry["bytes"] or sha256_file(f) != entry["sha256"]:
                raise JobError(
                    f"{f}: checksum does not match {MANIFEST}; the shard is corrupt. Restore it, "
                    "or start over with --restart"
                )
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
        """(row, sample) of every committed output row."""
        keys: Set[Tuple[int, int]] = set()
        for entry in self.shards:
            t = pq.read_table(os.path.join(self.path, entry["file"]), columns=["row", "sample"])
            keys.update(zip(t.column("row").to_pylist(), t.column("sample").to_pylist()))
        return keys

    def next_shard_file(self) -> str:
        n = max((int(e["file"].rsplit("-", 1)[1].split(".")[0]) for e in self.shards), default=-1) + 1
        return f"{SHARDS}/part-{n:05d}.parquet"

    def record_shard(self, entry: Dict) -> None:
        self.manifest["shards"].append(entry)
        self._save()

    def update(self, **fields) -> None:
        self.manifest.update(fields)
        self._save()

    def _save(self) -> None:
        self.manifest["updated"] = time.time()
        data = json.dumps(self.manifest, indent=1, sort_keys=True).encode("utf-8")
        atomic_write(os.path.join(self.path, MANIFEST), data)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def totals(manifest: Dict) -> Dict[str, float]:
    """Sums of the per-shard counters kept in the manifest (what `status` reports)."""
    keys = ("rows", "errors", "prompt_tokens", "completion_tokens", "drafted_tokens",
            "accepted_tokens", "verify_calls", "decode_seconds", "elapsed")
    out = {k: 0 for k in keys}
    for entry in manifest.get("shards", []):
        for k in keys:
            out[k] += entry.get(k, 0)
    return out
