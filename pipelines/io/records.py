"""A run directory's records, read and checked: which shards are committed (manifest.json lists
those up to its last rewrite, commits.jsonl those since; checkpoint.py writes both) and the rows
they hold. No function here writes.

What is checked, and by whom:
- every reader (run, validate, status, report, export): each record's form (a name
  shards/part-NNNNN.parquet, counts that are counts, a sha256, no shard recorded twice), and
  that each shard is a regular file of its recorded size inside RUN_DIR/shards, not a link out
  of it; `status`, which reads no shard, also that the records count no more rows than the input has;
- a resume (run, validate) also reads every shard's (row, sample) keys, with the pages' own
  checksums verified: their number must be the recorded one, none committed twice, none outside
  the input. It does not hash the shards: each was fsynced before its commit, and the bytes a
  resume does not read (the completions) cannot change which rows it skips;
- report and export also check each shard's sha256 before using any of its rows.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import JobError
from ..job.columns import SUMMED_COLUMNS
from ..job.fingerprint import sha256_file

MANIFEST = "manifest.json"
COMMITS = "commits.jsonl"
JOB_FILE = "job.yaml"
SHARDS = "shards"
LOCK = ".lock"
PROGRESS_FILE = "progress.jsonl"  # throughput over time, written by the session (execution/progress.py)
# Format 1 listed every shard in manifest.json (no log), format 2 none (every shard in the log): both
# are read, and rewritten as this format on resume. A reader of format 2 alone would miss the listed shards.
MANIFEST_FORMAT = 3
LISTED = "_listed"  # (in memory only) how many of "shards" manifest.json lists; the log holds the rest
OWN_FILES = {MANIFEST, COMMITS, JOB_FILE, SHARDS, LOCK, PROGRESS_FILE,
             MANIFEST + ".tmp", COMMITS + ".tmp", JOB_FILE + ".tmp"}
SHARD_FILE = re.compile(r"shards/part-[0-9]{5,}\.parquet")  # the only names a record may hold
SHA256 = re.compile(r"[0-9a-f]{64}")
RESTART = "start over with --restart (the old run is moved aside, not deleted)"


def _read_own(path: str) -> bytes:
    """A file of the run directory itself, never through a symbolic link."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _is_header(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("fingerprint"), str) and \
        isinstance(obj.get("fingerprint_parts"), dict)


def is_run(path: str) -> bool:
    """Whether the directory `path` is a run: it holds an mtplx-batch manifest.json, or nothing
    but the files a run writes (a run just begun, or one whose manifest was lost)."""
    names = set(os.listdir(path))
    if names <= OWN_FILES:
        return True
    try:
        return _is_header(json.loads(_read_own(os.path.join(path, MANIFEST))))
    except (OSError, ValueError):
        return False


def _damaged(run_dir: str) -> str:
    """The end of a refusal of a damaged manifest: the fix, which depends on whether this is a run."""
    if is_run(run_dir):
        return f"the run directory is damaged, {RESTART}"
    return f"{run_dir} is not a run directory: point output.dir at a new or empty directory"


def read_commits(run_dir: str) -> Tuple[List, int]:
    """The records in commits.jsonl, and the length of its complete lines. A last line without
    its newline is a commit that never returned (a kill or a power cut mid-append): not a commit."""
    path = os.path.join(run_dir, COMMITS)
    try:
        data = _read_own(path)
    except FileNotFoundError:
        raise JobError(f"{path}: missing, so which shards were committed is unknown; restore it, or {RESTART}")
    except OSError as e:
        raise JobError(f"{path}: unreadable ({e}); restore it, or {RESTART}")
    end = data.rfind(b"\n") + 1
    records = []
    for n, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            raise JobError(f"{path} line {n}: not a commit record; the run directory is damaged. Delete the "
                           f"line (a resume then generates that shard's rows again), or {RESTART}") from None
    return records, end


def load_manifest(run_dir: str) -> Tuple[Dict, Optional[int]]:
    """(manifest with every shard record under "shards": those it lists, then the log's; the
    length of the log's complete lines, or None for a format-1 run, which has no log)."""
    path = os.path.join(run_dir, MANIFEST)
    try:
        header = json.loads(_read_own(path))
    except FileNotFoundError:
        raise JobError(f"{run_dir}: no {MANIFEST}; not a run directory (run a job first: mtplx-batch run JOB.yaml)")
    except (OSError, ValueError) as e:
        raise JobError(f"{path}: unreadable ({e}); {_damaged(run_dir)}")
    if not _is_header(header):
        raise JobError(f"{path}: not a manifest of mtplx-batch (no fingerprint); {_damaged(run_dir)}")
    fmt = header.get("format")
    if fmt not in (1, 2, MANIFEST_FORMAT):
        raise JobError(f"{path}: format {fmt!r}, which this mtplx-batch does not read (formats 1 to "
                       f"{MANIFEST_FORMAT}); use the mtplx-batch that wrote it, or a newer one")
    listed = header.get("shards", []) if fmt != 2 else []
    if not isinstance(listed, list):
        raise JobError(f"{path}: not a manifest (its shards are not a list); {_damaged(run_dir)}")
    records, end = ([], None) if fmt == 1 else read_commits(run_dir)
    known = {json.dumps(e, sort_keys=True) for e in listed}
    records = [r for r in records if json.dumps(r, sort_keys=True) not in known]  # listed by a rewrite: once
    manifest = {**header, "shards": listed + records, LISTED: len(listed)}
    check_records(run_dir, manifest)
    return manifest, end


def read_manifest(run_dir: str) -> Dict:
    """manifest.json, with the committed shards' records under "shards", each checked for form
    (`check_records`); JobError naming the file and the fix otherwise. Opens no shard."""
    return load_manifest(run_dir)[0]


def record_file(manifest: Dict, entry: Optional[Dict] = None) -> str:
    """The file that holds `entry`'s record (None: every shard's, where they are all in one)."""
    listed = manifest.get(LISTED, 0)
    if entry is not None:
        return MANIFEST if any(e is entry for e in manifest["shards"][:listed]) else COMMITS
    if listed == len(manifest["shards"]):
        return MANIFEST
    return f"{MANIFEST} and {COMMITS}" if listed else COMMITS


def counters() -> Tuple[str, ...]:
    """The per-shard figures a record carries besides its rows, which `status` sums."""
    return ("errors", *SUMMED_COLUMNS, "elapsed")


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def check_records(run_dir: str, manifest: Dict) -> None:
    """The form of the manifest's counts and of every shard record: a file named
    shards/part-NNNNN.parquet (nothing else is ever opened), counts that are counts, a sha256, no
    file recorded twice."""
    sessions = manifest.get("sessions", [])
    bad = [k for k in ("input_rows", "planned_rows", "samples", "limit")
           if manifest.get(k) is not None and not _count(manifest[k])]
    bad += [k for k in ("created", "updated") if k in manifest and not _number(manifest[k])]
    if not isinstance(sessions, list) or not all(isinstance(s, dict) and _number(s.get("started")) for s in sessions):
        bad.append("sessions")
    if bad:
        raise JobError(f"{os.path.join(run_dir, MANIFEST)}: no valid {', '.join(bad)}; the run directory is damaged, "
                       f"{RESTART}")
    seen: Dict[str, str] = {}
    listed = manifest.get(LISTED, 0)
    for n, entry in enumerate(manifest["shards"], 1):
        where = os.path.join(run_dir, MANIFEST if n <= listed else COMMITS)
        n = n if n <= listed else n - listed  # the record's place in its file
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
            raise JobError(f"{where}: record {n} names {name!r}, which is not a shard of this run directory "
                           f"(shards/part-NNNNN.parquet); the run directory is damaged, {RESTART}")
        bad = [k for k in ("rows", "bytes") if not _count(entry.get(k))]
        bad += [k for k in (*counters(), "committed") if k in entry and not _number(entry[k])]
        if not isinstance(entry.get("sha256"), str) or not SHA256.fullmatch(entry["sha256"]):
            bad.append("sha256")
        if bad:
            raise JobError(f"{where}: record {n} ({name}) has no valid {', '.join(bad)}; the run directory is damaged, "
                           f"{RESTART}")
        if name in seen:
            raise JobError(f"{name} is recorded twice ({seen[name]} and {where} record {n}); the run directory "
                           f"is damaged. Delete the second record, or {RESTART}")
        seen[name] = f"{where} record {n}"


def _shard_fix(manifest: Dict, entry: Dict) -> str:
    return (f"Restore the file, or delete its record from {record_file(manifest, entry)} (a resume then generates "
            f"its rows again), or {RESTART}")


def shard_path(run_dir: str, entry: Dict, manifest: Dict) -> str:
    """The path of a recorded shard, once it is a regular file of its recorded size in
    RUN_DIR/shards (no symbolic link leads out of the run directory)."""
    f = os.path.join(run_dir, entry["file"])
    real = os.path.realpath(f)
    if real != os.path.join(os.path.realpath(run_dir), entry["file"]):
        raise JobError(f"{f}: a link to {real}; a shard must be a file in {os.path.join(run_dir, SHARDS)}, "
                       f"and this one is not read. {_shard_fix(manifest, entry)}")
    try:
        st = os.stat(f)
    except FileNotFoundError:
        raise JobError(f"{f}: recorded in {record_file(manifest, entry)} but missing; its rows cannot be counted. "
                       f"{_shard_fix(manifest, entry)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise JobError(f"{f}: not a regular file. {_shard_fix(manifest, entry)}")
    if st.st_size != entry["bytes"]:
        raise JobError(f"{f}: {st.st_size} bytes, {record_file(manifest, entry)} records {entry['bytes']}; the "
                       f"shard is torn or corrupt. {_shard_fix(manifest, entry)}")
    return f


def check_unread(run_dir: str, manifest: Dict) -> None:
    """What `status` checks, reading no shard: each `shard_path`, and that the records count no
    more output rows than the input has (input rows x samples), the counts it reports."""
    for entry in manifest["shards"]:
        shard_path(run_dir, entry, manifest)
    rows, samples = manifest.get("input_rows"), manifest.get("samples")
    total = sum(e["rows"] for e in manifest["shards"])
    if rows is not None and samples is not None and total > rows * samples:
        raise JobError(f"{os.path.join(run_dir, record_file(manifest))}: records {total} output rows, more than the "
                       f"input has ({rows} rows x {samples} samples); the run directory is damaged, {RESTART}")


@dataclass
class Committed:
    """The committed output rows of a run: each one's (row, sample), shard (index into `files`)
    and offset in it; `order` sorts them by (row, sample)."""

    files: List[str]
    row: np.ndarray
    sample: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    order: np.ndarray

    def keys(self) -> "CommittedKeys":
        return CommittedKeys((self.row[self.order] << 32) | self.sample[self.order])  # sorted already


class CommittedKeys:
    """The (row, sample) keys of committed output rows, as one sorted int64 array (row << 32 | sample):
    at 10M rows it holds 80 MB and answers `in` by binary search, where a set of tuples holds over a GB."""

    def __init__(self, codes: np.ndarray):
        self.codes = codes  # sorted, each key once

    @classmethod
    def of(cls, row, sample) -> "CommittedKeys":
        return cls(np.unique((np.asarray(row, np.int64) << 32) | np.asarray(sample, np.int64)))

    def __contains__(self, key) -> bool:
        code = (int(key[0]) << 32) | int(key[1])
        i = int(np.searchsorted(self.codes, code))
        return i < len(self.codes) and int(self.codes[i]) == code

    def __len__(self) -> int:
        return len(self.codes)

    def __iter__(self):
        return ((c >> 32, c & 0xFFFFFFFF) for c in self.codes.tolist())

    def rows_below(self, rows: int) -> int:
        """Keys whose row is below `rows`."""
        return int(np.searchsorted(self.codes, rows << 32))

    def has_all(self, rows: int, n: int) -> bool:
        """Whether every (row, sample) with row < `rows` and sample < `n` is committed."""
        codes = self.codes[: self.rows_below(rows)]
        return int(np.count_nonzero((codes & 0xFFFFFFFF) < n)) == rows * n

    def flat(self, n: int) -> np.ndarray:
        """Each key as row * n + sample (samples below `n`)."""
        return (self.codes >> 32) * n + (self.codes & 0xFFFFFFFF)


def _shard_keys(f: str, entry: Dict, manifest: Dict) -> Tuple[np.ndarray, np.ndarray]:
    """A shard's row and sample columns, its pages' checksums verified (shards carry them)."""
    try:
        t = pq.ParquetFile(f, page_checksum_verification=True).read(columns=["row", "sample"])
        cols = [t.column(c) for c in ("row", "sample")]
        if any(c.null_count or not pa.types.is_integer(c.type) for c in cols):
            raise ValueError("row and sample must be integers")
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise JobError(f"{f}: unreadable as a shard ({e}); the shard is torn or corrupt. {_shard_fix(manifest, entry)}")
    if t.num_rows != entry["rows"]:
        raise JobError(f"{f}: holds {t.num_rows} rows, {record_file(manifest, entry)} says {entry['rows']}; the run "
                       f"directory is damaged. {_shard_fix(manifest, entry)}")
    return tuple(c.to_numpy().astype(np.int64) for c in cols)


def verify_shards(run_dir: str, manifest: Dict, checksums: bool = False) -> Committed:
    """Read-only check of the shards the manifest records (`shard_path`), of their (row, sample)
    keys (their count, none twice, none outside the input) and, with `checksums`, of each file's
    sha256. Returns the committed rows; JobError naming the file and the fix otherwise."""
    files, rows, samples = [], [], []
    for entry in manifest["shards"]:
        f = shard_path(run_dir, entry, manifest)
        if checksums and sha256_file(f) != entry["sha256"]:
            raise JobError(f"{f}: its sha256 does not match {record_file(manifest, entry)}; the shard is corrupt. "
                           f"{_shard_fix(manifest, entry)}")
        r, s = _shard_keys(f, entry, manifest)
        files.append(f)
        rows.append(r)
        samples.append(s)
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
    row, sample = cat(rows), cat(samples)
    shard = cat([np.full(len(r), i, dtype=np.int64) for i, r in enumerate(rows)])
    offset = cat([np.arange(len(r), dtype=np.int64) for r in rows])
    order = np.lexsort((sample, row))
    r, s = row[order], sample[order]
    twice = np.nonzero((r[1:] == r[:-1]) & (s[1:] == s[:-1]))[0]
    if twice.size:
        i = twice[0]
        a, b = (os.path.basename(files[shard[order[j]]]) for j in (i, i + 1))
        raise JobError(f"{run_dir}: row {r[i]} sample {s[i]} is committed twice ({a} and {b}); the run directory "
                       f"is damaged (a shard copied in by hand?). Delete the extra shard's record from "
                       f"{record_file(manifest)}, or {RESTART}")
    n_rows, n_samples = manifest.get("input_rows"), manifest.get("samples")
    if n_rows is not None and n_samples is not None and row.size:
        out = np.nonzero((row < 0) | (row >= n_rows) | (sample < 0) | (sample >= n_samples))[0]
        if out.size:
            i = out[0]
            raise JobError(f"{files[shard[i]]}: holds row {row[i]} sample {sample[i]}, outside the input ({n_rows} "
                           f"rows x {n_samples} samples); the run directory is damaged. "
                           f"{_shard_fix(manifest, manifest['shards'][shard[i]])}")
    return Committed(files, row, sample, shard, offset, order)


def planned_outputs(manifest: Dict) -> Optional[int]:
    """Output rows the run is to write: the input rows it plans (`planned_rows`, fewer than
    `input_rows` under input.limit / --limit) x samples per row; None while unknown."""
    rows = manifest.get("planned_rows", manifest.get("input_rows"))
    return None if rows is None else rows * (manifest.get("samples") or 1)


def totals(manifest: Dict) -> Dict[str, float]:
    """Sums of the per-shard counters kept in the manifest (what `status` reports)."""
    keys = ("rows", *counters())
    out = {k: 0 for k in keys}
    for entry in manifest.get("shards", []):
        for k in keys:
            out[k] += entry.get(k, 0)
    return out
