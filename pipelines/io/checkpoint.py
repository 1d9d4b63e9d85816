"""The run directory: opening it for a job (create, resume, refuse, or move aside) and committing shards.

Layout (RUN_DIR = output.dir):
    job.yaml        the resolved job (absolute paths), what `resume RUN_DIR` runs
    manifest.json   fingerprint, versions, sessions, input counts, and the shards committed up to its
                    last rewrite (file, rows, bytes, sha256, counters); rewritten atomically (temp,
                    fsync, rename, directory fsync) as a session starts and ends, never per shard
    commits.jsonl   the shards committed since, one line each; emptied once a rewrite lists them
    shards/part-NNNNN.parquet

A commit costs the same at the first shard as at the ten-thousandth: the shard is written to a
temp name, fsynced and renamed (its directory fsynced), then its line is appended to
commits.jsonl and the log fsynced; that fsync is the commit. Only recorded shards count. A kill
or a power cut leaves either a shard file that no line records, which the next start deletes
(its rows are generated again), or a last line without its newline (a commit that never
returned), which readers ignore and the next start cuts off. A rewrite of manifest.json that
lists the log's shards, cut off before the log is emptied, leaves records in both: a record the
manifest lists counts once. Row ids are never used in file names.


Reading and checking the records is records.py's.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import shutil
import time
from typing import Callable, Dict, List, Optional

from ..errors import JobError, RunError
from ..job.fingerprint import describe_changes, diff_fingerprint_parts, fingerprint, refusal_note
from . import faults
from .fsutil import atomic_write, fsync_path, make_dirs
from .records import (COMMITS, JOB_FILE, LISTED, LOCK, MANIFEST, MANIFEST_FORMAT, OWN_FILES, RESTART, SHARDS,
                      Committed, CommittedKeys, is_run, load_manifest, read_manifest, verify_shards)


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


def _shard_files(path: str) -> List[str]:
    """Committed-looking shard files (not temp files) under RUN_DIR/shards."""
    try:
        names = os.listdir(os.path.join(path, SHARDS))
    except OSError:
        return []
    return [n for n in names if n.endswith(".parquet") and not n.startswith(".")]


def _listing(path: str, most: int = 4) -> str:
    names = sorted(os.listdir(path))
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_run_dir(path: str, parts: Dict[str, str]) -> Optional[Dict]:
    """What `run` refuses in output.dir before it writes anything (JobError naming the fix): not a
    directory, not a run, a run of another job, shards without a manifest, a damaged manifest.
    Returns the manifest of the run to resume, or None for a new run."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise JobError(f"output.dir {path} exists and is not a directory; point output.dir at a new or empty directory")
    if not os.path.isdir(path) or not os.listdir(path):
        return None
    shards = os.path.join(path, SHARDS)
    if os.path.islink(shards):
        raise JobError(f"{shards} is a symbolic link (to {os.path.realpath(shards)}); a run keeps its shards in a "
                       "directory of its own and deletes from it what it did not commit. Replace the link with "
                       f"a directory, or {RESTART}")
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        if set(os.listdir(path)) - OWN_FILES:
            raise JobError(f"output.dir {path} exists and is not a run directory (no {MANIFEST}; it holds "
                           f"{_listing(path)}); point output.dir at a new or empty directory")
        commits = os.path.join(path, COMMITS)
        if _shard_files(path) or (os.path.isfile(commits) and os.path.getsize(commits)):
            # Shards are only written after the manifest exists, so this is damage (a deleted
            # manifest), not an interrupted run: which shards were committed is unknown.
            raise JobError(f"{path} holds shards but no {MANIFEST}, so which of them were committed is unknown; "
                           "restore the manifest, or pass --restart to move this run aside and start over")
        return None
    old = read_manifest(path)
    if old["fingerprint"] != fingerprint(parts):
        changed = diff_fingerprint_parts(old["fingerprint_parts"], parts)
        raise JobError(
            f"{path} holds a run of a different job; changed: "
            f"{describe_changes(old['fingerprint_parts'], parts, changed) or 'fingerprint'}{refusal_note(changed)}. "
            "Use another output.dir, undo the change, or pass --restart to move the old run aside and start over")
    return old


def _aside_name(path: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, k = f"{path}.old-{stamp}", 1
    while os.path.lexists(candidate):
        k += 1
        candidate = f"{path}.old-{stamp}-{k}"
    return candidate


def move_aside(path: str, log: Callable[[str], None]) -> None:
    """--restart: rename the run in `path` to PATH.old-STAMP (nothing is deleted). Anything that
    is not a run is refused and left alone."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise JobError(f"--restart moves aside only a run directory, and output.dir {path} is not a directory; "
                       "nothing was moved. Point output.dir at a new or empty directory")
    if not os.listdir(path):
        return
    if not is_run(path):
        raise JobError(f"--restart moves aside only a run directory, and output.dir {path} is not one (no "
                       f"mtplx-batch {MANIFEST}; it holds {_listing(path)}); nothing was moved. Point output.dir "
                       "at a new or empty directory")
    fd = RunDir._lock(path)
    aside = _aside_name(path)
    try:
        os.rename(path, aside)
        fsync_path(os.path.dirname(path))
    except OSError as e:
        raise JobError(f"--restart: cannot move {path} aside to {aside}: {e.strerror or e}; nothing was moved "
                       "or deleted. Move the old run away yourself, or point output.dir at another directory") from None
    finally:
        os.close(fd)
    log(f"--restart: moved the previous run to {aside} (nothing was deleted)")


# ------------------------------------------------------------------------------ the open run
def _line(entry: Dict) -> bytes:
    return (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8")


class RunDir:
    """A run directory opened by this process (and locked for it): its manifest, what is
    committed, and the commit log that `record_shard` appends to."""

    def __init__(self, path: str, lock_fd: int):
        self.path = path
        self.manifest: Dict = {}
        self._lock_fd = lock_fd
        self._log_fd: Optional[int] = None
        self._log_end = 0  # bytes of complete lines in commits.jsonl
        self._committed: Optional[Committed] = None  # as verified on opening

    # ---------------------------------------------------------------- opening
    @classmethod
    def prepare(cls, path: str, job_yaml: str, parts: Dict[str, str], restart: bool = False,
                log: Callable[[str], None] = print) -> "RunDir":
        """Open RUN_DIR for this job: create, resume, refuse, or (with restart) start over."""
        path = os.path.abspath(path)
        if restart:
            move_aside(path, log)
        else:
            check_run_dir(path, parts)
        make_dirs(os.path.join(path, SHARDS))  # fsyncs the parents: a power cut cannot lose the run directory
        run = cls(path, cls._lock(path))
        try:
            run._open(parts, job_yaml, log)
        except BaseException:
            run.close()
            raise
        return run

    @staticmethod
    def _lock(path: str) -> int:
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise JobError(f"{os.path.join(path, LOCK)}: cannot open the run's lock file ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobError(f"{path} is in use by another mtplx-batch process; wait for it or stop it first")
        return fd

    def _open(self, parts: Dict[str, str], job_yaml: str, log: Callable[[str], None]) -> None:
        path = self.path
        end = None
        if os.path.lexists(os.path.join(path, MANIFEST)):
            self.manifest, end = load_manifest(path)
        else:
            self.manifest = {"fingerprint": fingerprint(parts), "fingerprint_parts": parts, "created": time.time(),
                             "input_rows": None, "samples": None, "shards": [], LISTED: 0}
        self._committed = verify_shards(path, self.manifest)
        self._remove_leftovers(log)
        commits = os.path.join(path, COMMITS)
        try:
            if end is None:  # a new run, or a format-1 one: its (empty) log exists before a manifest names it
                atomic_write(commits, b"")
                end = 0
            elif os.path.getsize(commits) > end:
                with open(commits, "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
                log(f"cut an incomplete last line from {commits}: a commit that an interrupted run never finished")
            self._log_fd = os.open(commits, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))
            self._log_end = end
            self.manifest["format"] = MANIFEST_FORMAT
            self.manifest["versions"] = versions()
            self.manifest.setdefault("sessions", []).append({"started": time.time(), "pid": os.getpid()})
            atomic_write(os.path.join(path, JOB_FILE), job_yaml.encode("utf-8"), fault="job")
        except OSError as e:
            raise io_failure(e, f"the run directory {path}") from e
        self._save()

    def _remove_leftovers(self, log: Callable[[str], None]) -> None:
        """Delete what no record names: shard files of commits that never completed, temp files."""
        recorded = {os.path.basename(e["file"]) for e in self.manifest["shards"]}
        shard_dir = os.path.join(self.path, SHARDS)
        for name in sorted(os.listdir(shard_dir)):
            if name not in recorded:
                p = os.path.join(shard_dir, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                else:
                    os.remove(p)
                log(f"removed {p}: written but never committed by an earlier, interrupted run")
        for tmp in (MANIFEST + ".tmp", COMMITS + ".tmp", JOB_FILE + ".tmp"):
            if os.path.lexists(os.path.join(self.path, tmp)):
                os.remove(os.path.join(self.path, tmp))

    # ---------------------------------------------------------------- state
    @property
    def shards(self) -> List[Dict]:
        return self.manifest["shards"]

    def committed_keys(self) -> CommittedKeys:
        """(row, sample) of every committed output row (checked when the run directory opened)."""
        if self._committed is None:
            self._committed = verify_shards(self.path, self.manifest)
        return self._committed.keys()

    def next_shard_file(self) -> str:
        n = max((int(e["file"].rsplit("-", 1)[1].split(".")[0]) for e in self.shards), default=-1) + 1
        return f"{SHARDS}/part-{n:05d}.parquet"

    def record_shard(self, entry: Dict) -> None:
        """The commit: append the shard's record to commits.jsonl and fsync it. On an error the
        line is cut off again (the next start deletes the shard file) and the error raised."""
        if self._log_fd is None:
            raise RunError(f"{os.path.join(self.path, COMMITS)} could not be restored after a failed write; "
                           "run the same command again to continue")
        line = _line(entry)
        try:
            written = 0
            while written < len(line):
                written += os.write(self._log_fd, line[written:])
            faults.hit("commit.appended")
            os.fsync(self._log_fd)
        except BaseException as e:
            self._cut()
            if isinstance(e, OSError):
                raise io_failure(e, os.path.join(self.path, COMMITS)) from e
            raise
        self._log_end += len(line)
        self.manifest["shards"].append(entry)
        self._committed = None

    def _cut(self) -> None:
        """Take a line that failed to commit off the log; if even that fails, commit nothing more."""
        try:
            os.ftruncate(self._log_fd, self._log_end)
        except OSError:
            os.close(self._log_fd)
            self._log_fd = None

    def finish(self) -> None:
        """The session's end, in its record; manifest.json lists every shard from now on."""
        self.manifest["sessions"][-1]["finished"] = time.time()
        self._save()

    def update(self, **fields) -> None:
        self.manifest.update(fields)
        self._save()

    def _save(self) -> None:
        """Rewrite manifest.json listing every committed shard, then empty the log (its shards are
        listed now): a session's start and end each cost O(shards), a commit stays constant."""
        self.manifest["updated"] = time.time()
        data = json.dumps({k: v for k, v in self.manifest.items() if k != LISTED}, indent=1, sort_keys=True)
        try:
            atomic_write(os.path.join(self.path, MANIFEST), data.encode("utf-8"), fault="manifest")
        except OSError as e:
            raise io_failure(e, os.path.join(self.path, MANIFEST)) from e
        self.manifest[LISTED] = len(self.shards)
        faults.hit("log.listed")
        if self._log_fd is not None and self._log_end:
            try:
                os.ftruncate(self._log_fd, 0)
                os.fsync(self._log_fd)
                self._log_end = 0
            except OSError as e:  # the records stay in both files, where they count once
                raise io_failure(e, os.path.join(self.path, COMMITS)) from e

    def close(self) -> None:
        for name in ("_log_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)  # closing the lock's descriptor drops the flock
                setattr(self, name, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
