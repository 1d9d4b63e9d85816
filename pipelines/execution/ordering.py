"""The order rows are handed to the engine in: `input`, `length` or `prefix`.

Ordering works on windows of the stream (`schedule.window_rows`, 4096 by default): a window is
read, ordered and handed on before the next is read, so memory holds at most one window of token
lists however large the dataset. The price: rows that would group or sort together but sit in
different windows are not brought together. Rows that cannot be generated (error rows) are not
ordered; they pass straight through.

`length` puts the longest prompts first. Long rows are the expensive ones: started first they
overlap with many short rows instead of finishing alone at the end of the run (the straggler
tail), rows decoded together have similar lengths, and a row too large for memory shows up in
the first minutes rather than the last.

`prefix` groups rows that share a long token prefix (a system prompt, a few-shot preamble, a
document asked several questions) so they are decoded together and the engine can prefill the
shared part once. Groups come from a token trie: sorting token lists lexicographically walks
the trie in pre-order, and the common prefix of two neighbours in that order is the depth of
the trie node where they branch. A group is the set of rows under a topmost trie node at depth
>= `min_prefix_tokens`: a maximal run of neighbours whose common prefix is at least that long;
its shared prefix is the smallest such neighbour prefix in the run. Each member gets
`stable_prefix_len` = that shared length (never the whole prompt: the last token must be
prefilled to produce logits); rows in no group get 0. Groups are ordered by their longest row,
longest first, and rows within a group by length, longest first.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: prompts sharing a long preamble are the common case here.
    step = 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def length_order(tokens: Sequence[Sequence[int]]) -> List[int]:
    """Indices, longest prompt first; ties keep input order."""
    return sorted(range(len(tokens)), key=lambda i: (-len(tokens[i]), i))


def prefix_groups(
    tokens: Sequence[Sequence[int]], min_prefix: int = 16, samples: int = 1
) -> Tuple[List[int], List[int]]:
    """(order, stable_prefix_len per input index) for one window; see the module docstring.

    With `samples` > 1 a row's own samples share its whole prompt, so an ungrouped row still
    gets a stable prefix (its prompt less the last token) when that is long enough.
    """
    n = len(tokens)
    prefix_len = [0] * n
    if n == 0:
        return [], prefix_len
    walk = sorted(range(n), key=lambda i: (tokens[i], i))  # trie pre-order
    groups: List[List[int]] = []
    shared: List[int] = []
    group, depth = [walk[0]], None
    for prev, cur in zip(walk, walk[1:]):
        lcp = common_prefix(tokens[prev], tokens[cur])
        if lcp >= min_prefix:
            group.append(cur)
            depth = lcp if depth is None else min(depth, lcp)
        else:
            groups.append(group)
            shared.append(depth or 0)
            group, depth = [cur], None
    groups.append(group)
    shared.append(depth or 0)

    for members, depth in zip(groups, shared):
        for i in members:
            own = len(tokens[i]) - 1
            edge = min(depth, own) if depth else (own if samples > 1 else 0)
            prefix_len[i] = edge if edge >= min_prefix else 0
    for members in groups:
        members.sort(key=lambda i: (-len(tokens[i]), i))
    groups.sort(key=lambda g: (-len(tokens[g[0]]), min(g)))
    return [i for g in groups for i in g], prefix_len


def order_window(items: List[T], mode: str, tokens_of: Callable[[T], Sequence[int]],
                 min_prefix: int = 16, samples: int = 1) -> Tuple[List[T], List[int]]:
    """One window in `mode` order, with each item's stable prefix length."""
    toks = [tokens_of(it) for it in items]
    if mode == "input":
        return list(items), [0] * len(items)
    if mode == "length":
        order = length_order(toks)
        return [items[i] for i in order], [0] * len(items)
    if mode == "prefix":
        order, plen = prefix_groups(toks, min_prefix, samples)
        return [items[i] for i in order], [plen[i] for i in order]
    raise ValueError(f"unknown order {mode!r}")


def ordered(stream: Iterable[T], mode: str, tokens_of: Callable[[T], Optional[Sequence[int]]],
            window_rows: int = 4096, min_prefix: int = 16, samples: int = 1) -> Iterator[Tuple[T, int]]:
    """(item, stable_prefix_len) in scheduling order. Items whose `tokens_of` is None (error
    rows) are yielded as soon as they are read; only the rest are windowed and ordered."""
    if mode == "input":  # nothing to reorder: no reason to hold a window back
        for item in stream:
            yield item, 0
        return
    window: List[T] = []

    def flush():
        items, plen = order_window(window, mode, tokens_of, min_prefix, samples)
        window.clear()
        return zip(items, plen)

    for item in stream:
        if tokens_of(item) is None:
            yield item, 0
            continue
        window.append(item)
        if len(window) >= window_rows:
            yield from flush()
    if window:
        yield from flush()
