"""Live progress of a run: what one session did so far, its rate and ETA, and the JSON lines of
`--log-json`. The CLI's bars on a terminal (pipelines/cli/progress.py) are drawn from it (`view`).

Counted in rows (one row = one (input row, sample) generation) and tokens: rows handed to the
engine (`submitted`) and finished (`finished`), prompt tokens prefilled and tokens generated, live
from the first decode round (the engine reports every prefill span and every round through
`Engine.on_progress`, wired to `engine_event`). The figures are pipelines/io/figures.py's:
    tok/s      generated tokens per second since generation began; once the session closes, its
               committed tokens over its active seconds, the summary line's and `status`'s figure
    prefill    prompt tokens per second of prefilling (the time up to each prefill report)
    ETA        from the rows' own durations: each row in flight is expected to run as long as the
               recent rows that outlasted its age did (a row older than all of them: up to
               generation.max_tokens at the rows' token pace), the rows not started yet as long
               as the recent rows' mean, the batch's width of them at a time (figures.eta_seconds).
               Before any row has finished, every row is taken to run to max_tokens.

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
              rows_errored, prompt_tokens, prefill_tokens, prefill_tokens_per_second,
              completion_tokens (generated so far, rows in flight included), tokens_per_second,
              acceptance_rate, tokens_per_verify, building (the engine is building a compiled program:
              its first call, on a fresh GPU host seconds of kernel builds), eta_seconds, elapsed_seconds
    summary   once at the end: status (done | interrupted | failed), outputs, errors, skipped,
              completion_tokens, seconds, tokens_per_second, shards, run_dir, peak_rss_bytes,
              peak_mlx_bytes (+ error)
    error     written by the CLI when the command fails: message, exit_code
Every object also has `time` (ISO 8601, UTC) and `ts` (Unix seconds).
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
from typing import Any, Callable, Dict, Hashable, Optional, TextIO

from mtplx.request import tokens_per_verify

from ..io import figures
from ..io.figures import RowDurations, acceptance_rate, per_second

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
        self.building = False  # the engine is building a compiled program (its first call) right now
        self.prefilled = 0  # prompt tokens prefilled, reported by the engine
        self.prefill_seconds = 0.0  # the time up to each prefill report, since the engine's last report
        self._last_event: Optional[float] = None  # the engine's last report (None: none yet, use `started`)
        self._in_flight: Dict[Hashable, float] = {}  # key -> when it was handed to the engine
        self.width = 0  # the most rows in flight at once
        self.durations = RowDurations()
        self.row_seconds = 0.0  # summed durations of finished rows
        self.committed_tokens = 0  # completion tokens of this session's committed shards
        self.active_seconds = 0.0  # their `elapsed`, summed
        self.closed = False
        self._first_round_logged = False
        self.record_path = record_path
        self._last_record: Optional[float] = None
        self._session_ts = time.time()
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
        """From `Engine.on_progress` (the engine thread): `tokens` prefilled or generated, or "build": a
        compiled program's first call started (a fresh GPU host builds its kernels: seconds each)."""
        now = self.clock()
        first_round = False
        with self._lock:
            if kind == "prefill":
                self.prefilled += tokens
                self.prefill_seconds += now - (self.started if self._last_event is None else self._last_event)
            elif kind == "decode":
                self.live = True
                self.generated += tokens
                first_round = not self._first_round_logged
                self._first_round_logged = True
            started_building = kind == "build" and not self.building
            self.building = kind == "build"  # until the engine's next prefill or round
            if kind != "build":
                self._last_event = now
        if first_round and self.mode == "json" and self.log_every and self.log_every > 0:
            json_line("progress", self.stream, **self.snapshot())
        self._maybe_record(now)
        if self.view is not None:
            self.view.engine_event(now, first_round or started_building)

    def submitted(self, key: Hashable, prompt_tokens: int) -> None:
        """A request (output row `key`: (row, sample)) was handed to the engine, which prefills it next."""
        with self._lock:
            self.submitted_rows += 1
            self.prompt_tokens_in += prompt_tokens
            self._in_flight[key] = self.clock()
            self.width = max(self.width, len(self._in_flight))
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
            # its duration: timed here when it was handed to the engine here, else the engine's own
            began = self._in_flight.pop((row.get("row"), row.get("sample")), None)
            seconds = now - began if began is not None else row.get("decode_seconds")
            if seconds and row.get("finish_reason") != "error":
                self.durations.add(seconds)
                self.row_seconds += seconds
        self._maybe_record(now)
        if self.view is not None:
            self.view.finished(via_engine)

    def committed(self, entry: Dict[str, Any]) -> None:
        self.rows_committed += entry.get("rows", 0)
        self.committed_tokens += entry.get("completion_tokens", 0)
        self.active_seconds += entry.get("elapsed", 0.0)
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
        self.closed = True  # the figures are the committed rows' from here on
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
        rate = acceptance_rate(self.accepted, self.drafted)
        return None if rate is None else round(rate, 4)

    @property
    def tokens_per_verify(self) -> Optional[float]:
        tpv = tokens_per_verify(self.accepted, self.verify_calls)
        return None if tpv is None else round(tpv, 3)

    @property
    def generated_tokens(self) -> int:
        """Tokens generated in this session: live from the engine, else those of finished rows."""
        return self.generated if self.live else self.completion_tokens

    def tokens_per_second(self) -> float:
        """Generated tokens per second since generation began; once closed, the committed tokens
        per active second (the summary line's and `status`'s figure)."""
        if self.closed:
            return per_second(self.committed_tokens, self.active_seconds)
        return per_second(self.generated_tokens, self.clock() - self.started)

    def prefill_tokens_per_second(self) -> float:
        return per_second(self.prefilled, self.prefill_seconds)

    def eta_seconds(self) -> Optional[float]:
        """Seconds until the session's last row is done (see the module doc); None while unknown."""
        if self.total is None:
            return None
        now = self.clock()
        with self._lock:
            ages = [now - t for t in self._in_flight.values()]
            waiting = max(self.total - self.initial - self.rows - len(ages), 0)
            if not ages and not waiting:
                return 0.0
            # a row's token pace: tokens over the seconds rows spent running (in flight included when live)
            pace = per_second(self.generated if self.live else self.completion_tokens,
                              self.row_seconds + (sum(ages) if self.live else 0.0))
            longest = self.max_tokens / pace if pace and self.max_tokens else None
            if not self.durations.recent and longest is None:
                return None  # nothing finished, nothing generated: no pace yet
            left, mean = self.durations.predict(ages, longest)
            left = left.tolist()
            if self.width:  # rows decode here: `width` of them at a time, each for about `mean`
                rows_per_second = per_second(self.width, mean)
            else:  # rows come back from elsewhere (Ray): at the pace they came back so far
                rows_per_second = per_second(self.rows, now - self.started)
        return figures.eta_seconds(waiting, left, mean, rows_per_second)

    def snapshot(self) -> Dict[str, Any]:
        eta = self.eta_seconds()
        return dict(rows_done=self.initial + self.rows, rows_total=self.total, rows_errored=self.errors,
                    rows_submitted=self.submitted_rows, prompt_tokens=self.prompt_tokens,
                    prefill_tokens=self.prefilled, prefill_tokens_per_second=round(self.prefill_tokens_per_second(), 3),
                    completion_tokens=self.generated_tokens,
                    tokens_per_second=round(self.tokens_per_second(), 3), acceptance_rate=self.acceptance_rate,
                    tokens_per_verify=self.tokens_per_verify, building=self.building,
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
