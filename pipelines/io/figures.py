"""The run figures, each defined once, so the live bars, the summary line, `status` and `report`
agree on one run.

    per_second(n, seconds)        tok/s, rows/s, prompt tok/s
    acceptance_rate(accepted, drafted)
    eta_seconds(...)              seconds until the last row is done
    RowDurations                  recent rows' seconds from admission to finish, and what they
                                  predict: the seconds left of each row in flight, a row's mean

Active seconds, the denominator of a run's rates: the time sessions spent generating, from the
moment the engine (or the Ray cluster) is up to the session's last shard commit. Each shard's
`elapsed` is its share of it, so a run's active seconds are the sum over its shards.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence, Tuple

import numpy as np

RECENT_ROWS = 256  # finished rows whose durations predict the rest


def per_second(n: float, seconds: float) -> float:
    """`n` (tokens, rows) per second; 0.0 over no time."""
    return n / seconds if seconds > 0 else 0.0


def acceptance_rate(accepted: int, drafted: int) -> Optional[float]:
    """Accepted draft tokens / drafted tokens; None when nothing was drafted."""
    return accepted / drafted if drafted else None


def eta_seconds(waiting: int, in_flight: Sequence[float], row_seconds: Optional[float],
                rows_per_second: float) -> Optional[float]:
    """Seconds until the last row is done. `in_flight`: the expected seconds left of each row in
    flight; `waiting`: rows not started yet, each taking about `row_seconds`, finished at
    `rows_per_second` once running. None when the pace is not known yet.

    The rows in flight and the waiting ones drain at the measured pace, and the last rows to start
    still run for about half a row's time after the others, as the batch empties."""
    longest = max(in_flight, default=0.0)
    if waiting <= 0:
        return longest
    if not row_seconds or rows_per_second <= 0:
        return None
    return max(longest, (sum(in_flight) / row_seconds + waiting) / rows_per_second + row_seconds / 2)


class RowDurations:
    """Seconds from admission to finish of the last RECENT_ROWS rows, and what they predict."""

    def __init__(self, keep: int = RECENT_ROWS):
        self.recent: collections.deque = collections.deque(maxlen=keep)

    def add(self, seconds: float) -> None:
        self.recent.append(float(seconds))

    def predict(self, ages: Sequence[float], longest: Optional[float]) -> Tuple[np.ndarray, float]:
        """(expected seconds left of each row in flight for `ages` seconds, a row's mean seconds).

        Short rows finish first, so the finished rows alone make every row look short: both come
        from the survival curve of row durations (Kaplan-Meier) over the recent finished rows and
        the rows in flight, each known to run at least its age. Past the longest finished row the
        curve falls at the rows' overall finishing rate (finished rows per second of running), and
        no row runs past `longest` (a row's longest run, from max_tokens; None: no bound). A row
        is expected to need at least a tenth of its age more: past every estimate, it is not done
        until it is."""
        ages = np.asarray(ages, dtype=np.float64)
        done = np.sort(np.fromiter(self.recent, dtype=np.float64, count=len(self.recent)))
        times, ended = np.unique(done, return_counts=True)
        running = np.sort(ages)
        at_risk = (len(done) - np.searchsorted(done, times)) + (len(running) - np.searchsorted(running, times))
        level = np.concatenate([[1.0], np.cumprod(1.0 - ended / at_risk)])  # on [edges[i], edges[i + 1])
        edges = np.concatenate([[0.0], times])
        area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(edges))])  # the curve's integral to each edge
        exposure = done.sum() + ages.sum()
        rate = len(done) / exposure if exposure > 0 else 0.0
        cap = np.inf if longest is None else longest

        def tail(start):  # the integral from `start` on of a curve at 1 there, falling at `rate`, cut at `cap`
            span = np.maximum(cap - start, 0.0)
            return span if rate == 0 else -np.expm1(-rate * span) / rate

        last = edges[-1]
        i = np.minimum(np.searchsorted(edges, ages, side="right") - 1, len(level) - 1)
        before_last = area[-1] - area[i] - level[i] * (ages - edges[i]) + level[-1] * tail(last)
        left = np.where(ages < last, before_last / np.maximum(level[i], 1e-12), tail(ages))
        return np.maximum(left, ages / 10), float(area[-1] + level[-1] * tail(last))
