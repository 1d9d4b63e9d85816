"""The rows in flight: slots, the request stream, memory admission, a drained batch's tail, and
tokens into text (docs/architecture.md).

Memory: the batch is a rectangle, every slot sized to the longest context a row admitted into it can
reach (its `reach`): programs are keyed by capacity, so a batch runs at one. Admission counts that
rectangle, the rows being admitted until they are placed, the prefix store, and the old rectangle
beside the new one while it is copied. A row that does not fit waits for an idle slot where the batch
can hold it, else the batch drains and is rebuilt around it (`rebuild`), which is also how a batch
whose reach outlived its longest row gets its width back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import mlx.core as mx
import numpy as np

from . import stops
from .cache import BatchCache, CacheRow
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
    reach: int = 0  # the longest context its cache can reach (prompt, max_tokens, rounds queued ahead)


class Memory(NamedTuple):
    """What admission counts, in bytes (the engine measures it: generation.py)."""

    budget: int  # schedule.memory_budget
    ahead: int  # tokens past its last one a row's cache can reach (rounds queued ahead)
    slot: Callable[[int], int]  # one batch slot (target and drafter caches) whose rows reach n tokens
    prefill: Callable[[Sequence[Row]], int]  # rows being admitted, until they are placed
    kept: Callable[[], int]  # held beside the batch: the prefix store


def format_bytes(n: float) -> str:
    """`n` bytes to three significant digits in the largest binary unit that keeps them at least 1."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 999.5 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024


def tail_keeps_width() -> int:
    """The width a drained batch keeps. On a GPU a round of up to 32 rows costs about what one row's
    does (SmolLM2, H200: 4.5 ms at 1 row, 6.1 ms at 32) and a narrower width builds programs of its
    own; on a CPU a round's cost follows its width."""
    return 32 if mx.default_device().type == mx.DeviceType.gpu else 1


class Scheduler:
    def __init__(self, tokenizer, eos: Set[int], max_batch: int, max_context: int, memory: Memory, drafter=None):
        self.tokenizer, self.eos, self.drafter = tokenizer, eos, drafter
        self.max_batch, self.max_context, self.memory = max_batch, max_context, memory
        self.start(())

    def start(self, requests) -> None:
        """A new call: no rows, `requests` to come."""
        self.source: Iterator[Request] = iter(requests)
        self.waiting: List[Request] = []
        self.exhausted = False
        self.pulled = 0  # requests taken from the source
        self.expected: Optional[int] = None  # requests the source holds, where its caller says (Engine.expected_requests)
        self.release()

    def release(self) -> None:
        """No batch: the next rows admitted build a new one (nothing may be in flight)."""
        self.slots: List[Optional[Row]] = []
        self.cache: Optional[BatchCache] = None
        self.reach = 0  # the longest context a row of this batch can reach: its caches' capacity
        self.rebuild = False  # admit nothing until the batch drains, then rebuild it
        if self.drafter is not None:
            self.drafter.reset()

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
        row = Row(req, np.random.default_rng(req.seed), max_tokens, stats, time.perf_counter(), [],
                  reach=n + max_tokens + self.memory.ahead)
        error = ("empty prompt: the row has no tokens" if n == 0 else
                 f"prompt has {n} tokens but the model's context is {self.max_context}: shorten the prompt"
                 if n >= self.max_context else None)
        need = self.alone(row) if error is None else 0
        if need > self.memory.budget:
            error = (f"row needs {format_bytes(need)} of memory alone ({n} prompt + {max_tokens} new tokens: its "
                     f"caches and prefill) but schedule.memory_budget is {format_bytes(self.memory.budget)}: raise "
                     f"schedule.memory_budget to at least {format_bytes(need)}, or lower max_tokens or shorten the prompt")
        if error is not None:
            return None, Result(req.key, [], "", "error", error, stats, req.seed)
        return row, None

    def alone(self, row: Row) -> int:
        """The bytes `row` needs in a batch of its own: a budget below it can never run it."""
        return self.peak((0, 0), (1, row.reach), [row])

    @property
    def shape(self) -> Tuple[int, int]:
        """The batch's (width, reach): `width` slots, each sized for a context of `reach` tokens."""
        return len(self.slots), self.reach

    def peak(self, before: Tuple[int, int], after: Tuple[int, int], rows: Sequence[Row]) -> int:
        """The most bytes the batch and `rows` hold while they join it, its shape `before` becoming
        `after`: the rectangle, the rows until they are placed and, where the shape changes, the new
        rectangle beside the old one while it is copied (the prefix store aside: `Memory.kept`)."""
        slot = self.memory.slot
        old, new = before[0] * slot(before[1]), after[0] * slot(after[1])
        changes = before[0] != after[0] or slot(before[1]) != slot(after[1])
        return old + (new if changes else 0) + self.memory.prefill(rows)

    def _after(self, free: Sequence[int], rows: Sequence[Row]) -> Tuple[int, int]:
        """The batch's shape once `rows` take the first free slots."""
        width = max([len(self.slots)] + [s + 1 for s in free[: len(rows)]])
        return width, max([self.reach] + [r.reach for r in rows])

    def _fits(self, free: Sequence[int], rows: Sequence[Row], kept: int) -> bool:
        return self.peak(self.shape, self._after(free, rows), rows) + kept <= self.memory.budget

    def _rebuild_pays(self, free: Sequence[int], rows: Sequence[Row], row: Row, kept: int) -> bool:
        """Whether `row`, which does not fit beside the rows in flight and `rows`, should wait for the
        batch to drain and be rebuilt: it would not fit even in an idle slot, or it needs a wider batch
        while the batch's reach outlived the rows that needed it and a batch of their reach would be
        wider (its slots are smaller)."""
        width, reach = self._after(free, rows)
        budget = self.memory.budget - kept
        if self.peak((width, reach), (width, max(reach, row.reach)), [row]) > budget:
            return True
        needed = max([row.reach] + [r.reach for r in rows] + [s.reach for s in self.slots if s is not None])
        return (free[len(rows)] >= width and self.memory.slot(needed) < self.memory.slot(reach)
                and self.peak((0, 0), (width + 1, needed), [row]) <= budget)

    def select(self):
        """Rows for the free slots while they fit the memory budget (a generator: yields the results of
        requests that cannot run). Returns (rows, free slots: idle ones, then those that widen the
        batch), or (None, None) where the old batch or the prefix store is in the next row's way: the
        caller lands the round in flight, frees them (`release`) and selects again."""
        free = [i for i, s in enumerate(self.slots) if s is None] + list(range(len(self.slots), self.max_batch))
        rows: List[Row] = []
        if self.rebuild:  # the batch drains for a rebuild
            return (rows, free) if self.live else (None, None)
        kept = self.memory.kept()
        while len(rows) < len(free) and not self.drained:
            req = self._next_request()
            if req is None:
                break
            row, err = self.new_row(req)
            if err is not None:
                yield err
                continue
            if not self._fits(free, rows + [row], kept):
                if self.live or rows:
                    self.waiting.insert(0, req)
                    self.rebuild = self._rebuild_pays(free, rows, row, kept)
                    break
                if self.slots or kept:  # nothing in flight: the old batch or the prefix store is in its way
                    self.waiting.insert(0, req)
                    return None, None
            rows.append(row)
        if rows and len(rows) == len(free) and not self.exhausted and not self.waiting:
            # the batch is full: a request read ahead (kept first in `waiting`) tells whether it is
            # drained, so a batch of a job's last rows keeps its best depth from its first round
            req = self._next_request()
            if req is not None:
                self.waiting.insert(0, req)
        self.reach = self._after(free, rows)[1]
        return rows, free

    def place(self, slots: Sequence[int], rows: Sequence[Row], prefilled: Sequence[tuple], reserve: int = 0) -> None:
        """Rows with what their prefill gave (cache, drafter state, first token) into `slots`: idle ones
        with one gather per prefill group, slots past the batch's width widening it (one copy).
        `reserve`: the entries a row's cache holds, made room for at once."""
        width = len(self.slots)
        fills = [(s, row, got) for s, row, got in zip(slots, rows, prefilled) if s < width]
        grow = [(row, got) for s, row, got in zip(slots, rows, prefilled) if s >= width]
        for s, row, (_, state, _) in fills:
            self.slots[s] = row
            if self.drafter is not None:
                self.drafter.write(s, state)
        if fills:
            self.cache.put_rows([s for s, _, _ in fills], [got[0] for _, _, got in fills], reserve)
        if grow:
            kept = [CacheRow(self.cache, i) for i in range(width)] if self.cache is not None else []
            self.cache = BatchCache.gather(kept + [got[0] for _, got in grow], reserve)
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
        `tail_keeps_width()`, and where the copy fits the memory budget beside the batch. Rows keep
        their own slots' state, generators and positions, so output is the same narrowed or not."""
        width = len(self.slots)
        if live <= width // 2 and width > tail_keeps_width():
            to = 1 << (max(live, 1) - 1).bit_length()
            if self.peak(self.shape, (to, self.reach), []) + self.memory.kept() <= self.memory.budget:
                return to
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
