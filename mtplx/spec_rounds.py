"""Speculative rounds: draft, verify, accept, commit, emit; one round ahead where drafting is on the device.

`SpeculativeRounds` is the part of the Engine (generation.py) that runs decode rounds with a
drafter. A drafter that drafts on the device (MTP, a draft model) runs one round ahead, as plain
rounds do: round r+1 is queued from round r's device arrays before round r is read, and each
round is read once (`[W, 2 + K]`: accepted count, next token, drafts). Rows admitted at full
width join behind the round in flight (it is carried across the admission, not read first), so
a refilled stream keeps the device busy while new rows are prefilled; a round read after rows
joined drops what it made in their slots for the rows that left them (`_Flight.rows`). A round's depths and
uniforms are its `_Plan`; for a drafter that drafts ahead (MTP) the next round's plan is made
with this one, so the head's commit of round r and its drafts for round r+1 are one compiled
program (mtp_draft.py) and a round is two programs: the verify and the head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from . import small_ops
from .cache import BatchCache
from .depth import position_counts
from .request import Result
from .sampling import SamplerBatch, accept_greedy, accept_sampled, shaped_probs, uniforms


# With requests waiting, a call returns for admission once 1/REFILL_AT of its slots are free. An
# admission's eager prefill costs a GPU tens of ms of launches and graph builds whatever its size
# (H200, session 8: ~40-80 ms each at width 32), so fewer, larger admissions: 1/4 (was 1/8; window 1,
# 64 / 128 rows at width 32, MTP 1.31x / 1.06x plain against 1.25x / 0.88x).
REFILL_AT = 4


def tail_keeps_width() -> int:
    """The width a drained batch keeps: on a GPU a round of up to 32 rows costs about what one row's
    does (SmolLM2 on the H200: a plain round 4.5 ms at 1 row, 6.1 ms at 32) and every narrower width
    compiles programs of its own; on a CPU a round's cost follows its width."""
    return 32 if mx.default_device().type == mx.DeviceType.gpu else 1


class SpeculativeRounds:
    """Engine methods for decode rounds with a drafter (mixed into generation.Engine)."""

    clock = staticmethod(time.perf_counter)  # what rounds are timed with for the depth controller (tests inject one)

    def _row_depths(self, slots, n_active: int, ahead: int = 0) -> Tuple[np.ndarray, int]:
        """Each row's drafted tokens in the round being queued (`ahead`: rounds queued before it
        and not yet read, each of which emits at least one token), and the round's K.

        Greedy rows follow the adaptive depth (their text cannot change), capped by the tokens
        they can still emit. Sampled rows always draft `speculative.depth` (drafts past their
        max_tokens are cut off at emit): how far a row has got when a round is queued depends on
        when the pipeline last drained, which depends on the other rows, and a sampled row's text
        must depend on its own seed and settings alone, never on which rows share its batch.
        K is the depth a row would draft uncapped: when every row is within it of its max_tokens
        (a job's last rounds) the round keeps its shape, so no verify or draft program is compiled
        for a round or two; each row's own depth is its limit in acceptance, so its tokens and
        stats are what a round of its own depth gives.
        """
        greedy_depth = self.depth_control.choose(n_active)
        depths = np.zeros(len(slots), dtype=np.int64)
        K = 0
        for i, s in enumerate(slots):
            if s is None:
                continue
            if s.req.params.greedy:
                depths[i] = max(0, min(greedy_depth, s.max_tokens - len(s.tokens) - ahead - 1))
                K = max(K, greedy_depth)
            else:
                depths[i] = self.spec.depth
                K = max(K, self.spec.depth)
        return depths, K

    def _round(self, slots: list, active: np.ndarray, cache: BatchCache, drained: bool = False):
        """Speculative rounds. A drafter that drafts on the device (MTP, a draft model) runs one
        round ahead, as `_plain_rounds` does: round r+1 (propose, verify, accept, commit) is
        queued from round r's device arrays before round r is read, and each round is read
        once. Returns when finished rows have freed REFILL_AT-th of the slots for admission (at
        least one), with the round queued next still in flight where the batch is at full width
        (`_carried`: the admission puts its rows into their slots behind it, and the next call
        goes on from it); `drained` (no request waits): finished rows only leave, and the call
        returns, with the pipeline empty, only where the batch narrows next (`_narrows`), or when
        no row is left. Prompt lookup drafts on the host from the tokens it has read: one round per call."""
        sampler = SamplerBatch.from_params([s.req.params if s else None for s in slots])
        pending = mx.array(np.array([s.pending if s else 0 for s in slots], dtype=np.int32))
        self._explore(not drained)
        if not self.drafter.device_side:
            started, built = self.clock(), self._programs_built()
            flight = self._launch(slots, cache, sampler, pending, 0)
            out = self._read(flight)
            self.drafter.commit(out[:, 0], out[:, 1], out[:, 2:], flight.live, flight.verify_in, flight.hidden)
            clean = self._programs_built() == built
            finished = self._land(slots, cache, flight, out, self.clock() - started if clean else None)
            yield from finished
            return
        # Each round is timed from the previous read (the first from its own queueing), which holds
        # the queueing of the round after it: the depth controller gets the time only when that
        # round drafts as deep (then it is what a run of such rounds costs each), else None: a
        # cheap round would carry a costly one's queueing, or the last one none (depth.py). Nor
        # when a program was built since the round was queued (its own or the next one's): that
        # time is a compile's (and on a GPU kernel builds'), not what the depth costs. Nor when the caller
        # had results meanwhile (a job writes its shards).
        built = self._programs_built()
        carried, self._carried = self._carried, None
        if carried is not None:  # queued before the admission that just ran: it goes on from there
            current, plan = carried[0], None
            if all(s is None or s is r for s, r in zip(slots, current.rows)):
                sampler, plan, pending = carried[1], current.plan, None  # no row joined: as if the call had not ended
            else:  # rows that joined have no round in flight: their pending token is their first, the
                # host's, or on the device where it is not read yet (`_joining`)
                joined = np.array([s is not None and s is not r for s, r in zip(slots, current.rows)])
                pending = mx.where(mx.array(joined), self._joined_pending(pending, len(slots)), current.nxt)
        else:
            current, plan, pending = self._launch(slots, cache, sampler, pending, 0), None, None
        landed_at, quiet = self.clock(), True
        while True:
            # a round after this one only if some row can still be going after it (a row emits at
            # least one token a round: one that is a token short of max_tokens ends with this round)
            going = any(s is not None and len(s.tokens) + 1 < s.max_tokens for s in slots)
            built_next = self._programs_built()
            following = (self._launch(slots, cache, sampler, current.nxt if pending is None else pending, 1,
                                      current.plan if carried is None else plan) if going else None)
            # (a round carried across an admission is not timed: the admission's prefill ran meanwhile)
            steady = (carried is None and following is not None and following.K == current.K)
            carried = pending = None
            first = self._land_joined(slots, cache) if self._joining is not None else []  # queued behind `following`
            out = self._read(current)
            now = self.clock()
            steady = steady and self._programs_built() == built and quiet
            finished = first + self._land(slots, cache, current, out, now - landed_at if steady else None)
            landed_at, built = now, built_next
            live = sum(s is not None for s in slots)
            free = len(slots) - live
            if following is not None and finished and not drained and free >= max(1, len(slots) // REFILL_AT):
                # Requests wait: refill a few free slots at once (an idle slot of a wide, launch-bound
                # batch costs ~nothing) with one prefill. At full width a round stays queued across
                # the admission (`_carried`): the round after the one in flight is queued, the one in
                # flight read (so the admission fills the slots both rounds freed, as many as when the
                # pipeline emptied), and the admitted rows are put into their slots behind the queued
                # one; the next call goes on from it, so the device is not left idle.
                if len(slots) >= self.max_batch:
                    going = any(s is not None and len(s.tokens) + 1 < s.max_tokens for s in slots)
                    ahead = self._launch(slots, cache, sampler, following.nxt, 1, following.plan) if going else None
                    finished += self._land(slots, cache, following, self._read(following), None)
                    if ahead is not None:
                        self._carried = (ahead, sampler)
                    else:
                        self._settle(cache)
                    yield from finished
                    return
            elif following is not None and not (drained and finished and (not live or self._narrows(live, len(slots)))):
                quiet = not finished  # what the caller does with a result (a job writes its shards) is no round's
                yield from finished
                current = following
                continue
            if following is not None:
                out = self._read(following)
                finished += self._land(slots, cache, following, out, None)  # nothing queued behind it
            self._settle(cache)
            yield from finished
            return

    _carried = None  # (the round in flight, its sampler) across an admission; None: the pipeline is empty
    # rows placed behind the carried round whose first tokens are not read yet: (those tokens on the
    # device, [(slot, row)]); read once the round they join is queued
    _joining = None

    def _narrows(self, live: int, width: int) -> bool:
        """A drained batch of `width` slots with `live` rows is narrowed (generation.py: Engine.generate)."""
        return self._tail_target(live, width) is not None

    @staticmethod
    def _tail_target(live: int, width: int):
        """The width it moves to, or None: the narrowest power of two holding its live rows, once half
        its slots are idle, where it is wider than `tail_keeps_width()`."""
        if live <= width // 2 and width > tail_keeps_width():
            return 1 << (max(live, 1) - 1).bit_length()
        return None

    def _settle(self, cache: BatchCache) -> None:
        cache.rows.settle()  # exact host lengths again for admission and compaction
        self.drafter.settle()

    def _joined_pending(self, pending: mx.array, W: int) -> mx.array:
        """`pending` [W] with the rows of `_joining` at their first tokens (on the device, not read)."""
        if self._joining is None:
            return pending
        firsts, placed = self._joining
        at, mask = np.zeros(W, dtype=np.int32), np.zeros(W, dtype=bool)
        for j, (slot, _) in enumerate(placed):
            at[slot], mask[slot] = j, True
        return mx.where(mx.array(mask), firsts[mx.array(at)], pending)

    def _land_joined(self, slots, cache: BatchCache) -> List[Result]:
        """Read the first tokens of the rows placed behind the carried round (the round they join is
        queued by now) and emit them: a row that ends at its first token leaves its slot, and the
        rounds queued with it drop what they made there when they are read (`_land`)."""
        (firsts, placed), self._joining = self._joining, None
        got = np.array(firsts).tolist()
        self._progress("decode", sum(1 for f in got if f not in self.eos))
        finished, idle = [], []
        for (slot, row), first in zip(placed, got):
            reason = self._emit(row, [first])
            row.pending = first
            if reason is not None:
                slots[slot] = None
                finished.append(self._finish(row, reason))
                idle.append(slot)
        self._vacate(cache, idle)
        return finished

    def _land_carried(self, slots, cache: BatchCache) -> List[Result]:
        """Read and land the round carried across an admission (before the batch is narrowed, which
        needs exact lengths), and the first tokens of rows placed behind it: the pipeline is empty after it."""
        carried, self._carried = self._carried, None
        if carried is None:
            return []
        first = self._land_joined(slots, cache) if self._joining is not None else []
        finished = first + self._land(slots, cache, carried[0], self._read(carried[0]), None)
        self._settle(cache)
        return finished

    def _explore(self, on: bool) -> None:
        """Adaptive depth tries other depths only while requests wait (`on`): a batch's last rows
        (drained, compacted to narrower widths) keep the best depth, as a fixed depth does."""
        self.depth_control.explore = on

    def _programs_built(self) -> int:
        """Compiled programs so far, the verify bank's and the drafter's (timed rounds skip builds)."""
        return sum(b.stats["programs"] for b in (self.bank, getattr(self.drafter, "bank", None)) if b is not None)

    def _plan(self, slots, n_active: int, ahead: int, sampler: SamplerBatch) -> "_Plan":
        """A round's depths and uniforms, made when it is queued or, for a drafter that drafts
        ahead, when the round before it is. A sampled row draws a fixed number per round (drafts,
        accepts, next token), whatever K is; the vector waits on the row (`u_next`) until a round
        uses it, so a row's draws never depend on where a call ended (that depends on its batch)."""
        W, D = len(slots), self.spec.depth
        depths, K = self._row_depths(slots, n_active, ahead)
        if sampler.all_greedy:  # greedy rows never read their uniforms
            u = self._zeros(W, 2 * D + 1)
        else:
            draws = np.zeros((W, 2 * D + 1), dtype=np.float32)
            for i, s in enumerate(slots):
                if s is not None and not s.req.params.greedy:
                    if s.u_next is None:
                        s.u_next = uniforms(s.rng, 2 * D + 1)
                    draws[i] = s.u_next
            u = mx.array(draws)
        return _Plan(depths, K, u, u[:, :K])

    def _launch(self, slots, cache: BatchCache, sampler: SamplerBatch, pending: mx.array, ahead: int,
                plan: Optional["_Plan"] = None) -> "_Flight":
        """Queue one round on the device (nothing is read): draft, verify, accept, commit; a
        drafter that drafts ahead also drafts the next round (its `_Plan`) in its commit."""
        D = self.spec.depth
        live = np.array([s is not None for s in slots])
        n_active = int(live.sum())
        plan = plan or self._plan(slots, n_active, ahead, sampler)
        for s in slots:
            if s is not None:
                s.u_next = None  # this round uses them
        depths, K, u = np.where(live, plan.depths, 0), plan.K, plan.u
        limit, live_d = self._small(depths.astype(np.int32)), self._small(live)
        if K > 0:
            drafts, q = self.drafter.propose(K, pending, sampler, plan.u_drafts)
        else:
            drafts, q = mx.zeros((len(slots), 0), mx.int32), None
        drafts = drafts.astype(mx.int32)
        most = np.where(live, depths + 1, 0)  # a row keeps at most its own drafts, plus the next token
        accept = None if sampler.all_greedy else (sampler, q, u[:, D : D + K], u[:, 2 * D])
        folded = self._verify_round(pending, drafts, limit, live_d, cache, accept)
        if folded is not None:  # one program: the verify, acceptance, counts and the read
            out, n, nxt, counts, after, verify_in, hidden = folded
            compiled, failures = True, None
            cache.advance(counts, most, after=after)
        else:
            verify_in = small_ops.joined([pending], drafts)
            logits, hidden, compiled, failures = self._verify(verify_in, cache)
            if accept is None:
                n, nxt = accept_greedy(logits, drafts, limit)
            else:
                n, nxt = accept_sampled(shaped_probs(logits, sampler), *((drafts,) + accept[1:]), limit)
            counts = mx.where(live_d, n + 1, 0).astype(mx.int32)
            cache.advance(counts, most)
            out = None
        nxt_plan = None
        if self.drafter.device_side:
            nxt_plan = self._plan(slots, n_active, ahead + 1, sampler)
            ahead_ok = getattr(self.drafter, "drafts_ahead", False) and nxt_plan.K > 0
            following = {"following": (nxt_plan.K, sampler, nxt_plan.u_drafts)} if ahead_ok else {}
            self.drafter.advance(n, nxt, counts, most, verify_in, hidden, **following)
        if out is None:
            out = small_ops.joined([n.astype(mx.int32), nxt.astype(mx.int32)], drafts)
        mx.async_eval(out, cache.rows.device)
        return _Flight(out, nxt.astype(mx.int32), verify_in, hidden, depths, K, live, most, n_active, compiled, failures,
                       list(slots), nxt_plan)

    def _verify_round(self, pending, drafts, limit, live, cache: BatchCache, accept):
        """The round's verify and acceptance as one program (graphbank.verify_round), or None where
        that does not serve (compiled verify off or comparing, an eager shape)."""
        if self.bank is None:
            return None
        return self.bank.verify_round(pending, drafts, limit, live, cache, accept)

    def _small(self, values: np.ndarray) -> mx.array:
        """A round's small per-row array (drafts allowed, rows live) on the device, made once per
        value: most rounds repeat the last one's, and each new one is a host-to-device copy."""
        key = (values.dtype.str, values.tobytes())
        if key not in self._const:
            self._const[key] = mx.array(values)
        return self._const[key]

    def _zeros(self, W: int, n: int) -> mx.array:
        key = (W, n)
        if key not in self._const:
            self._const[key] = mx.zeros((W, n), mx.float32)
        return self._const[key]

    def _read(self, flight: "_Flight") -> np.ndarray:
        """The one host read of a round: [W, 2 + K] of (accepted count, next token, drafts)."""
        self.counters["host_reads"] += 1
        return np.array(flight.out)

    def _land(self, slots, cache: BatchCache, flight: "_Flight", out: np.ndarray, seconds: Optional[float]) -> List[Result]:
        """A round that was read: correct the host lengths, record stats, emit tokens. Rows that
        finished in an earlier round (now None, or another row admitted since into the slot) drop
        what this round made for them; a row admitted since keeps its own length."""
        n_h, nxt_h, drafts_h = out[:, 0].astype(np.int64), out[:, 1], out[:, 2:]
        depths, K, n_active = flight.depths, flight.K, flight.n_active
        same = np.array([s is not None and s is r for s, r in zip(slots, flight.rows)], dtype=bool)
        excess = np.where(same, flight.most - np.where(flight.live, n_h + 1, 0), 0)
        cache.rows.correct(excess)
        if self.drafter.device_side:
            self.drafter.correct(excess)
        self.counters["rounds"] += 1
        greedy = same & np.array([s is not None and s.req.params.greedy for s in slots], dtype=bool)
        if greedy.any():
            tried = int(np.minimum(n_h + 1, depths)[greedy].sum())
            reached, passed = position_counts(n_h[greedy], depths[greedy], K)
            self.depth_control.record(n_active, K, seconds, int(n_h[greedy].sum()), tried, reached, passed)
        finished, emitted, D = [], 0, self.spec.depth
        # plain lists: indexing numpy per row and token costs more than the work itself
        k_of, a_of, nxt_of, drafts_of = depths.tolist(), n_h.tolist(), nxt_h.tolist(), drafts_h.tolist()
        for i, row in enumerate(slots):
            if not same[i]:
                continue
            st, k, a = row.stats, k_of[i], a_of[i]
            row.rounds += 1
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
            self._record_forward(st, i, flight.compiled, flight.failures)
            before = len(row.tokens)
            reason = self._emit(row, drafts_of[i][:a] + [nxt_of[i]])
            emitted += len(row.tokens) - before
            row.pending = nxt_of[i]
            if reason is not None:
                slots[i] = None
                finished.append(self._finish(row, reason))
        self._vacate(cache, [i for i in np.flatnonzero(same) if slots[i] is None])
        self._progress("decode", emitted)
        return finished

    def _vacate(self, cache: BatchCache, idle: List[int]) -> None:
        """Slots whose rows just finished hold no entries: later rounds (until a row is placed there)
        attend over none of theirs (rows_attention reads a row's keys up to its length only)."""
        if idle:
            cache.rows.place(idle, [0] * len(idle))
            drafter_cache = getattr(self.drafter, "cache", None)
            if drafter_cache is not None and drafter_cache.batch == cache.batch:
                drafter_cache.rows.place(idle, [0] * len(idle))


@dataclass
class _Flight:
    """A queued speculative round: its lazy outputs and what the host knew when it queued it."""

    out: mx.array  # [W, 2 + K]: accepted count, next token, drafts
    nxt: mx.array
    verify_in: mx.array
    hidden: Optional[mx.array]
    depths: np.ndarray
    K: int
    live: np.ndarray  # rows in flight when it was queued
    most: np.ndarray  # host upper bound of each row's committed tokens
    n_active: int
    compiled: bool
    failures: Optional[np.ndarray]
    rows: list  # the slots' rows when it was queued (a slot may hold another row when it is read)
    plan: Optional["_Plan"] = None  # the next round's, made with this one


@dataclass
class _Plan:
    """A round's drafted depth per row, its K, its uniforms [W, 2D + 1] and their draft part."""

    depths: np.ndarray
    K: int
    u: mx.array
    u_drafts: mx.array
