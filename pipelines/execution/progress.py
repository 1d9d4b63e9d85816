"""Live progress of a run: what one session did so far, its rate and ETA, and the JSON lines of
`--log-json`. The CLI's bars on a terminal (pipelines/cli/progress.py) are drawn from it (`view`).

Counted in rows (one row = one (input row, sample) generation) and tokens: rows handed to the
engine (`submitted`) and finished (`finished`), prompt tokens prefilled and tokens generated, live
from the first decode round (the engine reports every prefill span and every round through
`Engine.on_progress`, wired to `engine_event`). The ETA is token-based:
    (rows left x expected tokens per row - tokens of rows in flight) / recent tok/s
Expected tokens per row: the mean of finished rows, generation.max_tokens before any row has
finished. The rate is taken over the last RATE_WINDOW seconds, so a slow start (compiling, the
first wide prefill) fades out of the estimate.

Progress over time is also recorded in RUN_DIR/progress.jsonl (one line per RECORD_EVERY
seconds: session start, elapsed, cumulative generated / prefilled tokens, rows done), from which
`report` draws throughput over time.

With `log_json`, every line written to stderr is one JSON object with an `event` key:
    start     run_dir, job, rows_total, rows_done_before
    startup   once, at the first token: seconds per startup phase (pipelines/execution/startup.py)
    log       message (what the runner would otherwise print)
    shard     a shard committed: file, rows, errors, completion_tokens, rows_committed
    progress  after the first decode round, then every `log_every` seconds (from a timer
              thread, so it also marks liveness while long rows decode): rows_done, rows_total,
              rows_errored, prompt_tokens, prefill_tokens, completion_tokens (generated so far,
              rows in flight included), tokens_per_second, acceptance_rate, tokens_per_verify,
              eta_seconds, elapsed_seconds
    summary   once at the end: status (done | interrupted | failed), outputs, errors, skipped,
              completion_tokens, seconds, tokens_per_second, shards, run_dir, peak_rss_bytes,
              peak_mlx_bytes (+ error)
    error     written by the CLI when the command fails: message, exit_code
Every object also has `time` (ISO 8601, UTC) and `ts` (Unix seconds).
"""

from __future__ import annotations

import collections
import datetime
import json
import sys
import threading
import time
from typing import Any, Callable, Deque, Dict, Optional, TextIO, Tuple

from mtplx.request import tokens_per_verify

RATE_WINDOW = 30.0  # seconds of history behind the tokens/s used by the ETA
DEFAULT_LOG_EVERY = 30.0
RECORD_EVERY = 2.0  # seconds between lines of RUN_DIR/progress.jsonl

_write_lock = threading.Lock()


def json_line(event: str, stream: Optional[TextIO] = None, **fields: Any) -> None:
    """Write one `{"event": ..., "time": ..., ...}` line to `stream` (stderr by default)."""
    now = time.time()
    obj = {"event": event, "time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
           .isoformat(timespec="seconds").replace("+00:00", "Z"), "ts": round(now, 3)}
    obj.update(fields)
    text = json.dumps(obj, default=str, ensure_ascii=False, allow_nan=False)
    stream = stream or sys.stderr
    with _write_lock:
        stream.write(text + "\n")
        stream.flush()


def json_logger(stream: Optional[TextIO] = None) -> Callable[[str], None]:
    """A `log(message)` callback that writes `{"event": "log", "message": ...}` lines."""
    return lambda msg: json_line("log", stream, message=msg)


class Progress:
    """Counts what one session of a run does, and reports it.

    mode: "json" (JSON lines, see the module doc) or "off". `view(progress)`, given, makes what
    draws it (pipelines/cli/progress.py: `Bars`), called on each change: `submitted()`,
    `finished(via_engine)`, `engine_event(now, first_round)`, `close()`. The runner calls `start`,
    `submitted` for every request the engine takes, `finished` for every output row, `committed`
    for every shard, and `close` once.
    """

    def __init__(self, total: Optional[int], initial: int = 0, mode: str = "off",
                 log_every: float = DEFAULT_LOG_EVERY, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic, max_tokens: Optional[int] = None,
                 record_path: Optional[str] = None, view: Optional[Callable[["Progress"], Any]] = None):
        if mode not in ("json", "off"):
            raise ValueError(f"progress mode must be json or off, got {mode!r}")
        self.total = total
        self.initial = initial
        self.mode = mode
        self.stream = stream or sys.stderr
        self.clock = clock
        self.log_every = log_every
        self.started = clock()
        # counters for this session
        self.submitted_rows = 0
        self.prompt_tokens_in = 0
        self.cached_tokens_in = 0
        self.rows = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.verify_calls = 0
        self.rows_committed = initial
        self.max_tokens = max_tokens
        self.live = False  # the engine reports tokens as they are generated (engine_event)
        self.generated = 0  # generated tokens reported by the engine, rows in flight included
        self.prefilled = 0  # prompt tokens prefilled, reported by the engine
        self.finished_generated = 0  # of `generated`, the share of rows that finished
        self._first_round_logged = False
        self.record_path = record_path
        self._last_record: Optional[float] = None
        self._session_ts = time.time()
        self._recent: Deque[Tuple[float, int]] = collections.deque()  # (time, cumulative tokens)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.view = view(self) if view is not None else None

    # ------------------------------------------------------------------ events from the runner
    def start(self, **fields: Any) -> None:
        self._maybe_record(self.clock(), force=True)
        if self.mode == "json":
            json_line("start", self.stream, rows_total=self.total, rows_done_before=self.initial, **fields)
            if self.log_every and self.log_every > 0:
                self._thread = threading.Thread(target=self._heartbeat, name="mtplx-progress", daemon=True)
                self._thread.start()

    def engine_event(self, kind: str, tokens: int) -> None:
        """From `Engine.on_progress` (the engine thread): `tokens` prefilled or generated."""
        now = self.clock()
        first_round = False
        with self._lock:
            if kind == "prefill":
                self.prefilled += tokens
            elif kind == "decode":
                self.live = True
                self.generated += tokens
                self._add_recent(now, self.generated)
                first_round = not self._first_round_logged
                self._first_round_logged = True
        if first_round and self.mode == "json" and self.log_every and self.log_every > 0:
            json_line("progress", self.stream, **self.snapshot())
        self._maybe_record(now)
        if self.view is not None:
            self.view.engine_event(now, first_round)

    def _add_recent(self, now: float, cumulative: int) -> None:
        self._recent.append((now, cumulative))
        while len(self._recent) > 2 and now - self._recent[1][0] > RATE_WINDOW:
            self._recent.popleft()

    def submitted(self, prompt_tokens: int) -> None:
        """A request was handed to the engine (which prefills it next)."""
        with self._lock:
            self.submitted_rows += 1
            self.prompt_tokens_in += prompt_tokens
        if self.view is not None:
            self.view.submitted()

    def finished(self, row: Dict[str, Any], via_engine: bool = True) -> None:
        """An output row is done: generated, or an error row (`via_engine=False`: the row never
        reached the engine, e.g. an unreadable input row)."""
        now = self.clock()
        with self._lock:
            self.rows += 1
            if row.get("finish_reason") == "error":
                self.errors += 1
            self.prompt_tokens += row.get("prompt_tokens") or 0
            self.completion_tokens += row.get("completion_tokens") or 0
            self.drafted += row.get("drafted_tokens") or 0
            self.accepted += row.get("accepted_tokens") or 0
            self.verify_calls += row.get("verify_calls") or 0
            if self.live:
                self.finished_generated += row.get("completion_tokens") or 0
            else:
                self._add_recent(now, self.completion_tokens)
        self._maybe_record(now)
        if self.view is not None:
            self.view.finished(via_engine)

    def committed(self, entry: Dict[str, Any]) -> None:
        self.rows_committed += entry.get("rows", 0)
        if self.mode == "json":
            json_line("shard", self.stream, file=entry.get("file"), rows=entry.get("rows"),
                      errors=entry.get("errors"), completion_tokens=entry.get("completion_tokens"),
                      seconds=round(entry.get("elapsed", 0.0), 3), rows_committed=self.rows_committed,
                      rows_total=self.total)

    def close(self, summary: Any = None, status: str = "done", error: Optional[str] = None) -> None:
        self._maybe_record(self.clock(), force=True)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.view is not None:
            self.view.close()
            self.view = None
        if self.mode == "json" and summary is not None:
            fields = dict(status=status, run_dir=summary.run_dir, outputs=summary.outputs,
                          errors=summary.errors, skipped=summary.skipped,
                          completion_tokens=summary.completion_tokens, seconds=round(summary.seconds, 3),
                          tokens_per_second=round(summary.tokens_per_second, 3), shards=summary.shards,
                          acceptance_rate=self.acceptance_rate,
                          peak_rss_bytes=getattr(summary, "peak_rss_bytes", None),
                          peak_mlx_bytes=getattr(summary, "peak_mlx_bytes", None))
            if error:
                fields["error"] = error
            json_line("summary", self.stream, **fields)

    # ------------------------------------------------------------------ numbers
    @property
    def acceptance_rate(self) -> Optional[float]:
        return round(self.accepted / self.drafted, 4) if self.drafted else None

    @property
    def tokens_per_verify(self) -> Optional[float]:
        tpv = tokens_per_verify(self.accepted, self.verify_calls)
        return None if tpv is None else round(tpv, 3)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated in this session: live from the engine, else those of finished rows."""
        return self.generated if self.live else self.completion_tokens

    def recent_rate(self) -> float:
        """Generated tokens per second over about the last RATE_WINDOW seconds."""
        now = self.clock()
        with self._lock:
            if len(self._recent) >= 2 and now - self._recent[0][0] > 0:
                t0, k0 = self._recent[0]
                return (self.generated_tokens - k0) / (now - t0)
        el = now - self.started
        return self.generated_tokens / el if el > 0 else 0.0

    def eta_seconds(self) -> Optional[float]:
        """(Rows left x expected tokens per row - tokens of rows in flight) / recent tokens/s."""
        if self.total is None:
            return None
        left = max(self.total - self.initial - self.rows, 0)
        if left == 0:
            return 0.0
        if self.rows:
            per_row = self.completion_tokens / self.rows
        elif self.live and self.max_tokens:
            per_row = float(self.max_tokens)  # no row finished yet: at most max_tokens each
        else:
            return None
        in_flight = max(self.generated - self.finished_generated, 0) if self.live else 0
        rate = self.recent_rate()
        if rate <= 0:
            return None
        tokens_left = left * per_row - in_flight
        if tokens_left <= 0:
            return None  # rows in flight already ran past the estimate: unknown, not "0s"
        return tokens_left / rate

    def snapshot(self) -> Dict[str, Any]:
        eta = self.eta_seconds()
        return dict(rows_done=self.initial + self.rows, rows_total=self.total, rows_errored=self.errors,
                    rows_submitted=self.submitted_rows, prompt_tokens=self.prompt_tokens,
                    prefill_tokens=self.prefilled, completion_tokens=self.generated_tokens,
                    tokens_per_second=round(self.recent_rate(), 3), acceptance_rate=self.acceptance_rate,
                    tokens_per_verify=self.tokens_per_verify,
                    eta_seconds=None if eta is None else round(eta, 1),
                    elapsed_seconds=round(self.clock() - self.started, 3))

    def _maybe_record(self, now: float, force: bool = False) -> None:
        """Append a line to RUN_DIR/progress.jsonl every RECORD_EVERY seconds (and at close)."""
        if self.record_path is None:
            return
        with self._lock:
            if not force and self._last_record is not None and now - self._last_record < RECORD_EVERY:
                return
            self._last_record = now
            line = json.dumps({"ts": round(time.time(), 3), "session": round(self._session_ts, 3),
                               "elapsed": round(now - self.started, 3), "generated": self.generated_tokens,
                               "prefilled": self.prefilled, "rows": self.rows, "errors": self.errors})
        try:
            with open(self.record_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError:
            self.record_path = None  # telemetry only: a full disk must not stop the run here

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.log_every):
            json_line("progress", self.stream, **self.snapshot())
