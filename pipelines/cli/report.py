"""`mtplx-batch report RUN_DIR`: what a run did, as files a person can open.

Written to RUN_DIR/report/ (or --out DIR):
    index.html               self-contained (plots embedded as base64 PNG); open it in a browser
    summary.json             every number on the page, for scripts
    errors.jsonl             every errored output row: id, row, sample, kind, error
    throughput.png           generated tokens/s over wall-clock time, per interval of the progress the
                             run recorded (RUN_DIR/progress.jsonl), and rows committed (shard commits)
    acceptance_by_depth.png  share of verifies whose draft survived to depth d   (speculative runs)
    tokens_per_verify.png    histogram of tokens emitted per verify            (speculative runs)
    lengths.png              prompt and completion token counts per row

Only shards recorded in the manifest are read, so a report of a run in progress is a consistent
snapshot. Reading is streamed shard by shard, with only the columns needed.

Numbers, and where they come from:
- wall time: the sum of the shards' `elapsed` (active time, gaps between sessions excluded);
  rows/s and tok/s divide by it, like `mtplx-batch status`.
- acceptance by depth: sum over rows of `accepted_by_depth[d]` (verifies in which the drafted
  token at depth d+1 was accepted) / sum of `verify_calls`; "given depth d-1" divides by the
  count at the previous depth instead.
- tokens per verify histogram: exact, from the same counts: verifies that accepted exactly k
  drafts = by_depth[k-1] - by_depth[k]; each emits k + 1 tokens.
"""

from __future__ import annotations

import base64
import datetime
import heapq
import html
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import pyarrow.parquet as pq

from mtplx.request import tokens_per_verify

from ..io.checkpoint import JOB_FILE, PROGRESS_FILE, planned_outputs, read_manifest
from ..errors import JobError
from ..io.columns import REPORT_COLUMNS
from .report_plots import PLOTS, pyplot

TOP_SLOW = 20
MAX_ERRORS_SHOWN = 200

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
        return self.rows / self.active_seconds if self.active_seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.active_seconds if self.active_seconds else 0.0

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None

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


def collect(run_dir: str, top: int = TOP_SLOW) -> RunStats:
    """Streams the committed shards of RUN_DIR into RunStats."""
    manifest = read_manifest(run_dir)
    st = RunStats(run_dir=os.path.abspath(run_dir), job=read_job(run_dir), manifest=manifest)
    st.expected_rows = planned_outputs(manifest)
    st.sessions = sorted(s.get("started", 0.0) for s in manifest.get("sessions", []))
    st.progress = read_progress(run_dir)
    heap: List[Tuple[float, int, Dict[str, Any]]] = []
    k = 0
    for entry in manifest.get("shards", []):
        path = os.path.join(run_dir, entry["file"])
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
    """The progress lines a run recorded (pipelines/progress.py), oldest first; torn lines skipped."""
    out = []
    try:
        with open(os.path.join(run_dir, PROGRESS_FILE), encoding="utf-8") as f:
            for line in f:
                try:
                    p = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                if isinstance(p, dict) and {"ts", "session", "generated"} <= p.keys():
                    out.append(p)
    except OSError:
        return []
    return sorted(out, key=lambda p: p["ts"])


# ------------------------------------------------------------------------------ html
def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _duration(s: float) -> str:
    s = float(s or 0)
    if s < 60:
        return f"{s:.1f}s"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _table(rows: List[Tuple[str, str]]) -> str:
    return "<table class='kv'>" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _grid(header: List[str], rows: List[List[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c, 3) if not isinstance(c, str) else c)}</td>"
                                    for c in r) + "</tr>" for r in rows)
    return f"<table class='grid'><tr>{head}</tr>{body}</table>"


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1000px;color:#222;
padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0}th,td{padding:.25em .7em;text-align:left;vertical-align:top}
table.kv th{color:#555;font-weight:normal;min-width:14em}table.grid th{background:#f3f3f3}
table.grid td,table.grid th{border:1px solid #ddd}td.err,table.grid td:last-child{word-break:break-word}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}.note{color:#666;font-size:.9em}
.bad{color:#b00020;font-weight:bold}.ok{color:#2e7d32}code{background:#f6f6f6;padding:0 .2em}
"""


def render_html(st: RunStats, images: Dict[str, bytes]) -> str:
    s = st.summary()
    job = st.job
    spec = job.get("speculative") or {}
    gen = job.get("generation") or {}
    inp = job.get("input") or {}
    drafting = bool(st.drafted)

    def img(name: str, alt: str) -> str:
        data = images.get(name)
        if not data:
            return ""
        return (f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(data).decode()}'>"
                f"<div class='note'>also saved as <code>{name}.png</code></div>")

    created = st.manifest.get("created")
    left = s["rows_left"]
    complete = left == 0
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>mtplx-batch report: "
             f"{html.escape(str(job.get('name', '')))}</title><style>{CSS}</style></head><body>"]
    parts.append(f"<h1>Run report: {html.escape(str(job.get('name', '?')))}</h1>")
    parts.append(f"<p class='note'>{html.escape(st.run_dir)} &middot; generated "
                 f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}"
                 + (f" &middot; run started {datetime.datetime.fromtimestamp(created).strftime('%Y-%m-%d %H:%M:%S')}"
                    if created else "") + "</p>")

    # --------------------------------------------------------------- summary
    parts.append("<h2>Summary</h2>")
    status = ("<span class='ok'>complete</span>" if complete else
              f"<span class='bad'>{_fmt(left)} rows left</span>" if left is not None else "unknown total")
    err_cls = "bad" if st.errors else "ok"
    parts.append(_table([
        ("model", html.escape(str((job.get("model") or {}).get("path", "?")))),
        ("input", html.escape(f"{inp.get('format', '?')}: {inp.get('path', '?')}")),
        ("generation", html.escape(", ".join(f"{k}={gen[k]}" for k in gen))),
        ("speculative", html.escape(", ".join(f"{k}={spec[k]}" for k in spec if spec[k] is not None))),
        ("status", status),
        ("output rows", f"{_fmt(st.rows)} of {_fmt(st.expected_rows)} expected"),
        ("errors", f"<span class='{err_cls}'>{_fmt(st.errors)}</span>"
                   + (f" ({st.errors / st.rows:.1%} of rows)" if st.rows else "")),
        ("finish reasons", html.escape(", ".join(f"{k}: {v}" for k, v in sorted(st.finish.items(), key=str)))),
        ("prompt tokens", f"{_fmt(st.prompt_tokens)} ({_fmt(st.cached_prompt_tokens)} reused from a shared prefix)"),
        ("completion tokens", _fmt(st.completion_tokens)),
        ("wall time (active)", f"{_duration(st.active_seconds)} over {len(st.sessions)} session(s); "
                               f"first start to last commit {_duration(st.span_seconds)}"),
        ("rows/s", _fmt(st.rows_per_second, 2)),
        ("tok/s (generated)", _fmt(st.tokens_per_second, 1)),
        ("shards", _fmt(len(st.timeline))),
    ]))
    if st.error_kinds:
        parts.append("<h3>Errors by kind</h3>")
        parts.append(_grid(["kind", "rows"], [[k, v] for k, v in st.error_kinds.most_common()]))

    # --------------------------------------------------------------- speculative health
    parts.append("<h2>Speculative decoding health</h2>")
    if not drafting:
        parts.append(f"<p>No drafted tokens in this run (speculative.method: "
                     f"{html.escape(str(spec.get('method', 'none')))}); nothing to show.</p>")
    else:
        decode = st.compiled_calls + st.eager_calls
        parity = (f"<span class='bad'>{st.parity_failures}</span> (compiled verify disagreed with eager)"
                  if st.parity_failures else "<span class='ok'>0</span>")
        parts.append(_table([
            ("method / depth", html.escape(f"{spec.get('method')} / {spec.get('depth')}"
                                           f"{' (adaptive)' if spec.get('adaptive_depth') else ''}")),
            ("acceptance rate", f"{st.acceptance_rate:.1%} ({_fmt(st.accepted)} of {_fmt(st.drafted)} drafted tokens)"),
            ("tokens per verify", _fmt(st.tokens_per_verify, 2)),
            ("verify calls", f"{_fmt(st.verify_calls)} (rounds that drafted)"),
            ("decode forwards", f"{_fmt(st.compiled_calls)} compiled, {_fmt(st.eager_calls)} eager"
                                + (f" ({st.compiled_calls / decode:.0%} compiled)" if decode else "")
                                + " (every round, drafting or not)"),
            ("parity failures", parity),
        ]))
        parts.append(_grid(["depth", "verifies accepted at depth", "share of verifies", "given previous depth"],
                           [[d, st.by_depth[d - 1], f"{r:.1%}", "n/a" if g is None else f"{g:.1%}"]
                            for d, r, g in st.depth_rates()]))
        parts.append(img("acceptance_by_depth", "acceptance rate by draft depth"))
        parts.append(img("tokens_per_verify", "histogram of tokens per verify"))

    # --------------------------------------------------------------- throughput
    parts.append("<h2>Throughput over time</h2>")
    parts.append("<p class='note'>Generated tokens per second in each interval of the progress the run "
                 f"recorded ({PROGRESS_FILE}; one point per committed shard for runs without it), and rows "
                 "committed. Dashed red lines mark later sessions (resumes).</p>")
    parts.append(img("throughput", "throughput over time") or "<p>No shards committed yet.</p>")
    parts.append(img("lengths", "prompt and completion lengths"))

    # --------------------------------------------------------------- slow and failed rows
    parts.append(f"<h2>Slowest rows (top {len(st.slowest)} by decode time)</h2>")
    if st.slowest:
        parts.append("<p class='note'>decode_seconds runs from admission to finish, so rows decoded in a wide "
                     "batch share the time with their neighbours.</p>")
        parts.append(_grid(["id", "row", "sample", "decode s", "generated", "prompt", "tok/s", "batch width", "finish"],
                           [[str(r["id"]), r["row"], r["sample"], r["decode_seconds"], r["completion_tokens"],
                             r["prompt_tokens"], r["tokens_per_second"], r["batch_width"], r["finish_reason"] or ""]
                            for r in st.slowest]))
    else:
        parts.append("<p>No generated rows yet.</p>")
    parts.append(f"<h2>Errored rows ({_fmt(st.errors)})</h2>")
    if st.error_rows:
        shown = st.error_rows[:MAX_ERRORS_SHOWN]
        parts.append(_grid(["id", "row", "sample", "kind", "error"],
                           [["" if e["id"] is None else str(e["id"]), e["row"], e["sample"], e["kind"],
                             e["error"] or ""] for e in shown]))
        if len(st.error_rows) > len(shown):
            parts.append(f"<p class='note'>{len(st.error_rows) - len(shown)} more in <code>errors.jsonl</code>.</p>")
    else:
        parts.append("<p class='ok'>None.</p>")
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


# ------------------------------------------------------------------------------ entry point
@dataclass
class ReportFiles:
    out_dir: str
    index: str
    images: List[str]
    stats: RunStats


def write_report(run_dir: str, out_dir: Optional[str] = None, top: int = TOP_SLOW) -> ReportFiles:
    """Renders the report of RUN_DIR into out_dir (default RUN_DIR/report)."""
    plt = pyplot()  # fail before reading anything when matplotlib is missing
    st = collect(run_dir, top=top)
    out_dir = os.path.abspath(out_dir or os.path.join(run_dir, "report"))
    os.makedirs(out_dir, exist_ok=True)
    images: Dict[str, bytes] = {}
    written = []
    for name, fn in PLOTS:
        png = fn(st, plt)
        path = os.path.join(out_dir, f"{name}.png")
        if png:
            images[name] = png
            with open(path, "wb") as f:
                f.write(png)
            written.append(path)
        elif os.path.exists(path):
            os.remove(path)  # stale from an earlier report
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(st.summary(), f, indent=1, default=str)
    with open(os.path.join(out_dir, "errors.jsonl"), "w", encoding="utf-8") as f:
        for e in st.error_rows:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
    index = os.path.join(out_dir, "index.html")
    tmp = index + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render_html(st, images))
    os.replace(tmp, index)
    return ReportFiles(out_dir, index, written, st)


def text_summary(st: RunStats) -> str:
    acc = "n/a (no drafting)" if st.acceptance_rate is None else \
        f"{st.acceptance_rate:.1%}, {st.tokens_per_verify:.2f} tokens/verify"
    kinds = ", ".join(f"{k}: {v}" for k, v in st.error_kinds.most_common()) or "none"
    return "\n".join([
        f"rows: {st.rows} ({st.ok} ok, {st.errors} errors: {kinds})",
        f"tokens: {st.prompt_tokens} prompt, {st.completion_tokens} generated; "
        f"{st.tokens_per_second:.1f} tok/s, {st.rows_per_second:.2f} rows/s over {_duration(st.active_seconds)}",
        f"acceptance: {acc}",
    ])
