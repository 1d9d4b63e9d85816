"""Decode rounds over the batch's rows: plan, launch, land, one round queued ahead of the one read
(docs/architecture.md). A plan is made when its round is queued, or with the round before it for a
drafter that drafts ahead (MTP: the head's commit of round r and its drafts for round r+1 are one
program). Where nothing needs the host between rounds, round r+1 is queued from round r's device
arrays before round r is read, so building one round's graph overlaps running the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from . import small_ops
from .cache import BatchCache
from .counters import Counters
from .depth import DepthController, RowAcceptance, position_counts
from .request import Result, RowStats
from .sampling import SamplerBatch, accept_greedy, accept_sampled, sample_from, shaped_probs, uniforms
from .scheduler import Scheduler

# With requests waiting, a call returns for admission once 1/REFILL_AT of its slots are free: an admission
# costs a GPU tens of ms whatever its size (H200, width 32: ~40-80 ms), an idle slot of a wide batch ~nothing.
REFILL_AT = 4


@dataclass
class Plan:
    """A round's drafted depth per row, its K, its uniforms [W, 2D + 1] and their draft part."""

    depths: np.ndarray
    K: int
    u: mx.array
    u_drafts: mx.array


@dataclass
class Flight:
    """A queued round: its lazy outputs and what the host knew when it queued it."""

    out: mx.array  # [W, 2 + K]: accepted count, next token, drafts ([W] next tokens for a plain round)
    nxt: mx.array
    compiled: bool
    failures: Optional[np.ndarray]
    built: int = 0  # programs built before it was queued
    verify_in: Optional[mx.array] = None
    hidden: Optional[mx.array] = None
    depths: Optional[np.ndarray] = None
    K: int = 0
    live: Optional[np.ndarray] = None  # rows in flight when it was queued
    most: Optional[np.ndarray] = None  # host upper bound of each row's committed tokens
    n_active: int = 0
    rows: tuple = ()  # the slots' rows when it was queued (a slot may hold another row when it is read)
    plan: Optional[Plan] = None  # the next round's, made with this one
    carried: bool = False  # kept in flight across an admission


class Rounds:
    clock = staticmethod(time.perf_counter)  # what rounds are timed with for the depth controller (tests inject one)

    def __init__(self, drafter, bank, runtime, depth: DepthController, counters: Counters, progress: Callable,
                 max_depth: int, max_batch: int, one_stream_eager: bool):
        self.drafter = drafter
        self.bank = bank
        self.runtime = runtime
        self.depth = depth
        self.counters = counters
        self.progress = progress
        self.max_depth = max_depth  # speculative.depth: the deepest round, the uniforms' layout
        self.max_batch = max_batch
        self.one_stream_eager = one_stream_eager  # one-row plain decoding eagerly (calibrated faster)
        self._const = {}  # small device arrays by value (`_small`)
        self.reset()

    def reset(self) -> None:
        self.carried: Optional[Tuple[Flight, SamplerBatch]] = None  # the round in flight across an admission
        self.joining: Optional[tuple] = None  # rows placed behind it, first tokens unread: (firsts, [(slot, row)])
        self._ones: Optional[np.ndarray] = None  # the rows a plain round advances

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, sched: Scheduler) -> Iterator[Result]:
        """Rounds until the batch should admit (`_leaves`) or no row can go on; yields finished rows."""
        slots = sched.slots
        if self.drafter is not None:
            self.depth.explore = not sched.drained  # a batch's last rows keep the best depth: no tries
        carried, self.carried = self.carried, None
        if carried is None:
            sampler = SamplerBatch.from_params([s.req.params if s else None for s in slots])
            self._ones = np.array([s is not None for s in slots], dtype=np.int64)
            plan = self.plan(slots, sched.live, 0, sampler, self._left(sched)) if self._host else None
            if plan is not None and plan.K:
                yield from self._host_round(sched, sampler, plan)
                return
            current = self.launch(sched, sampler, self._pending(slots), 0, plan)
            after = (current.nxt, current.plan)
        else:  # queued before the admission that just ran: it goes on from there
            current, sampler = carried
            after = (current.nxt, current.plan)
            if self.joining is not None:  # joined rows have no round in flight: their first token next
                sampler = SamplerBatch.from_params([s.req.params if s else None for s in slots])
                firsts, placed = self.joining
                at, mask = np.zeros(len(slots), dtype=np.int32), np.zeros(len(slots), dtype=bool)
                for j, (slot, _) in enumerate(placed):
                    at[slot], mask[slot] = j, True
                after = (mx.where(mx.array(mask), firsts[mx.array(at)], current.nxt), None)
        landed_at, quiet = self.clock(), True
        while True:
            following = self._queue_next(sched, sampler, after) if _going(slots) else None
            finished = self._land_joined(sched) if self.joining is not None else []  # queued behind `following`
            out = self.read(current)
            seconds = None
            if self.drafter is not None:
                now = self.clock()
                seconds = now - landed_at if self._priced(current, following, quiet) else None
                landed_at = now
            finished += self.land(sched, current, out, seconds)
            if following is not None and not (finished and self._leaves(sched)):
                quiet = not finished  # what the caller does with a result (a job writes its shards) is no round's
                yield from finished
                current, after = following, (following.nxt, following.plan)
                continue
            if following is not None:
                carry = self._carries(sched) and _going(slots)
                ahead = self.launch(sched, sampler, following.nxt, 1, following.plan) if carry else None
                finished += self.land(sched, following, self.read(following), None)
                if ahead is not None:
                    ahead.carried = True
                    self.carried = (ahead, sampler)
            if self.carried is None and self.drafter is not None:
                self._settle(sched.cache, done=sched.drained and not sched.live)
            yield from finished
            return

    @property
    def _host(self) -> bool:
        """A drafter that drafts on the host from what a round read (its rounds at depth 0 queue ahead)."""
        return self.drafter is not None and not self.drafter.device_side

    def _queue_next(self, sched: Scheduler, sampler: SamplerBatch, after: tuple) -> Optional[Flight]:
        """The round after the one in flight, queued before that one is read: `after` = (its pending
        tokens, its plan if made with it); None where a host drafter drafts it (that needs the read)."""
        plan = after[1]
        if plan is None and self._host:
            plan = self.plan(sched.slots, sched.live, 1, sampler, self._left(sched))
            if plan.K:
                return None
        return self.launch(sched, sampler, after[0], 1, plan)

    def _leaves(self, sched: Scheduler) -> bool:
        """Whether the call returns after a round that finished rows: with requests waiting, once
        1/REFILL_AT of the slots are free; drained, where no row is left or the batch narrows next."""
        live, width = sched.live, len(sched.slots)
        if sched.drained:
            return not live or sched.narrows(live) is not None
        return width - live >= max(1, width // REFILL_AT)

    def _carries(self, sched: Scheduler) -> bool:
        """Whether the round after the one landed last stays queued across the admission (at full width
        with requests waiting: admitted rows are placed behind it, the device is not left idle)."""
        return (self.drafter is not None and self.drafter.device_side and not sched.drained
                and len(sched.slots) >= self.max_batch)

    def _priced(self, current: Flight, queued: Optional[Flight], quiet: bool) -> bool:
        """Whether the time from the read before `current` to its own read is what a round of its depth
        costs (fed to the depth controller, else None). That time holds the queueing of `queued`, so
        only where that one drafts as deep; never over a program's build, a round carried across an
        admission (the prefill ran meanwhile), or the caller's work with its results (not `quiet`)."""
        return (queued is not None and queued.K == current.K and not current.carried and quiet
                and self.counters.programs_built == current.built)

    def _host_round(self, sched: Scheduler, sampler: SamplerBatch, plan: Plan) -> Iterator[Result]:
        """One round of a drafter that drafts on the host: queued, read, landed (the drafter commits there)."""
        started = self.clock()
        flight = self.launch(sched, sampler, self._pending(sched.slots), 0, plan)
        out = self.read(flight)
        seconds = self.clock() - started if self._priced(flight, flight, True) else None
        yield from self.land(sched, flight, out, seconds)

    @staticmethod
    def _pending(slots) -> mx.array:
        return mx.array(np.array([s.pending if s else 0 for s in slots], dtype=np.int32))

    # -- plan ----------------------------------------------------------------------------------------
    def plan(self, slots, n_active: int, ahead: int, sampler: SamplerBatch, left: Optional[float] = None) -> Plan:
        """A round's depths and uniforms, queued behind `ahead` rounds not read yet; `left`: the tokens
        the work left may emit (`_left`). Greedy rows follow the depth controller, capped by the tokens
        they can still emit; a sampled row drafts its own depth and draws a fixed number of uniforms a
        round, both kept on the row until a round uses them, so its text depends on its seed alone.
        K is the uncapped depth: a job's last rounds keep their shape (no program for a round or two)."""
        W, D, ctrl = len(slots), self.max_depth, self.depth
        depths = np.zeros(W, dtype=np.int64)
        greedy, caps, floor, extra = [], [], 0, 0.0
        for i, s in enumerate(slots):
            if s is None:
                continue
            if s.accept is None:
                s.accept = RowAcceptance(D, sampled=not s.req.params.greedy)
            if s.req.params.greedy:
                greedy.append(i)
                caps.append(max(0, s.max_tokens - len(s.tokens) - ahead - 1))
            else:
                depths[i] = ctrl.sampled_depth(s.accept)
                floor, extra = max(floor, int(depths[i])), extra + ctrl.sampled_tokens(s.accept, int(depths[i]))
        K = floor
        if greedy:
            built = self.counters.programs_built
            ctrl.build_seconds = self.counters.first_call_seconds / built if built else 0.0
            K = max(K, ctrl.choose(n_active, accept=ctrl.row_acceptance([slots[i].accept for i in greedy]), caps=caps,
                                   floor=floor, extra=extra, left=left, shape=W, lag=self.drafter.lag))
            depths[greedy] = np.minimum(K, caps)
        if sampler.all_greedy:  # greedy rows never read their uniforms
            u = self._small(np.zeros((W, 2 * D + 1), dtype=np.float32))
        else:
            draws = np.zeros((W, 2 * D + 1), dtype=np.float32)
            for i, s in enumerate(slots):
                if s is not None and not s.req.params.greedy:
                    if s.u_next is None:
                        s.u_next = uniforms(s.rng, 2 * D + 1)
                    draws[i] = s.u_next
            u = mx.array(draws)
        return Plan(depths, K, u, u[:, :K])

    def _left(self, sched: Scheduler) -> float:
        """The tokens the work left may emit: the rows in flight's, plus a row as long as theirs for each
        request not taken yet (`Engine.expected_requests`, else a batch of them)."""
        rows = [s for s in sched.slots if s is not None]
        left = sum(max(0, s.max_tokens - len(s.tokens)) for s in rows)
        if not sched.drained and rows:
            more = self.max_batch if sched.expected is None else max(0, sched.expected - sched.pulled)
            left += (len(sched.waiting) + more) * sum(s.max_tokens for s in rows) / len(rows)
        return float(left)

    # -- launch --------------------------------------------------------------------------------------
    def launch(self, sched: Scheduler, sampler: SamplerBatch, pending: mx.array, ahead: int,
               plan: Optional[Plan] = None) -> Flight:
        """Queue one round (nothing is read): draft, verify, accept, commit; a drafter that drafts
        ahead drafts the next round in its commit too."""
        if self.drafter is None:
            return self._launch_plain(sched, sampler, pending)
        slots, cache, D = sched.slots, sched.cache, self.max_depth
        built, started = self.counters.programs_built, time.perf_counter()
        live = np.array([s is not None for s in slots])
        n_active = int(live.sum())
        left = self._left(sched)
        plan = plan or self.plan(slots, n_active, ahead, sampler, left)
        for s in slots:
            if s is not None:
                s.u_next = None  # this round uses them (and its sampled depth)
                if s.accept is not None:
                    s.accept.launch()
        depths, K, u = np.where(live, plan.depths, 0), plan.K, plan.u
        limit, live_d = self._small(depths.astype(np.int32)), self._small(live)
        if K > 0:
            drafts, q = self.drafter.propose(K, pending, sampler, plan.u_drafts)
        else:
            drafts, q = mx.zeros((len(slots), 0), mx.int32), None
        drafts = drafts.astype(mx.int32)
        proposed = time.perf_counter()
        most = np.where(live, depths + 1, 0)  # a row keeps at most its own drafts, plus the next token
        accept = None if sampler.all_greedy else (sampler, q, u[:, D : D + K], u[:, 2 * D])
        folded = None if self.bank is None else self.bank.verify_round(pending, drafts, limit, live_d, cache, accept)
        if folded is not None:  # one program: the verify, acceptance, counts and the read
            out, n, nxt, counts, after, verify_in, hidden = folded
            compiled, failures = True, None
            cache.advance(counts, most, after=after)
        else:
            verify_in = small_ops.joined([pending], drafts)
            logits, hidden, compiled, failures = self.verify(verify_in, cache)
            if accept is None:
                n, nxt = accept_greedy(logits, drafts, limit)
            else:
                n, nxt = accept_sampled(shaped_probs(logits, sampler), *((drafts,) + accept[1:]), limit)
            counts = mx.where(live_d, n + 1, 0).astype(mx.int32)
            cache.advance(counts, most)
            out = None
        verified = time.perf_counter()
        nxt_plan = None
        if self.drafter.device_side:
            nxt_plan = self.plan(slots, n_active, ahead + 1, sampler, left)
            ahead_ok = self.drafter.drafts_ahead and nxt_plan.K > 0
            self.drafter.advance(n, nxt, counts, most, verify_in, hidden,
                                 following=(nxt_plan.K, sampler, nxt_plan.u_drafts) if ahead_ok else None)
        if out is None:
            out = small_ops.joined([n.astype(mx.int32), nxt.astype(mx.int32)], drafts)
        mx.async_eval(out, cache.rows.device)
        self.counters.propose_seconds += proposed - started + time.perf_counter() - verified
        self.counters.verify_seconds += verified - proposed
        return Flight(out, nxt.astype(mx.int32), compiled, failures, built, verify_in, hidden, depths, K, live, most,
                      n_active, tuple(slots), nxt_plan)

    def _launch_plain(self, sched: Scheduler, sampler: SamplerBatch, pending: mx.array) -> Flight:
        """A plain decoding round: one token a row, as mlx-lm's generate_step makes it."""
        slots, cache = sched.slots, sched.cache
        started = time.perf_counter()
        logits, _, compiled, failures = self.verify(pending[:, None], cache, self.one_stream_eager and len(slots) == 1)
        if sampler.all_greedy:  # no uniforms to draw: greedy rows never read their generator
            nxt = mx.argmax(logits[:, 0], axis=-1).astype(mx.int32)
        else:
            u = mx.array(np.array([uniforms(s.rng) if s is not None else 0.0 for s in slots], dtype=np.float32))
            nxt = sample_from(shaped_probs(logits, sampler)[:, 0], u)
        cache.commit(self._ones)  # (the host's lengths stay exact: a finished row's slot stops)
        mx.async_eval(nxt)
        self.counters.verify_seconds += time.perf_counter() - started
        return Flight(nxt, nxt, compiled, failures)

    def verify(self, tokens: mx.array, cache: BatchCache, eager: bool = False):
        """The target model over `tokens` [W, L]: (logits, hidden, compiled?, parity failures per row);
        `eager`: the eager forward even where the compiled bank is on."""
        if self.bank is not None and not eager:
            return self.bank.verify(tokens, cache)
        cache.set_capturing(True)
        logits, hidden = self.runtime.forward(tokens, cache)
        cache.set_capturing(False)
        return logits, hidden, False, None

    def _small(self, values: np.ndarray) -> mx.array:
        """A small per-row array on the device, made once per value (most rounds repeat the last one's)."""
        key = (values.dtype.str, values.tobytes())
        if key not in self._const:
            self._const[key] = mx.array(values)
        return self._const[key]

    # -- land ----------------------------------------------------------------------------------------
    def read(self, flight: Flight) -> np.ndarray:
        """The one host read of a round."""
        self.counters.host_reads += 1
        return np.array(flight.out)

    def land(self, sched: Scheduler, flight: Flight, out: np.ndarray, seconds: Optional[float]) -> List[Result]:
        """A round that was read: correct the host lengths, record stats, emit tokens. A slot whose row
        finished since the round was queued drops what the round made there."""
        if self.drafter is None:
            return self._land_plain(sched, flight, out)
        slots, cache = sched.slots, sched.cache
        n_h, nxt_h, drafts_h = out[:, 0].astype(np.int64), out[:, 1], out[:, 2:]
        depths, K, n_active = flight.depths, flight.K, flight.n_active
        same = np.array([s is not None and s is r for s, r in zip(slots, flight.rows)], dtype=bool)
        excess = np.where(same, flight.most - np.where(flight.live, n_h + 1, 0), 0)
        cache.rows.correct(excess)
        if self.drafter.device_side:
            self.drafter.correct(excess)
        else:  # a host drafter learns what was kept from this read (rounds at depth 0 too)
            self.drafter.commit(n_h, nxt_h, drafts_h, flight.live & same, flight.verify_in, flight.hidden)
        self.counters.rounds += 1
        greedy = same & np.array([s is not None and s.req.params.greedy for s in slots], dtype=bool)
        tried = int(np.minimum(n_h + 1, depths)[greedy].sum())
        reached, passed = position_counts(n_h[greedy], depths[greedy], K)
        self.depth.record(n_active, K, seconds, int(n_h[greedy].sum()), tried, reached, passed, shape=len(flight.rows))
        finished, emitted, D = [], 0, self.max_depth
        # plain lists: indexing numpy per row and token costs more than the work itself
        k_of, a_of, nxt_of, drafts_of = depths.tolist(), n_h.tolist(), nxt_h.tolist(), drafts_h.tolist()
        for i, row in enumerate(slots):
            if not same[i]:
                continue
            st, k, a = row.stats, k_of[i], a_of[i]
            row.rounds += 1
            if row.accept is not None:
                row.accept.add(k, a)
            row.width_sum += n_active
            row.depth_sum += k
            if k > 0:
                st.verify_calls += 1
                st.drafted_tokens += k
                st.accepted_tokens += a
                by_depth = st.accepted_by_depth
                if len(by_depth) < D:
                    by_depth += [0] * (D - len(by_depth))
                for j in range(a):
                    by_depth[j] += 1
            _record_forward(st, i, flight.compiled, flight.failures)
            before = len(row.tokens)
            reason = sched.emit(row, drafts_of[i][:a] + [nxt_of[i]])
            emitted += len(row.tokens) - before
            row.pending = nxt_of[i]
            if reason is not None:
                slots[i] = None
                finished.append(sched.finish(row, reason))
        sched.vacate([i for i in np.flatnonzero(same) if slots[i] is None])
        self.progress("decode", emitted)
        return finished

    def _land_plain(self, sched: Scheduler, flight: Flight, tokens: np.ndarray) -> List[Result]:
        slots, finished, emitted, vacated = sched.slots, [], 0, []
        n_active = sum(s is not None for s in slots)
        for i, row in enumerate(slots):
            if row is None:
                continue
            _record_forward(row.stats, i, flight.compiled, flight.failures)
            row.rounds += 1
            row.width_sum += n_active
            row.pending = int(tokens[i])
            before = len(row.tokens)
            reason = sched.emit(row, [row.pending])
            emitted += len(row.tokens) - before
            if reason is not None:
                slots[i] = None
                self._ones[i] = 0
                finished.append(sched.finish(row, reason))
                vacated.append(i)
        sched.vacate(vacated)
        self.counters.rounds += 1
        self.progress("decode", emitted)
        return finished

    def _settle(self, cache: BatchCache, done: bool = False) -> None:
        cache.rows.settle()  # exact host lengths again for admission and narrowing
        self.drafter.settle(done)

    # -- admissions behind the round in flight -------------------------------------------------------
    def join(self, sched: Scheduler, firsts: mx.array, placed: list) -> None:
        """Rows were placed behind the carried round, first tokens unread: the device starts placing
        them while the host queues the round they join."""
        self.joining = (firsts, placed)
        arrays = [a for c in sched.cache.leaves for a in c.state_arrays() if a is not None]
        mx.async_eval(arrays + (self.drafter.state_arrays() if self.drafter is not None else []))

    def _land_joined(self, sched: Scheduler) -> List[Result]:
        """Read and emit the first tokens of the rows placed behind the carried round."""
        (firsts, placed), self.joining = self.joining, None
        got = np.array(firsts).tolist()
        self.progress("decode", sum(1 for f in got if f not in sched.eos))
        finished, idle = [], []
        for (slot, row), first in zip(placed, got):
            reason = sched.emit(row, [first])
            row.pending = first
            if reason is not None:
                sched.slots[slot] = None
                finished.append(sched.finish(row, reason))
                idle.append(slot)
        sched.vacate(idle)
        return finished

    def land_carried(self, sched: Scheduler) -> List[Result]:
        """Read and land the round carried across an admission and the rows placed behind it (before
        the batch narrows, which needs exact lengths): the pipeline is empty after it."""
        carried, self.carried = self.carried, None
        if carried is None:
            return []
        finished = self._land_joined(sched) if self.joining is not None else []
        finished += self.land(sched, carried[0], self.read(carried[0]), None)
        self._settle(sched.cache)
        return finished


def _going(slots) -> bool:
    """Whether a round after the one in flight has a row to serve (a round emits at least a token a row)."""
    return any(s is not None and len(s.tokens) + 1 < s.max_tokens for s in slots)


def _record_forward(st: RowStats, i: int, compiled: bool, failures) -> None:
    """Every decode forward of a row (drafting or not, plain rounds too) counts on one path."""
    if compiled:
        st.compiled_verify_calls += 1
    else:
        st.eager_verify_calls += 1
    if failures is not None:
        st.parity_failures += int(failures[i])
