"""The head over the frozen trunk's features: batches, the unrolled draft recursion, held-out metrics."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.mtp import MTPHead
from .head_data import Features, padded_length


def _batch(feats: Features, idx: Sequence[int], compute_dtype, length: Optional[int] = None):
    """(hidden [B, L-2, D], tokens in, targets, mask, greedy targets or None, teacher [B, L-1, D]: the
    trunk's hidden at 1..L-1). L: `length`, else the longest sequence padded to LENGTH_BUCKET."""
    L = max(length or 0, padded_length(max(len(feats.tokens[k]) for k in idx)))
    B = len(idx)
    x = np.zeros((B, L), dtype=np.int32)
    m = np.zeros((B, L - 2), dtype=np.float32)
    g = np.zeros((B, L - 2), dtype=np.int32)
    hs, ts = [], []
    have_greedy = all(feats.greedy[k] is not None for k in idx)
    for r, k in enumerate(idx):
        n = len(feats.tokens[k])
        x[r, :n] = feats.tokens[k]
        m[r, feats.starts[k] : n - 2] = 1.0
        h, t = feats.hidden[k][: n - 2], feats.hidden[k][1:n]
        hs.append(mx.pad(h, [(0, L - n), (0, 0)]) if n < L else h)
        ts.append(mx.pad(t, [(0, L - n), (0, 0)]) if n < L else t)
        if have_greedy:
            g[r, : n - 2] = feats.greedy[k][1 : n - 1]
    return (mx.stack(hs).astype(compute_dtype), mx.array(x[:, 1:-1]), mx.array(x[:, 2:]), mx.array(m),
            mx.array(g) if have_greedy else None, mx.stack(ts).astype(compute_dtype))


def _causal(head: MTPHead, L: int):
    """The mask for L positions: "causal" where the block takes it, else an array."""
    if getattr(head, "_array_mask", None) is None:
        try:
            mx.eval(head.layers[0](mx.zeros((1, 2, head.fc.weight.shape[0])), "causal", None))
            head._array_mask = False
        except (TypeError, ValueError):
            head._array_mask = True
    if L == 1 or not head._array_mask:
        return None if L == 1 else "causal"
    from mlx_lm.models.base import create_causal_mask
    return create_causal_mask(L)


def _unrolled(head: MTPHead, hidden, tokens, targets, mask, depths: int, project=None):
    """(logits, targets, mask, head hidden) at depths 1..`depths`, each over the one before (teacher-forced)."""
    out = []
    for _ in range(depths):
        if tokens.shape[1] == 0:
            break
        hidden = head.hidden(hidden, tokens, mask=_causal(head, tokens.shape[1]))
        logits = head.logits(hidden) if project is None else project(hidden)
        out.append((logits, targets, mask, hidden))
        hidden, tokens, targets, mask = hidden[:, :-1], targets[:, :-1], targets[:, 1:], mask[:, :-1] * mask[:, 1:]
    return out


def depth_hits(head: MTPHead, feats: Features, depths: int, vocab: Optional[Sequence[int]] = None) -> List[np.ndarray]:
    """Per sequence [depths, L-2] int8: 1 where the depth-k draft from base i (argmax among `vocab`) is
    the trunk's greedy token, 0 where not, -1 where unscored."""
    out: List[Optional[np.ndarray]] = [None] * len(feats.tokens)
    for batch in _batches(feats):
        hidden, tok, tgt, m, g, _ = _batch(feats, batch, mx.float32)
        ref = g if g is not None else tgt
        grid = np.full((len(batch), depths, tok.shape[1]), -1, dtype=np.int8)
        for k, (logits, _, mk, _) in enumerate(_unrolled(head, hidden, tok, tgt, m, depths)):
            hit = np.array(mx.argmax(_among(logits, vocab), axis=-1) == ref[:, k:])
            scored = np.array(mk) > 0
            grid[:, k, : hit.shape[1]] = np.where(scored, hit, -1)
        for r, i in enumerate(batch):
            out[i] = grid[r, :, : max(len(feats.tokens[i]) - 2, 0)]
    return out


def _batches(feats: Features, batch_size: int = 8):
    idx = sorted(range(len(feats.tokens)), key=lambda i: len(feats.tokens[i]))
    return [idx[s : s + batch_size] for s in range(0, len(idx), batch_size)]


def _among(logits: mx.array, vocab: Optional[Sequence[int]]) -> mx.array:
    if vocab is None:
        return logits
    keep = np.zeros(logits.shape[-1], dtype=bool)
    keep[np.asarray(vocab)] = True
    return mx.where(mx.array(keep), logits, -mx.inf)


def depth_report(head: MTPHead, feats: Features, depths: int, vocab: Optional[Sequence[int]] = None) -> dict:
    """Acceptance by depth; tokens per verify from their product and replayed as the engine's rounds."""
    hits = depth_hits(head, feats, depths, vocab)
    grid = np.concatenate([np.zeros((depths, 0), dtype=np.int8), *hits], axis=1)  # all sequences' positions
    by_depth = [float(h / n) if n else 0.0 for h, n in zip((grid == 1).sum(axis=1), (grid >= 0).sum(axis=1))]
    ks = range(1, depths + 1)
    return {"acceptance_by_depth": by_depth,
            "tokens_per_verify": {str(k): tokens_per_verify(by_depth, k) for k in ks},
            "replayed_tokens_per_verify": {str(k): replayed_tokens_per_verify(hits, k) for k in ks}}


def replayed_tokens_per_verify(hits: Sequence[np.ndarray], depth: int) -> float:
    """Tokens per verify drafting `depth` a round, each draft passing where `depth_hits` says."""
    verifies = tokens = 0
    for grid in hits:
        scored = np.flatnonzero(grid[0] >= 0)
        if not scored.size:
            continue
        i, end = int(scored[0]), int(scored[-1]) + 1
        while i < end:
            n = 0
            while n < depth and n < grid.shape[0] and i + n < grid.shape[1] and grid[n, i] == 1:
                n += 1
            verifies += 1
            tokens += n + 1
            i += n + 1
    return tokens / verifies if verifies else 1.0


def tokens_per_verify(by_depth: Sequence[float], depth: int) -> float:
    """Expected tokens per verify drafting `depth`, by depth k's acceptance once draft k-1 passed."""
    total, run = 1.0, 1.0
    for a in list(by_depth)[:depth]:
        run *= a
        total += run
    return total


def evaluate(head: MTPHead, feats: Features, vocab: Optional[Sequence[int]] = None) -> Tuple[float, float]:
    """(mean cross-entropy against x_{t+2}, acceptance against the trunk's greedy token)."""
    totals = mx.zeros(3)  # loss, hits, scored positions
    for batch in _batches(feats):
        hidden, tok, tgt, m, g, _ = _batch(feats, batch, mx.float32)
        _, logits = head(hidden, tok, mask=_causal(head, tok.shape[1]))
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), tgt, reduction="none")
        ref = g if g is not None else tgt
        hit = (mx.argmax(_among(logits, vocab), axis=-1) == ref).astype(mx.float32)
        totals = totals + mx.stack([(ce * m).sum(), (hit * m).sum(), m.sum()])
        mx.eval(totals)
    loss, hits, n = totals.tolist()
    return (loss / n, hits / n) if n else (float("nan"), 0.0)
