"""Parquet shards with a schema fixed before the first row, committed through the run's commit log.

The schema is built once from DESIGN.md's columns plus the keep_columns (typed from the input
schema), and every shard is written with it, so a shard of successes and a shard of errors are
interchangeable to pyarrow.dataset, datasets, pandas and DuckDB.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.parquet as pq

from ..job.columns import SUMMED_COLUMNS
from ..job.fingerprint import sha256_file
from . import faults
from .checkpoint import RunDir, io_failure
from .fsutil import publish, remove_quietly

def empty_row(schema: pa.Schema) -> Dict[str, Any]:
    return {name: None for name in schema.names}


@contextmanager
def signals_deferred():
    """SIGINT / SIGTERM arriving inside the block take effect right after it, so an interrupt never
    abandons a shard commit half way. Only the main thread can set handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if current is not None:  # None: a handler set outside Python, left alone
            old[sig] = signal.signal(sig, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum, frame in pending[:1]:
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)  # e.g. raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


class ShardWriter:
    """Buffers output rows; every `shard_rows` rows (and at `flush`) commits one shard."""

    def __init__(self, run: RunDir, schema: pa.Schema, shard_rows: int, on_commit=None):
        self.run = run
        self.schema = schema
        self.shard_rows = shard_rows
        self.on_commit = on_commit
        self.buffer: List[Dict[str, Any]] = []
        self._since = time.monotonic()
        self.rows_written = 0

    def start_clock(self) -> None:
        """Generation starts now: the first shard's `elapsed` counts from here (figures.py: active seconds)."""
        self._since = time.monotonic()

    def add(self, row: Dict[str, Any]) -> None:
        self.buffer.append(row)
        faults.hit("row.emitted")
        if len(self.buffer) >= self.shard_rows:
            self.flush()

    def flush(self) -> None:
        """Commit the buffered rows as one shard. A write failure (a full disk) raises RunError;
        those rows are then not committed, and a resume generates them again."""
        if not self.buffer:
            return
        with signals_deferred():
            rows, self.buffer = self.buffer, []
            self._commit(rows)

    def _commit(self, rows: List[Dict[str, Any]]) -> None:
        table = pa.Table.from_pylist(rows, schema=self.schema)
        rel = self.run.next_shard_file()
        final = os.path.join(self.run.path, rel)
        tmp = os.path.join(os.path.dirname(final), "." + os.path.basename(final) + ".tmp")
        try:
            pq.write_table(table, tmp, write_page_checksum=True)  # a resume reads the keys with them verified
            publish(tmp, final, fault="shard")
        except OSError as e:  # pyarrow's I/O errors are OSErrors too
            remove_quietly(tmp)
            raise io_failure(e, f"shard {final} ({len(rows)} rows)") from e
        faults.hit("shard.renamed")
        now = time.monotonic()
        entry = {
            "file": rel,
            "rows": len(rows),
            "bytes": os.path.getsize(final),
            "sha256": sha256_file(final),
            "errors": sum(r["finish_reason"] == "error" for r in rows),
            "elapsed": now - self._since,  # active time this shard took; status sums these
            "committed": time.time(),
        }
        for key in SUMMED_COLUMNS:
            entry[key] = sum(r[key] or 0 for r in rows)
        self.run.record_shard(entry)  # the commit point; an unrecorded file is deleted on the next start
        faults.hit("shard.recorded")
        self._since = now
        self.rows_written += len(rows)
        if self.on_commit:
            self.on_commit(entry)
