"""The report's plots (pipelines/cli/report.py renders them into the page): one function per PNG,
drawn from a run's `RunStats` (pipelines/io/run_stats.py)."""

from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Tuple

from ..errors import JobError
from ..io.run_stats import RunStats


def throughput_intervals(progress: List[Dict[str, Any]]) -> List[Tuple[float, float, float]]:
    """(start ts, end ts, generated tok/s) for each recorded interval, within each session."""
    out = []
    for prev, cur in zip(progress, progress[1:]):
        dt = cur["ts"] - prev["ts"]
        if cur["session"] == prev["session"] and dt > 0:
            out.append((prev["ts"], cur["ts"], max(cur["generated"] - prev["generated"], 0) / dt))
    return out


# ------------------------------------------------------------------------------ plots
def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise JobError("report needs matplotlib for its plots (a dependency of mtplx-batch): "
                       "pip install matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def plot_throughput(st: RunStats, plt) -> Optional[bytes]:
    points = [t for t in st.timeline if t.get("committed")]
    if not points:
        return None
    t0 = min([points[0]["committed"] - (points[0]["elapsed"] or 0)] + [s for s in st.sessions[:1]])
    span = max(p["committed"] for p in points) - t0
    unit, scale = ("min", 60.0) if span > 180 else ("s", 1.0)
    intervals = throughput_intervals(st.progress)
    if intervals:
        t0 = min(t0, intervals[0][0])
        span = max(span, max(p["committed"] for p in points) - t0, intervals[-1][1] - t0)
        unit, scale = ("min", 60.0) if span > 180 else ("s", 1.0)
    xs = [(p["committed"] - t0) / scale for p in points]
    cum, total = [], 0
    for p in points:
        total += p["rows"]
        cum.append(total)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.2), sharex=True)
    if intervals:
        # a step per recorded interval: the tokens generated in it over its length
        for a, b, r in intervals:
            ax1.plot([(a - t0) / scale, (b - t0) / scale], [r, r], color="#1f77b4")
        ax1.set_ylabel("generated tok/s")
        how = f"{len(intervals)} intervals of recorded progress"
    else:  # a run without progress.jsonl: one point per shard
        rate = [p["completion_tokens"] / p["elapsed"] if p["elapsed"] else 0.0 for p in points]
        ax1.plot(xs, rate, marker="o", color="#1f77b4")
        ax1.set_ylabel("generated tok/s\n(per shard)")
        how = f"{len(points)} shard commits"
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax1.set_title(f"Throughput over time ({how}, mean {st.tokens_per_second:.1f} tok/s)")
    ax2.step([0.0] + xs, [0] + cum, where="post", color="#2ca02c")
    ax2.plot(xs, cum, "o", color="#2ca02c", markersize=4)
    if st.expected_rows:
        ax2.axhline(st.expected_rows, ls=":", color="grey")
        ax2.text(0, st.expected_rows, f" expected {st.expected_rows}", va="bottom", color="grey", fontsize=8)
    ax2.set_ylabel("rows committed")
    ax2.set_xlabel(f"wall-clock time since the first session started ({unit})")
    ax2.set_ylim(0, max(cum[-1], st.expected_rows or 0) * 1.15 + 1)
    from matplotlib.ticker import MaxNLocator

    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.grid(alpha=0.3)
    for s in st.sessions[1:]:
        for ax in (ax1, ax2):
            ax.axvline((s - t0) / scale, ls="--", color="#d62728", alpha=0.6)
    if len(st.sessions) > 1:
        ax1.plot([], [], ls="--", color="#d62728", label="session (re)start")
        ax1.legend(loc="lower right", fontsize=8)
    png = _png(fig)
    plt.close(fig)
    return png


def plot_acceptance(st: RunStats, plt) -> Optional[bytes]:
    if not st.verify_calls or not st.by_depth:
        return None
    rates = st.depth_rates()
    ds = [d for d, _, _ in rates]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(ds, [r * 100 for _, r, _ in rates], color="#1f77b4", label="accepted at depth d (of all verifies)")
    for b, (_, r, _) in zip(bars, rates):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 1, f"{r:.0%}", ha="center", fontsize=9)
    cond = [(d, g * 100) for d, _, g in rates if g is not None]
    if cond:
        ax.plot([d for d, _ in cond], [g for _, g in cond], "o--", color="#ff7f0e",
                label="accepted at d, given accepted at d-1")
    ax.set_xticks(ds)
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("% of verifies")
    ax.set_ylim(0, 120)
    method = (st.job.get("speculative") or {}).get("method", "?")
    ax.set_title(f"Draft acceptance by depth ({method}; overall {st.acceptance_rate:.1%} of "
                 f"{st.drafted} drafted tokens)")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    png = _png(fig)
    plt.close(fig)
    return png


def plot_tokens_per_verify(st: RunStats, plt) -> Optional[bytes]:
    if not st.verify_calls:
        return None
    hist = st.verify_histogram()
    fig, ax = plt.subplots(figsize=(7, 4))
    ks = [k for k, _ in hist]
    bars = ax.bar(ks, [n for _, n in hist], color="#9467bd")
    for b, (_, n) in zip(bars, hist):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{n / st.verify_calls:.0%}", ha="center",
                va="bottom", fontsize=9)
    ax.set_ylim(0, max(n for _, n in hist) * 1.15 + 1)
    ax.axvline(st.tokens_per_verify, ls="--", color="black", label=f"mean {st.tokens_per_verify:.2f}")
    ax.legend(fontsize=9, loc="upper right")
    ax.set_xticks(ks)
    ax.set_xlabel("tokens emitted by one verify (accepted drafts + 1)")
    ax.set_ylabel("verify calls")
    ax.set_title(f"Tokens per verify ({st.verify_calls} verifies that drafted)")
    ax.grid(axis="y", alpha=0.3)
    png = _png(fig)
    plt.close(fig)
    return png


def plot_lengths(st: RunStats, plt) -> Optional[bytes]:
    if not st.completion_lengths:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.hist(st.prompt_lengths, bins=min(30, max(5, len(set(st.prompt_lengths)))), color="#8c564b")
    a.set_xlabel("prompt tokens")
    a.set_ylabel("rows")
    a.set_title("Prompt length")
    b.hist(st.completion_lengths, bins=min(30, max(5, len(set(st.completion_lengths)))), color="#17becf")
    b.set_xlabel("generated tokens")
    b.set_title("Completion length")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    png = _png(fig)
    plt.close(fig)
    return png


PLOTS = [("throughput", plot_throughput), ("acceptance_by_depth", plot_acceptance),
         ("tokens_per_verify", plot_tokens_per_verify), ("lengths", plot_lengths)]
