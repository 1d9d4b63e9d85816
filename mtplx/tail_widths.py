"""A drained batch's tail at narrower widths whose programs are built ahead (issue 18, h10c).

Once no request waits, a batch's last rows finish one by one: a 64-row stream at width 32 runs ~36
rounds after its last admission with 19, 17, 14, ... 2 rows live (BENCHMARKS.md, h9b), each a full
width-32 round (H200: ~9.9 ms for MTP depth 3, ~4-5 ms at width 8). A GPU keeps the tail at the
batch's width (Engine.TAIL_KEEPS_WIDTH): narrowing down to 1 row (round_cost `3n`) drained the
pipeline at five widths and built every program again at each of them.

With `TAIL_NARROWEST` = n (a power of two) a drained batch instead moves to the narrowest power of
two >= n that holds its live rows (from 32 with n = 8: to 16 once 16 rows are left, to 8 once 8 are),
for plain decoding and every speculative method alike, and each compiled program a round runs at a
wider width has its twins at those widths built and run once when the wide one is first used
(each bank's `_twins`, over the first rows of the wide call's own inputs): the tail builds nothing
the wide batch did not (a new capacity bucket met after narrowing is built at the narrow width only,
as it would have been at the wide one). Rows keep their own slots' state, generators and positions
(BatchCache.take_rows): greedy output is plain decoding's, sampled output keeps its distribution.

Off (0) by default until measured on the H200 (round_cost `@tail_narrowest=8`; the CPU narrows
anyway: its round's cost follows its width).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import mlx.core as mx

TAIL_NARROWEST = 0


def _fit(n: int) -> int:
    """The narrowest power of two holding n rows."""
    return 1 << (max(n, 1) - 1).bit_length()


def target(live: int, width: int, keeps: int, narrowest: int) -> Optional[int]:
    """The width a drained batch of `width` slots with `live` rows moves to, or None where it stays:
    the powers of two below half its width where rounds cost what they compute (`keeps`:
    Engine.tail_keeps_width), else a tail width (`narrowest`, 0: none) narrower than the batch."""
    fit = _fit(live)
    if live <= width // 2 and width > keeps:
        return fit
    if narrowest:
        w = max(fit, _fit(narrowest))
        if w < width:
            return w
    return None


def twin_widths(narrowest: int, widest: int) -> Tuple[int, ...]:
    """The tail widths a batch of up to `widest` rows may move to: powers of two from `narrowest` (0: none)."""
    if not narrowest:
        return ()
    out, w = [], _fit(narrowest)
    while w < widest:
        out.append(w)
        w *= 2
    return tuple(out)


def sliced(args: Sequence, W: int, w: int) -> list:
    """A program's inputs at width W cut to their first w rows (every batch input leads with W)."""
    return [a[:w] if isinstance(a, mx.array) and a.ndim and a.shape[0] == W else a for a in args]
