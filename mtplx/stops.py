"""Stop strings, matched in text: a round may emit several tokens and a string may end mid-token, so
the decoded tail is checked after each round and a finished row cut back to its first stop string."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

TAIL_TOKENS = 64  # the decoded tail searched after each round: longer than any stop string's tokens


def in_tail(decode: Callable[[List[int]], str], tokens: List[int], stops: Sequence[str]) -> bool:
    tail = decode(tokens[-TAIL_TOKENS:])
    return any(s and s in tail for s in stops)


def cut(decode: Callable[[List[int]], str], tokens: List[int], stops: Sequence[str]) -> Optional[Tuple[int, str]]:
    """(tokens to keep, text before the first stop string), or None when there is none."""
    found = [s for s in stops if s and s in decode(tokens)]
    if not found:
        return None

    def has_stop(k):
        return any(s in decode(tokens[:k]) for s in found)

    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
    text = decode(tokens[:lo])
    return lo, text[: min(text.find(s) for s in found if s in text)]
