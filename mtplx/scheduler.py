"""The rows in flight: slots, the request stream, memory admission, a drained batch's tail.

`Scheduler` holds, for one `Engine.generate` call, the batch's slots (a `Row` each, None where
idle), their cache and the drafter's state of them, and the stream of requests. It decides which
requests join (free slots, the memory budget: a row that does not fit beside the rows in flight
waits for one to finish), where they go, and when a drained batch (no request waits) narrows; and
it turns tokens into rows' text and results (`emit`, `finish`). The engine (generation.py)
prefills what it admits; the rounds (rounds.py) decode what it holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
import numpy as np

from . import stops
from .cache import BatchCache
from .request import Request, Result, RowStats


@dataclass
class Row:
    req: Request
    rng: np.random.Generator
    max_tokens: int
    stats: RowStats
    started: float
    tokens: List[int]
    pending: int = 0  # the last token, not yet in the cache
    width_sum: int = 0
    depth_sum: int = 0
    rounds: int = 0
    u_next: Optional[np.ndarray] = None  # uniforms drawn for a round not yet queued (Rounds.plan)
    accept: Optional[object] = None  # its drafts' running acceptance (depth.RowAcceptance, Rounds.plan)


def tail_keeps_width() -> int:
    """The width a drained batch keeps. On a GPU a round of up to 32 rows costs about what one row's
    does (SmolLM2 on the H200: a plain round 4.5 ms at 1 row, 6.1 ms at 32), and every narrower
    width compiles verify and draft programs of its own for a job's last few rounds; on a CPU a
    round's cost follows its width."""
    return 32 if mx.default_device().type == mx.DeviceType.gpu else 1


class Scheduler:
    def __init__(self, tokenizer, eos: Set[int], max_batch: int, max_context: int, memory_budget: int,
                 row_bytes: Callable[[int, int], int], drafter=None):
        self.tokenizer, self.eos, self.drafter = tokenizer, eos, drafter
        self.max_batch, self.max_context, self.memory_budget = max_batch, max_context, memory_budget
        self.row_bytes = row_bytes  # cache bytes of a row of (prompt tokens, max_tokens)
        self.start(())

    def start(self, requests) -> None:
        """A new call: no rows, `requests` to come."""
        self.source: Iterator[Request] = iter(requests)
        self.waiting: List[Request] = []
        self.exhausted = False
        self.pulled = 0  # requests taken from the source
        self.expected: Optional[int] = None  # requests the source holds, where its caller says (Engine.expected_requests)
        self.slots: List[Optional[Row]] = []
        self.cache: Optional[BatchCache] = None

    @property
    def drained(self) -> bool:
        """No request waits."""
        return self.exhausted and not self.waiting

    @property
    def live(self) -> int:
        return sum(s is not None for s in self.slots)

    def _next_request(self) -> Optional[Request]:
        if self.waiting:
            return self.waiting.pop(0)
        req = None if self.exhausted else next(self.source, None)
        self.exhausted = req is None
        self.pulled += req is not None
        return req

    # -- admission -----------------------------------------------------------------------------------
    def new_row(self, req: Request) -> Tuple[Optional[Row], Optional[Result]]:
        """The request as a row, or the error result of one that cannot run."""
        n = len(req.prompt_tokens)
        stats = RowStats(prompt_tokens=n)
        max_tokens = min(req.params.max_tokens, self.max_context - n)
        error = ("empty prompt: the row has no tokens" if n == 0 else
                 f"prompt has {n} tokens but the model's context is {self.max_context}: shorten the prompt"
                 if n >= self.max_context else None)
        need = self.row_bytes(n, max_tokens) if error is None else 0
        if need > self.memory_budget:
            error = (f"row needs ~{need / 2**20:.0f} MiB of cache ({n} prompt + {max_tokens} new tokens) but "
                     f"schedule.memory_budget is {self.memory_budget / 2**20:.0f} MiB: raise the budget or lower max_tokens")
        if error is not None:
            return None, Result(req.key, [], "", "error", error, stats, req.seed)
        return Row(req, np.random.default_rng(req.seed), max_tokens, stats, time.perf_counter(), []), None

    def select(self):
        """Rows for the free slots while they fit the memory budget beside the rows in flight (a
        generator: yields the results of requests that cannot run). Returns (rows, free slots: idle
        ones, then those that widen the batch up to max_batch)."""
        free = [i for i, s in enumerate(self.slots) if s is None] + list(range(len(self.slots), self.max_batch))
        used = sum(self.row_bytes(len(s.req.prompt_tokens), s.max_tokens) for s in self.slots if s is not None)
        rows = []
        while len(rows) < len(free) and not self.drained:
            req = self._next_request()
            if req is None:
                break
            row, err = self.new_row(req)
            if err is not None:
                yield err
                continue
            need = self.row_bytes(len(req.prompt_tokens), row.max_tokens)
            if (self.live or rows) and used + need > self.memory_budget:
                # fits alone, not beside the rows in flight: it waits for one to finish, and the rows
                # taken so far run
                self.waiting.insert(0, req)
                break
            used += need
            rows.append(row)
        if rows and len(rows) == len(free) and not self.exhausted and not self.waiting:
            # the batch is full: a request read ahead (kept first in `waiting`) tells whether it is
            # drained, so a batch of a job's last rows keeps its best depth from its first round
            req = self._next_request()
            if req is not None:
                self.waiting.insert(0, req)
        return rows, free

    def place(self, slots: Sequence[int], rows: Sequence[Row], prefilled: Sequence[tuple]) -> None:
        """Rows with what their prefill gave (cache, drafter state, first token) into `slots`: idle
        ones filled with one gather per prefill group; slots past the batch's width widen it (copies
        the batch: only while it ramps up)."""
        width = len(self.slots)
        fills = [(s, row, got) for s, row, got in zip(slots, rows, prefilled) if s < width]
        grow = [(row, got) for s, row, got in zip(slots, rows, prefilled) if s >= width]
        for s, row, (_, state, _) in fills:
            self.slots[s] = row
            if self.drafter is not None:
                self.drafter.write(s, state)
        if fills:
            self.cache.put_rows([s for s, _, _ in fills], [got[0] for _, _, got in fills])
        if grow:
            new = BatchCache.gather([got[0] for _, got in grow])
            if self.cache is None:
                self.cache = new
            else:
                self.cache.extend(new)
            self.slots += [row for row, _ in grow]
            if self.drafter is not None:
                self.drafter.extend([got[1] for _, got in grow])

    def vacate(self, idle: Sequence[int]) -> None:
        """Slots whose rows just finished hold no entries: later rounds attend over none of theirs."""
        if idle:
            self.cache.rows.place(idle, [0] * len(idle))
            if self.drafter is not None:
                self.drafter.vacate(idle)

    # -- the tail --------------------------------------------------------------------------------------
    def narrows(self, live: int) -> Optional[int]:
        """The width a drained batch with `live` rows moves to, or None where it stays: the narrowest
        power of two holding them, once half its slots are idle, where it is wider than
        `tail_keeps_width()`. Rows keep their own slots' state, generators and positions, so output
        is the same narrowed or not."""
        width = len(self.slots)
        if live <= width // 2 and width > tail_keeps_width():
            return 1 << (max(live, 1) - 1).bit_length()
        return None

    def narrow(self, width: int) -> None:
        """Keep the live rows, then idle slots, up to `width`."""
        live = [i for i, s in enumerate(self.slots) if s is not None]
        keep = sorted(live + [i for i, s in enumerate(self.slots) if s is None][: width - len(live)])
        self.cache.take_rows(keep)
        self.slots = [self.slots[i] for i in keep]
        if self.drafter is not None:
            self.drafter.take(keep)

    # -- tokens into text ------------------------------------------------------------------------------
    def emit(self, row: Row, new_tokens: Sequence[int]) -> Optional[str]:
        """Append tokens; return a finish reason if the row is done."""
        for tok in new_tokens:
            if tok in self.eos:
                return "stop"
            row.tokens.append(int(tok))
            if len(row.tokens) >= row.max_tokens:
                return "length"
        if row.req.params.stop and stops.in_tail(self.tokenizer.decode, row.tokens, row.req.params.stop):
            return "stop"
        return None

    def finish(self, row: Row, reason: str) -> Result:
        hit = stops.cut(self.tokenizer.decode, row.tokens, row.req.params.stop) if row.req.params.stop else None
        if hit is not None:  # a round may have emitted past the token that completes the stop string
            del row.tokens[hit[0]:]
            text, reason = hit[1], "stop"
        else:
            text = self.tokenizer.decode(row.tokens)
        st = row.stats
        st.completion_tokens = len(row.tokens)
        st.decode_seconds = time.perf_counter() - row.started
        if row.rounds:
            st.batch_width = int(round(row.width_sum / row.rounds))
            st.draft_depth = int(round(row.depth_sum / row.rounds))
        return Result(row.req.key, list(row.tokens), text, reason, None, st, row.req.seed)
