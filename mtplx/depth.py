"""Adaptive draft depth: every round, a cost model per (width, depth) picks a drafting depth or plain
decoding (depth 0): the depth that finishes the work left soonest, from measured round costs, each row's
running acceptance and the builds its programs still need.

A round drafting k emits 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens for a row whose draft j passes with
chance a_j once draft j-1 has; each row counts up to the tokens it may still emit, so a batch whose good
rows leave falls back to plain decoding by itself. A width's first rounds decode plainly, then at the
deepest depth, until each is timed; then it now and then tries a neighbouring depth.

A sampled row's text depends on its seed and settings alone, never on timing or its batch mates, so its
depth (`sampled_depth`) comes from its own counts, the drafter's fixed prior and fixed costs, as they
were PLAN_LAG rounds before (a round is planned at most that far ahead of the last one read).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

EXPLORE_EVERY = 16  # rounds between tries of a neighbouring depth, at first;
EXPLORE_MOST = 64  # doubling up to this while the tries leave the best depth where it was
TRY_ROUNDS = 2  # rounds a neighbour try lasts (its last one is followed by another depth: untimed)
# A width's first rounds: plain until one is timed, then the deepest depth until one is timed (both
# ends measured: this device's cost per drafted token), at most FIRST_MOST rounds each
FIRST_MOST = 6
UNTRIED_SLOPE = 0.15  # assumed extra cost per drafted token on a GPU before it is measured (optimistic)
CPU_SLOPE = 1.0  # on a CPU a round's cost follows the tokens it computes: a drafted token costs a verified one
# A (width, depth)'s cost is the median of its last MEDIAN_OF timed rounds: one slow round (a host
# hiccup, a GC pause) moves it not at all
MEDIAN_OF = 5
TRY_PAYBACK = 8  # a try that builds programs is made only where they cost under 1/8 of the seconds left
PRIOR_WEIGHT = 2.0  # pseudo-counts of the pool's (a sampled row: the prior's) a_j in a row's own
ROW_DECAY = 0.8  # a row's counts fade by this each round it drafts: its acceptance of its last ~5 rounds
PLAN_LAG = 3  # rounds between the last round a sampled row's depth reads and the round it drafts
SAMPLED_RETRY = 32  # a sampled row at depth 0 drafts one token every this many rounds (what it earns now)


class RowAcceptance:
    """One row's decayed counts of drafts that reached / passed each position (a list: [reached by
    position, then passed by position], cheap to update every round), as they were after each of its
    last rounds where it samples, and its next sampled round's depth (kept until a round uses it)."""

    def __init__(self, depth: int, sampled: bool = False):
        self.counts = [0.0] * (2 * depth)
        self.past: Optional[List[list]] = [self.counts] if sampled else None  # counts after its last rounds
        self.landed = 0  # its rounds read
        self.launched = 0  # its rounds queued
        self.next_depth: Optional[int] = None

    def add(self, drafted: int, passed: int) -> None:
        """A round of this row was read: it drafted `drafted` tokens, `passed` of them passed."""
        if drafted:
            D = len(self.counts) // 2
            c = [x * ROW_DECAY for x in self.counts]
            for j in range(min(passed + 1, drafted)):
                c[j] += 1.0
            for j in range(passed):
                c[D + j] += 1.0
            self.counts = c
        self.landed += 1
        if self.past is not None:
            self.past.append(self.counts)
            del self.past[: -PLAN_LAG - 1]

    def as_of(self, rounds: int) -> list:
        """The counts after the row's first `rounds` rounds (a sampled row that landed at least that many)."""
        if rounds <= 0:
            return [0.0] * len(self.counts)
        return self.past[len(self.past) - 1 - (self.landed - rounds)]

    def launch(self) -> None:
        self.launched += 1
        self.next_depth = None


def blended(counts, prior: np.ndarray) -> np.ndarray:
    """a_j from counts [..., 2D] (reached, then passed, by position) with PRIOR_WEIGHT pseudo-counts of
    `prior` [D]."""
    counts = np.asarray(counts, dtype=np.float64)
    D = counts.shape[-1] // 2
    return (counts[..., D:] + PRIOR_WEIGHT * prior) / (counts[..., :D] + PRIOR_WEIGHT)


def tokens_by_depth(a: np.ndarray) -> np.ndarray:
    """[..., D + 1]: expected tokens of a round drafting 0..D, from a_j [..., D]."""
    run = np.cumprod(np.clip(a, 0.0, 0.99), axis=-1)
    return np.concatenate([np.ones(a.shape[:-1] + (1,)), 1.0 + np.cumsum(run, axis=-1)], axis=-1)


class DepthController:
    def __init__(self, max_depth: int, adaptive: bool = True, acceptance: float = 0.7,
                 shapes: Optional[Dict[int, List[float]]] = None, prior: Optional[List[float]] = None,
                 slope: float = UNTRIED_SLOPE, programs: int = 1, fixed_width: int = 1):
        self.max_depth = max_depth
        self.shapes = dict(shapes or {})  # width -> relative verify cost by depth (calibrate.cost_shapes)
        self.adaptive = adaptive
        self.slope = slope  # fixed extra cost per drafted token: before it is measured, and sampled rows'
        self.fixed_width = fixed_width  # the width sampled rows' fixed costs are read at (the job's max_batch)
        self.programs = programs  # programs a drafting depth builds at a new width (plain: one)
        self.acceptance = acceptance  # per-token, EMA over rounds (the prior for unmeasured positions)
        self.passed: Dict[int, float] = {}  # draft position j -> EMA of P(draft j passes | j-1 passed)
        if prior:  # the drafter's recorded a_j (position 1 first)
            self.passed = {j: float(a) for j, a in enumerate(prior, start=1)}
            self.acceptance = float(prior[0])
        # a sampled row's prior: the recorded a_j, fixed (never the pool, which its batch mates move)
        self.fixed = np.array([self.position_acceptance(j) for j in range(1, max_depth + 1)])
        self.seconds: Dict[Tuple[int, int], float] = {}  # (width bucket, depth) -> round time (MEDIAN_OF)
        self.seen: Dict[Tuple[int, int], int] = {}
        self.samples: Dict[Tuple[int, int], List[float]] = {}  # the last MEDIAN_OF timed rounds
        self.built: set = set()  # (program width, depth) whose programs are built
        self.build_seconds = 0.0  # one program's build here (the engine's measure)
        self.explore = True  # tries of other depths (off: the best depth only)
        self.widths: Dict[int, _Tries] = {}  # width bucket -> its rounds and tries (each width explores on its own)

    @staticmethod
    def _bucket(width: int) -> int:
        return 1 << max(0, width - 1).bit_length()

    def _shape(self, bucket: int, k: int) -> float:
        """Relative cost of depth k at this width: the calibrated curve of the nearest width
        (in log2) that reaches depth k, else the fixed slope."""
        near = [w for w, c in self.shapes.items() if len(c) > k]
        if not near:
            return 1.0 + self.slope * k
        w = min(near, key=lambda w: abs(math.log2(w) - math.log2(bucket)))
        return self.shapes[w][k]

    def _cost(self, bucket: int, k: int) -> float:
        if (bucket, k) in self.seconds:
            return self.seconds[(bucket, k)]
        known = {d: t for (b, d), t in self.seconds.items() if b == bucket}
        if not known:  # nothing measured at this width: the nearest measured width's curve (in log2),
            # else relative units (a batch's last rows pass through narrower widths a few rounds each)
            near = {b for b, _ in self.seconds}
            if not near:
                return self._shape(bucket, k)
            return self._cost(min(near, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), b)), k)
        d0, t0 = min(known.items(), key=lambda kv: abs(kv[0] - k))
        if len(known) > 1:  # two depths measured: their own cost per drafted token, not the assumed
            # shape (a draft model's step costs most of a target step; a verify token far less)
            d1, t1 = min(((d, t) for d, t in known.items() if d != d0), key=lambda kv: abs(kv[0] - k))
            slope = max((t1 - t0) / (d1 - d0), 0.0)
            return max(t0 + slope * (k - d0), 0.25 * t0)
        return t0 * self._shape(bucket, k) / self._shape(bucket, d0)

    def position_acceptance(self, j: int) -> float:
        """a_j: measured at draft position j, else the deepest measured position's (acceptance
        rarely rises with depth), else the per-token prior."""
        if j in self.passed:
            return self.passed[j]
        below = [i for i in self.passed if i < j]
        return self.passed[max(below)] if below else self.acceptance

    def pool(self) -> np.ndarray:
        return np.array([self.position_acceptance(j) for j in range(1, self.max_depth + 1)])

    def _build(self, shape: Optional[int], k: int, cost: Sequence[float], lag: int = 0) -> float:
        """Seconds depth k costs before its first round at this program width: its programs' builds
        (none once built) and, from plain decoding, the drafter's `lag` rounds of catching up (in
        commits of k + 1 rounds, each costing about what drafting adds to a round). 0 while no round
        is timed (round costs are relative units then). `cost`: this width's round cost by depth."""
        if not self.seconds:
            return 0.0
        build = 0.0 if shape is None or (shape, k) in self.built else self.build_seconds * (self.programs if k else 1)
        if k and lag:
            build += lag * max(cost[k] - cost[0], 0.0) / (k + 1)
        return build

    def choose(self, width: int, accept: Optional[np.ndarray] = None, caps: Optional[Sequence[int]] = None,
               floor: int = 0, extra: float = 0.0, left: Optional[float] = None, shape: Optional[int] = None,
               lag: int = 0) -> int:
        """The greedy rows' depth for a round of `width` rows. `accept`: the greedy rows' a_j [G, D]
        (None: one row at the pool's), `caps`: the drafts each may still use; `floor`: the depth the
        round drafts anyway (its sampled rows'), `extra`: their expected tokens; `left`: the tokens
        the work left may emit (None: unbounded); `shape`: the width its programs are built for.
        With `explore` off (a batch's last rows) the best depth, no tries: what a try would teach has
        no rounds left to pay off."""
        if not self.adaptive:
            return self.max_depth
        bucket, D = self._bucket(width), self.max_depth
        a = self.pool()[None] if accept is None else accept
        by_depth = tokens_by_depth(a)  # [G, D + 1]
        if caps is not None and min(caps) < D:  # rows near their end: each counts up to its cap
            upto = np.minimum(np.arange(D + 1)[None], np.asarray(caps)[:, None])
            by_depth = by_depth[np.arange(len(a))[:, None], upto]
        tokens = by_depth.sum(axis=0) + extra  # [D + 1]
        cost = [self._cost(bucket, k) for k in range(D + 1)]
        rate = [tokens[k] / cost[max(k, floor)] for k in range(D + 1)]
        build = [self._build(shape, max(k, floor), cost, lag) for k in range(D + 1)]
        finish = [(build[k] + (left / rate[k] if left is not None else -rate[k]), k)
                  for k in range(D + 1)]  # (ties: the shallower depth)
        best = min(range(D + 1), key=lambda k: finish[k])
        if not self.explore:
            return best
        w = self.widths.setdefault(bucket, _Tries())
        w.rounds += 1
        n = w.rounds
        # a try is made where its build is cheap beside what is left (an unbounded left: always)
        affordable = lambda k: left is None or build[k] * TRY_PAYBACK <= left / rate[best]
        for phase, k in enumerate((0, D)):  # what drafting must beat, then what it costs here, measured
            if w.phase == phase:
                if (bucket, k) in self.seconds or w.first >= FIRST_MOST or not affordable(k):
                    w.phase, w.first = phase + 1, 0
                else:
                    w.first += 1
                    return k
        if n == w.next:
            w.every = min(2 * w.every, EXPLORE_MOST) if best == w.best_then else EXPLORE_EVERY
            w.best_then, w.next, w.count = best, n + w.every, w.count + 1
            k = best + 1 if w.count % 2 else best - 1  # tries alternate the depths above and below the best
            if k > D:
                k = 0  # at the deepest: plain decoding again, what drafting must beat (one high time stays otherwise)
            elif k < 0:
                k = D  # at plain decoding: the deepest depth again, what drafting can earn at most
            # a depth never timed at this width: its first round builds, so it runs a round longer
            rounds = TRY_ROUNDS + ((bucket, k) not in self.seconds)
            w.depth, w.until = (k, n + rounds) if affordable(k) else (best, n)
        return w.depth if n < w.until else best

    def sampled_depth(self, row: RowAcceptance) -> int:
        """A sampled row's next depth from its own counts as of PLAN_LAG rounds before (the module
        docstring) and fixed costs: the same whatever its batch mates and the clock did."""
        if not self.adaptive:
            return self.max_depth
        if row.next_depth is None:
            n = row.launched + 1  # the row's round this depth is for
            tokens = tokens_by_depth(blended(row.as_of(n - PLAN_LAG), self.fixed))
            bucket = self._bucket(self.fixed_width)
            rel = tokens / np.array([self._shape(bucket, k) for k in range(self.max_depth + 1)])
            k = int(np.argmax(rel))
            # at depth 0, one draft now and then, where one draft that always passed would pay
            retry = k == 0 and n % SAMPLED_RETRY == 0 and self._shape(bucket, 1) < 1.99
            row.next_depth = 1 if retry else k
        return row.next_depth

    def sampled_tokens(self, row: RowAcceptance, k: int) -> float:
        """What a sampled row's round of depth k is expected to emit (its own counts, the prior)."""
        return float(tokens_by_depth(blended(row.counts, self.fixed))[k])

    def row_acceptance(self, rows: Sequence[RowAcceptance]) -> np.ndarray:
        """The greedy rows' a_j [G, D]: their own counts with pseudo-counts of the pool's."""
        return blended([r.counts for r in rows], self.pool())

    def record(self, width: int, depth: int, seconds: Optional[float], accepted: int, tried: int,
               reached=None, passed=None, shape: Optional[int] = None) -> None:
        """One round's wall time at `depth` (None: not its own, see the module docstring), its
        accepted / attempted draft positions, and per draft position j (1-based, index j-1) how many
        rows reached it (drafted it, all before passed) and how many of those passed; `shape`: the
        width its programs were built for (now built)."""
        key = (self._bucket(width), depth)
        self.seen[key] = self.seen.get(key, 0) + 1
        if shape is not None:
            self.built.add((shape, depth))
        if self.seen[key] > 1 and seconds is not None:  # a shape's first round compiles and allocates
            recent = self.samples.setdefault(key, [])
            recent.append(seconds)
            del recent[:-MEDIAN_OF]
            self.seconds[key] = statistics.median(recent)
        if tried:
            self.acceptance = 0.8 * self.acceptance + 0.2 * (accepted / tried)
        for j, (r, p) in enumerate(zip(reached or (), passed or ()), start=1):
            if r:
                old = self.passed.get(j, self.position_acceptance(j))
                self.passed[j] = 0.8 * old + 0.2 * (p / r)


@dataclass
class _Tries:
    """One width bucket's rounds and its tries of other depths."""

    rounds: int = 0
    phase: int = 0  # first rounds: 0 plain until timed, 1 the deepest depth until timed, 2 done
    first: int = 0  # rounds of the current first phase
    next: int = EXPLORE_EVERY  # the round the next try starts at
    every: int = EXPLORE_EVERY  # rounds between tries
    best_then: Optional[int] = None  # the best depth when the last try started
    count: int = 0  # tries so far
    depth: int = 0  # the current try's depth, run while rounds < until
    until: int = 0


def position_counts(n_accept, depths, K: int):
    """Per draft position 1..K: (rows that drafted it with every draft before it passed, rows whose
    draft there passed), from each row's accepted count and drafted depth (numpy arrays)."""
    j = np.arange(1, K + 1)[:, None]
    drafted = depths[None, :] >= j
    reached = (drafted & (n_accept[None, :] >= j - 1)).sum(axis=1)
    passed = (drafted & (n_accept[None, :] >= j)).sum(axis=1)
    return reached.tolist(), passed.tolist()
