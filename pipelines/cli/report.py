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

The numbers come from pipelines/io/run_stats.py (`collect`), which says where each comes from; a
report of a run in progress is a consistent snapshot of its committed shards.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..io.records import PROGRESS_FILE
from ..io.run_stats import TOP_SLOW, RunStats, collect
from .report_plots import PLOTS, pyplot

MAX_ERRORS_SHOWN = 200


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
