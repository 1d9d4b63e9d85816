"""Adaptive draft depth for greedy rows, from what rounds actually cost and what drafts earn.

A round that drafts k tokens emits 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens per row on average,
where a_j is the chance that draft j passes once draft j-1 has; an MTP head's a_j fall with depth,
so the controller keeps a_j per position, measured (an MTP head starts from those its training run
recorded, mtp_head.json). A round's cost depends on the device, the model and the width (on a GPU a
verify of 4 tokens can cost what one of 1 does; on a CPU nearly four times as much), so the
controller keeps per (width bucket, depth) the median of the last MEDIAN_OF timed rounds (from a
calibration profile's cost curve, calibrate.py, or the nearest measured width's, before it has its
own), extrapolates depths it has not tried, picks the depth with the most tokens per second, and now and then tries a neighbour
(from the deepest depth plain decoding, from plain decoding the deepest depth), each width bucket
on its own count. Depth 0 is a candidate: when speculation does not pay, it stops. A batch's last
rows (nothing left to admit) keep the best depth without tries (`explore` off).

The engine decides which rounds' times it is fed (rounds.py, `Rounds._priced`; the others come as
None). Rounds run one ahead, so a try lasts more than one round: FIRST_TRY's three, TRY_ROUNDS for
the neighbour tries. Only greedy rows follow the controller; sampled rows keep `speculative.depth`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

EXPLORE_EVERY = 16  # rounds between tries of a neighbouring depth, at first;
EXPLORE_MOST = 64  # doubling up to this while the tries leave the best depth where it was (a try of
# a draft model from depth 0 feeds its backlog first and drafts at a loss: every 16 rounds, ~7%)
TRY_ROUNDS = 2  # rounds a neighbour try lasts (its last one is followed by another depth: untimed)
# A width's first try of depth 0 (no drafting), early: three rounds (a new depth's first round
# compiles, the last is followed by another depth: neither is timed), so what drafting must beat is
# measured, and with it the slope to the depth in use prices the rest, within a few rounds (a draft
# model's rounds cost more than the verify's slope)
FIRST_TRY = (3, 4, 5)
UNTRIED_SLOPE = 0.15  # assumed extra cost per drafted token before it is measured (optimistic)
# A (width, depth)'s cost is the median of its last MEDIAN_OF timed rounds: one slow round (a host
# hiccup, a GC pause) moves it not at all
MEDIAN_OF = 5


class DepthController:
    def __init__(self, max_depth: int, adaptive: bool = True, acceptance: float = 0.7,
                 shapes: Optional[Dict[int, List[float]]] = None, prior: Optional[List[float]] = None):
        self.max_depth = max_depth
        self.shapes = dict(shapes or {})  # width -> relative verify cost by depth (calibrate.cost_shapes)
        self.adaptive = adaptive
        self.acceptance = acceptance  # per-token, EMA over rounds (the prior for unmeasured positions)
        self.passed: Dict[int, float] = {}  # draft position j -> EMA of P(draft j passes | j-1 passed)
        if prior:  # the drafter's recorded a_j (position 1 first)
            self.passed = {j: float(a) for j, a in enumerate(prior, start=1)}
            self.acceptance = float(prior[0])
        self.seconds: Dict[Tuple[int, int], float] = {}  # (width bucket, depth) -> round time (MEDIAN_OF)
        self.seen: Dict[Tuple[int, int], int] = {}
        self.samples: Dict[Tuple[int, int], List[float]] = {}  # the last MEDIAN_OF timed rounds
        self.explore = True  # tries of other depths (off: the best depth only)
        self.widths: Dict[int, _Tries] = {}  # width bucket -> its rounds and tries (each width explores on its own)

    @staticmethod
    def _bucket(width: int) -> int:
        return 1 << max(0, width - 1).bit_length()

    def _shape(self, bucket: int, k: int) -> float:
        """Relative cost of depth k at this width: the calibrated curve of the nearest width
        (in log2) that reaches depth k, else the assumed slope."""
        near = [w for w, c in self.shapes.items() if len(c) > k]
        if not near:
            return 1.0 + UNTRIED_SLOPE * k
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

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for j in range(1, k + 1):
            run *= min(max(self.position_acceptance(j), 0.0), 0.99)
            total += run
        return total

    def _rate(self, bucket: int, k: int) -> float:
        return self.expected_tokens(k) / self._cost(bucket, k)

    def choose(self, width: int) -> int:
        """The depth for a round of `width` rows. With `explore` off (the engine: a batch's last
        rows, nothing left to admit) the best depth, no tries: what a try would teach has no rounds
        left to pay off, and each new depth at a new width builds programs."""
        if not self.adaptive:
            return self.max_depth
        bucket = self._bucket(width)
        best = max(range(self.max_depth + 1), key=lambda k: self._rate(bucket, k))
        if not self.explore:
            return best
        w = self.widths.setdefault(bucket, _Tries())
        w.rounds += 1
        n = w.rounds
        if n in FIRST_TRY:
            return 0  # what drafting must beat, measured
        if n == w.next:
            w.every = min(2 * w.every, EXPLORE_MOST) if best == w.best_then else EXPLORE_EVERY
            w.best_then, w.next, w.count = best, n + w.every, w.count + 1
            k = best + 1 if w.count % 2 else best - 1  # tries alternate the depths above and below the best
            if k > self.max_depth:
                k = 0  # at the deepest: plain decoding again, what drafting must beat (one high time stays otherwise)
            elif k < 0:
                k = self.max_depth  # at plain decoding: the deepest depth again, what drafting can earn at most
            w.depth, w.until = k, n + TRY_ROUNDS
        return w.depth if n < w.until else best

    def record(self, width: int, depth: int, seconds: Optional[float], accepted: int, tried: int,
               reached=None, passed=None) -> None:
        """One round's wall time at `depth` (None: not its own, see the module docstring), its
        accepted / attempted draft positions, and per draft position j (1-based, index j-1) how many
        rows reached it (drafted it, all before passed) and how many of those passed."""
        key = (self._bucket(width), depth)
        self.seen[key] = self.seen.get(key, 0) + 1
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
    next: int = EXPLORE_EVERY  # the round the next try starts at
    every: int = EXPLORE_EVERY  # rounds between tries
    best_then: Optional[int] = None  # the best depth when the last try started
    count: int = 0  # tries so far
    depth: int = 0  # the current try's depth, run while rounds < until
    until: int = 0


def position_counts(n_accept, depths, K: int):
    """Per draft position 1..K: (rows that drafted it with every draft before it passed, rows whose
    draft there passed), from each row's accepted count and drafted depth (numpy arrays)."""
    import numpy as np

    j = np.arange(1, K + 1)[:, None]
    drafted = depths[None, :] >= j
    reached = (drafted & (n_accept[None, :] >= j - 1)).sum(axis=1)
    passed = (drafted & (n_accept[None, :] >= j)).sum(axis=1)
    return reached.tolist(), passed.tolist()
