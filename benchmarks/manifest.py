"""Commit cost: bytes written per shard commit as a run grows, and the time a resume takes to open it.

Commits `--shards` shards of 10 output rows each through the real sink (`RunDir.prepare`,
`ShardWriter`) into `--out`, then opens the run again as a resume does (`RunDir.prepare` and
the committed keys). Bytes written by a commit are counted from the run directory: the new
shard, each top-level file that was replaced (its whole size) and each that grew (the growth).
A commit whose cost grows with the number of shards before it shows here as a rising figure.

    python -m benchmarks.run --suite cpu --parts manifest --shards 10000 --out DIR
    python -m benchmarks.manifest --shards 10000 --out DIR      (the same, alone)
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Dict, List, Tuple

from pipelines.io.checkpoint import RunDir
from pipelines.io.columns import output_schema
from pipelines.io.sink import ShardWriter, empty_row

WINDOW = 100  # commits averaged for the figures at the start and at the end


def top_files(run_dir: str) -> Dict[str, Tuple[int, int]]:
    """name -> (inode, size) of the plain files directly in RUN_DIR."""
    return {e.name: (e.inode(), e.stat().st_size) for e in os.scandir(run_dir) if e.is_file()}


def bytes_written(before: Dict[str, Tuple[int, int]], after: Dict[str, Tuple[int, int]]) -> int:
    """Bytes a commit wrote to the top-level files: a replaced or new file whole, a grown one its growth."""
    total = 0
    for name, (ino, size) in after.items():
        old = before.get(name)
        total += size if old is None or old[0] != ino else max(size - old[1], 0)
    return total


def make_row(schema, index: int, chars: int):
    row = empty_row(schema)
    row.update(id=f"row-{index}", row=index, sample=0, completion=("lorem ipsum " * chars)[:chars],
               finish_reason="stop", prompt_tokens=20, completion_tokens=chars // 4, seed=index)
    return row


def mean(xs: List[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def main(argv=None) -> Dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=10_000, help="shards to commit")
    ap.add_argument("--rows", type=int, default=10, help="output rows per shard")
    ap.add_argument("--chars", type=int, default=400, help="characters per completion")
    ap.add_argument("--out", required=True, help="directory for the run (replaced)")
    args = ap.parse_args(argv)

    run_dir = os.path.join(os.path.abspath(args.out), "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    parts = {"benchmark": "manifest"}
    schema = output_schema()
    per_commit: List[int] = []
    seconds: List[float] = []
    quiet = lambda msg: None  # noqa: E731
    every = max(args.shards // 10, 1)

    with RunDir.prepare(run_dir, "name: manifest-bench\n", parts, log=quiet) as run:
        state = {"files": top_files(run_dir), "t": time.perf_counter()}

        def on_commit(entry):
            now, files = time.perf_counter(), top_files(run_dir)
            per_commit.append(entry["bytes"] + bytes_written(state["files"], files))
            seconds.append(now - state["t"])
            state["files"], state["t"] = files, now
            n = len(per_commit)
            if n % every == 0 or n == WINDOW:
                print(f"shards {n:>6}: {mean(per_commit[-WINDOW:]):>12,.0f} bytes/commit, "
                      f"{1e3 * mean(seconds[-WINDOW:]):7.2f} ms/commit (mean of the last {min(n, WINDOW)})",
                      flush=True)

        sink = ShardWriter(run, schema, args.rows, on_commit)
        for i in range(args.shards * args.rows):
            sink.add(make_row(schema, i, args.chars))
        sink.flush()

    t = time.perf_counter()
    with RunDir.prepare(run_dir, "name: manifest-bench\n", parts, log=quiet) as run:
        keys = run.committed_keys()
    resume = time.perf_counter() - t
    assert len(keys) == args.shards * args.rows

    first, last = mean(per_commit[:WINDOW]), mean(per_commit[-WINDOW:])
    total = sum(per_commit)
    shard_bytes = os.path.getsize(os.path.join(run_dir, "shards", sorted(os.listdir(os.path.join(run_dir, "shards")))[0]))
    print(f"{args.shards} shards x {args.rows} rows ({shard_bytes:,} bytes a shard)")
    print(f"bytes written per commit: {first:,.0f} (first {WINDOW}), {last:,.0f} (last {WINDOW}); "
          f"{total / 1e6:,.1f} MB in all")
    print(f"time per commit: {1e3 * mean(seconds[:WINDOW]):.2f} ms (first {WINDOW}), "
          f"{1e3 * mean(seconds[-WINDOW:]):.2f} ms (last {WINDOW})")
    print(f"resume (open the run, verify it, read its {len(keys):,} committed keys): {resume:.2f} s")
    return {"first_bytes": first, "last_bytes": last, "total_bytes": total, "resume_s": resume}


def run(opts, report) -> None:
    """The suite's `manifest` part: the run goes under OUT/manifest-run, the figures into the report."""
    got = main(["--shards", str(opts.shards), "--out", os.path.join(opts.out, "manifest-run")])
    report.row(f"{opts.shards} shard commits", **{"bytes a commit, first 100": round(got["first_bytes"]),
                                                  "bytes a commit, last 100": round(got["last_bytes"]),
                                                  "MB written": round(got["total_bytes"] / 1e6, 1),
                                                  "resume s": round(got["resume_s"], 2)})


if __name__ == "__main__":
    main()
