"""Stop strings: a row ends at the first of its stop strings, in text, whatever the tokens were.

A round can emit several tokens at once (speculation), and a stop string can end in the middle of
a token, so the engine checks the decoded tail after each round (`in_tail`) and, when the row is
done, cuts its tokens back to the one that completes the first stop string and its text to what
comes before that string (`cut`).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

TAIL_TOKENS = 64  # the decoded tail searched after each round: longer than any stop string's tokens


def in_tail(decode: Callable[[List[int]], str], tokens: List[int], stops: Sequence[str]) -> bool:
    """Whether one of `stops` is in the text of the row's last TAIL_TOKENS tokens."""
    tail = decode(tokens[-TAIL_TOKENS:])
    return any(s and s in tail for s in stops)


def cut(decode: Callable[[List[int]], str], tokens: List[int], stops: Sequence[str]) -> Optional[Tuple[int, str]]:
    """(tokens to keep, text before the first stop string), or None when the text holds none of `stops`."""
    found = [s for s in stops if s and s in decode(tokens)]
    if not found:
        return None

    def has_stop(k):
        return any(s in decode(tokens[:k]) for s in found)

    lo, hi = 1, len(tokens)  # the shortest prefix of tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
    text = decode(tokens[:lo])
    return lo, text[: min(text.find(s) for s in found if s in text)]
