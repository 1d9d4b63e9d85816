"""What a run's committed shards say, read back for `report` and `export`: row and token counts,
acceptance, the slowest rows, errors by kind, and the progress the run recorded.

Only shards recorded in the manifest are read, each checked against its sha256 first, so a run in
progress gives a consistent snapshot and a corrupt shard is refused by name.
Reading is streamed shard by shard, with only the columns needed.

Numbers, and where they come from:
- wall time: the sum of the shards' `elapsed` (active time, gaps between sessions excluded);
  rows/s and tok/s divide by it, like `mtplx-batch status` (figures.py defines both).
- acceptance by depth: sum over rows of `accepted_by_depth[d]` (verifies in which the drafted
  token at depth d+1 was accepted) / sum of `verify_calls`; "given depth d-1" divides by the
  count at the previous depth instead.
- tokens per verify histogram: exact, from the same counts: verifies that accepted exactly k
  drafts = by_depth[k-1] - by_depth[k]; each emits k + 1 tokens.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import pyarrow.parquet as pq

from mtplx.request import tokens_per_verify

from ..errors import JobError
from ..job.columns import REPORT_COLUMNS
from .records import JOB_FILE, PROGRESS_FILE, Committed, planned_outputs, read_manifest, verify_shards
from .figures import acceptance_rate, per_second

TOP_SLOW = 20  # the slowest rows kept


# ------------------------------------------------------------------------------ error kinds
_KINDS: List[Tuple[str, re.Pattern]] = [
    ("unsupported request", re.compile(r"^openai-batch:")),
    ("unreadable input row", re.compile(r"^\S.* line \d+(:| is | has )")),
    ("too long for context", re.compile(r"context holds|model's context is")),
    ("memory budget", re.compile(r"memory_budget")),
    ("bad id", re.compile(r"id column|duplicate id|identical to an earlier row")),
    ("keep column", re.compile(r"^keep column")),
    ("bad prompt", re.compile(r"prompt|template|messages|is null|not a string|UTF-8|surrogate|non-finite|"
                              r"is nan|is inf|no column|tokenizes to nothing|empty")),
]


def error_kind(message: Optional[str]) -> str:
    """A short class for an error message: what `report` groups by and export uses as a code."""
    if not message:
        return "engine"
    for kind, pattern in _KINDS:
        if pattern.search(message):
            return kind
    return "engine"


# ------------------------------------------------------------------------------ reading a run
def read_job(run_dir: str) -> Dict[str, Any]:
    import yaml

    path = os.path.join(run_dir, JOB_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except FileNotFoundError:
        return {}
    except Exception as e:
        raise JobError(f"{path}: unreadable ({e})")


@dataclass
class RunStats:
    run_dir: str
    job: Dict[str, Any]
    manifest: Dict[str, Any]
    rows: int = 0
    ok: int = 0
    errors: int = 0
    finish: Counter = field(default_factory=Counter)
    error_kinds: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    by_depth: List[int] = field(default_factory=list)
    compiled_calls: int = 0
    eager_calls: int = 0
    parity_failures: int = 0
    decode_seconds: float = 0.0
    active_seconds: float = 0.0
    span_seconds: float = 0.0
    expected_rows: Optional[int] = None
    slowest: List[Dict[str, Any]] = field(default_factory=list)
    error_rows: List[Dict[str, Any]] = field(default_factory=list)
    prompt_lengths: List[int] = field(default_factory=list)
    completion_lengths: List[int] = field(default_factory=list)
    timeline: List[Dict[str, Any]] = field(default_factory=list)  # one entry per shard, commit order
    sessions: List[float] = field(default_factory=list)
    progress: List[Dict[str, Any]] = field(default_factory=list)  # RUN_DIR/progress.jsonl, in time order

    # ------------------------------------------------------------------ derived
    @property
    def rows_per_second(self) -> float:
        return per_second(self.rows, self.active_seconds)

    @property
    def tokens_per_second(self) -> float:
        return per_second(self.completion_tokens, self.active_seconds)

    @property
    def acceptance_rate(self) -> Optional[float]:
        return acceptance_rate(self.accepted, self.drafted)

    @property
    def tokens_per_verify(self) -> Optional[float]:
        return tokens_per_verify(self.accepted, self.verify_calls)

    def depth_rates(self) -> List[Tuple[int, float, Optional[float]]]:
        """(depth, P(accepted at depth), P(accepted at depth | accepted at depth-1)) for d = 1..D."""
        out = []
        prev = self.verify_calls
        for d, n in enumerate(self.by_depth, 1):
            out.append((d, n / self.verify_calls if self.verify_calls else 0.0, n / prev if prev else None))
            prev = n
        return out

    def verify_histogram(self) -> List[Tuple[int, int]]:
        """(tokens emitted by one verify, number of verifies), exact."""
        counts = [self.verify_calls] + list(self.by_depth) + [0]
        return [(k + 1, counts[k] - counts[k + 1]) for k in range(len(counts) - 1)]

    def summary(self) -> Dict[str, Any]:
        spec = self.job.get("speculative") or {}
        return {
            "run_dir": self.run_dir,
            "job": self.job.get("name"),
            "model": (self.job.get("model") or {}).get("path"),
            "speculative": {k: spec.get(k) for k in ("method", "depth", "compiled_verify", "adaptive_depth")},
            "rows": self.rows,
            "rows_ok": self.ok,
            "rows_errored": self.errors,
            "rows_expected": self.expected_rows,
            "rows_left": None if self.expected_rows is None else max(self.expected_rows - self.rows, 0),
            "finish_reasons": dict(self.finish),
            "errors_by_kind": dict(self.error_kinds),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "wall_seconds": self.active_seconds,
            "span_seconds": self.span_seconds,
            "sessions": len(self.sessions),
            "rows_per_second": self.rows_per_second,
            "tokens_per_second": self.tokens_per_second,
            "verify_calls": self.verify_calls,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_verify": self.tokens_per_verify,
            "accepted_by_depth": list(self.by_depth),
            "acceptance_by_depth": [{"depth": d, "rate": r, "given_previous": g} for d, r, g in self.depth_rates()],
            "tokens_per_verify_histogram": {str(k): n for k, n in self.verify_histogram()} if self.verify_calls else {},
            "compiled_verify_calls": self.compiled_calls,
            "eager_verify_calls": self.eager_calls,
            "parity_failures": self.parity_failures,
            "shards": len(self.timeline),
            "slowest_rows": self.slowest,
        }


def collect(run_dir: str, top: int = TOP_SLOW, committed: Optional[Committed] = None) -> RunStats:
    """Streams the committed shards of RUN_DIR into RunStats, each checked against its recorded
    sha256 first (`committed`: the shards as the caller verified them already)."""
    manifest = read_manifest(run_dir)
    if committed is None:
        committed = verify_shards(run_dir, manifest, checksums=True)
    st = RunStats(run_dir=os.path.abspath(run_dir), job=read_job(run_dir), manifest=manifest)
    st.expected_rows = planned_outputs(manifest)
    st.sessions = sorted(s.get("started", 0.0) for s in manifest.get("sessions", []))
    st.progress = read_progress(run_dir)
    heap: List[Tuple[float, int, Dict[str, Any]]] = []
    k = 0
    for entry, path in zip(manifest["shards"], committed.files):
        pf = pq.ParquetFile(path)
        cols = [c for c in REPORT_COLUMNS if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(columns=cols):
            for r in batch.to_pylist():
                st.rows += 1
                st.finish[r.get("finish_reason")] += 1
                st.prompt_tokens += r.get("prompt_tokens") or 0
                st.cached_prompt_tokens += r.get("cached_prompt_tokens") or 0
                if r.get("finish_reason") == "error":
                    st.errors += 1
                    kind = error_kind(r.get("error"))
                    st.error_kinds[kind] += 1
                    st.error_rows.append({"id": r.get("id"), "row": r.get("row"), "sample": r.get("sample"),
                                          "kind": kind, "error": r.get("error")})
                    continue
                st.ok += 1
                ct = r.get("completion_tokens") or 0
                st.completion_tokens += ct
                st.prompt_lengths.append(r.get("prompt_tokens") or 0)
                st.completion_lengths.append(ct)
                st.verify_calls += r.get("verify_calls") or 0
                st.drafted += r.get("drafted_tokens") or 0
                st.accepted += r.get("accepted_tokens") or 0
                for d, n in enumerate(r.get("accepted_by_depth") or []):
                    if d >= len(st.by_depth):
                        st.by_depth.append(0)
                    st.by_depth[d] += n or 0
                st.compiled_calls += r.get("compiled_verify_calls") or 0
                st.eager_calls += r.get("eager_verify_calls") or 0
                st.parity_failures += r.get("parity_failures") or 0
                secs = r.get("decode_seconds") or 0.0
                st.decode_seconds += secs
                item = {"id": r.get("id"), "row": r.get("row"), "sample": r.get("sample"),
                        "decode_seconds": secs, "completion_tokens": ct, "prompt_tokens": r.get("prompt_tokens"),
                        "tokens_per_second": ct / secs if secs else None, "batch_width": r.get("batch_width"),
                        "finish_reason": r.get("finish_reason")}
                k += 1
                if len(heap) < top:
                    heapq.heappush(heap, (secs, k, item))
                elif heap and secs > heap[0][0]:
                    heapq.heapreplace(heap, (secs, k, item))
        st.active_seconds += entry.get("elapsed", 0.0) or 0.0
        st.timeline.append({"file": entry["file"], "committed": entry.get("committed"), "rows": entry.get("rows", 0),
                            "errors": entry.get("errors", 0), "completion_tokens": entry.get("completion_tokens", 0),
                            "elapsed": entry.get("elapsed", 0.0)})
    st.slowest = [item for _, _, item in sorted(heap, key=lambda t: (-t[0], t[1]))]
    st.error_rows.sort(key=lambda e: (e["row"] if e["row"] is not None else -1, e["sample"] or 0))
    commits = [t["committed"] for t in st.timeline if t.get("committed")]
    if commits:
        start = min(st.sessions[0] if st.sessions else commits[0], commits[0] - (st.timeline[0]["elapsed"] or 0))
        st.span_seconds = max(commits) - start
    return st


def read_progress(run_dir: str) -> List[Dict[str, Any]]:
    """The progress lines a run recorded (pipelines/execution/progress.py), oldest first; torn lines
    and lines whose time or token count is not a number skipped."""
    out = []
    try:
        with open(os.path.join(run_dir, PROGRESS_FILE), encoding="utf-8") as f:
            for line in f:
                try:
                    p = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if isinstance(p, dict) and {"ts", "session", "generated"} <= p.keys() and \
                        all(isinstance(p[k], (int, float)) and not isinstance(p[k], bool) for k in ("ts", "generated")):
                    out.append(p)
    except OSError:
        return []
    return sorted(out, key=lambda p: p["ts"])
