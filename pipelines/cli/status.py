"""`status`: progress of a run from its manifest alone (each shard is checked to be there, none is read)."""

from __future__ import annotations

from typing import Dict, Optional

from mtplx.request import tokens_per_verify

from ..io.records import check_unread, planned_outputs, read_manifest, totals
from ..io.figures import acceptance_rate, eta_seconds, per_second


def run_status(run_dir: str) -> Dict:
    m = read_manifest(run_dir)
    check_unread(run_dir, m)
    t = totals(m)
    expected = planned_outputs(m)
    left = None if expected is None else max(expected - t["rows"], 0)
    rate = per_second(t["rows"], t["elapsed"])
    generated = t["rows"] - t["errors"]
    row_seconds = t["decode_seconds"] / generated if generated else None
    return {
        "run_dir": run_dir,
        "shards": len(m.get("shards", [])),
        "rows_done": t["rows"] - t["errors"],
        "rows_errored": t["errors"],
        "rows_left": left,
        "rows_expected": expected,
        "input_rows": m.get("input_rows"),
        "limit": m.get("limit"),
        "prompt_tokens": t["prompt_tokens"],
        "completion_tokens": t["completion_tokens"],
        "acceptance_rate": acceptance_rate(t["accepted_tokens"], t["drafted_tokens"]),
        "tokens_per_verify": tokens_per_verify(t["accepted_tokens"], t["verify_calls"]),
        "tokens_per_second": per_second(t["completion_tokens"], t["elapsed"]),
        "rows_per_second": rate,
        "active_seconds": t["elapsed"],
        "eta_seconds": None if left is None else eta_seconds(left, [], row_seconds, rate),
        "complete": left == 0,
    }


def _duration(s: Optional[float]) -> str:
    if s is None:
        return "unknown"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _limited(st: Dict) -> str:
    if st.get("limit") is None or st.get("input_rows") is None or st["limit"] >= st["input_rows"]:
        return ""
    return f" (limit: the first {st['limit']} of {st['input_rows']} input rows)"


def _done(st: Dict) -> str:
    if not st["complete"]:
        return ""
    return "  FAILED: every row is an error row" if st["rows_errored"] and not st["rows_done"] else "  COMPLETE"


def format_status(st: Dict) -> str:
    left = "unknown" if st["rows_left"] is None else st["rows_left"]
    acc = "n/a (no drafting)" if st["acceptance_rate"] is None else f"{st['acceptance_rate']:.1%}"
    tpv = "" if st["tokens_per_verify"] is None else f", {st['tokens_per_verify']:.2f} tokens/verify"
    return "\n".join([
        f"run: {st['run_dir']} ({st['shards']} shards){_done(st)}",
        f"rows: {st['rows_done']} done, {st['rows_errored']} errored, {left} left{_limited(st)}",
        f"tokens: {st['prompt_tokens']} prompt, {st['completion_tokens']} generated",
        f"acceptance: {acc}{tpv}",
        f"throughput: {st['tokens_per_second']:.1f} tok/s, {st['rows_per_second']:.2f} rows/s "
        f"over {_duration(st['active_seconds'])} active",
        f"ETA: {'done' if st['complete'] else _duration(st['eta_seconds'])}",
    ])
