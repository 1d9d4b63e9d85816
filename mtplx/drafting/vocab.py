"""The drafting vocabulary (as FR-Spec does): an MTP head drafts only among the most frequent tokens
of its training data (stored beside the head, `mtp_draft_vocab.npy`).

On a 49k-vocabulary model most of a draft step is the projection to the vocabulary; over the set it
is a dense slice of the output rows for those ids. The draft distribution q is zero outside the
set, which speculative acceptance handles exactly: verification, and so the output, is unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.mtp import MTPHead

DRAFT_VOCAB_FILE = "mtp_draft_vocab.npy"


class DraftVocab:
    """The token ids the head drafts among, and the output projection restricted to them."""

    def __init__(self, head: MTPHead, ids: Sequence[int], vocab_size: int, chunk: int = 256):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():  # (a head's file is sorted already: no sort to run)
            ids = np.unique(ids)
        if ids.size == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in 0..{vocab_size - 1}")
        self.vocab_size = vocab_size
        self.ids = mx.array(ids.astype(np.int32))
        D = head.fc.weight.shape[0]
        dtype = head.norm.weight.dtype
        rows = plain_rows(head, self.ids)
        if rows is not None:  # the rows themselves: what projecting basis vectors reads off, without
            self.weight_t = rows.T.astype(dtype)  # the D x V product (most of a CPU engine's setup)
            self.bias = mx.zeros((self.ids.shape[0],), dtype)
        else:
            # Rows of the head's output projection for these ids, read off by projecting basis
            # vectors (works for tied, untied and quantized heads alike; a bias cancels out).
            zero = head.logits(mx.zeros((1, D), dtype))[:, self.ids]
            cols = []
            for s in range(0, D, chunk):
                basis = mx.eye(D, dtype=dtype)[s : s + chunk]
                cols.append(head.logits(basis)[:, self.ids] - zero)
            self.weight_t = mx.concatenate(cols, axis=0).astype(dtype)  # [D, S]
            self.bias = zero[0]
        mx.eval(self.weight_t, self.bias)
        # a projection of zeros is zero for every head without a bias (plain, tied, quantized):
        # then no add, which would be a kernel of its own in every draft step
        self.has_bias = rows is None and bool(mx.any(self.bias != 0).item())

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def step_table(self, head: MTPHead) -> Optional[tuple]:
        """([S, D]: each drafting token's `embedding_share` of the head's fc, fc's hidden-state half
        [D, D]), built once; None where the head's fc cannot be split, or a head of several modules.
        A draft step then reads one row instead of running the embedding, its norm, the
        concatenation and the embedding's half of fc (`draft_step`)."""
        if not hasattr(self, "_table"):
            share = head.embedding_share(self.ids) if type(head) is MTPHead else None
            self._table = None if share is None else (share, head.hidden_half())
            if share is not None:
                mx.eval(*self._table)
        return self._table

    def as_vector_product(self) -> None:
        """Keep weight_t as the transpose of an [S, D] row-major array: on CUDA MLX then takes its matrix-
        vector kernel for a one-row projection (a draft step's, the commit's first logits), where a [D, S]
        row-major weight_t is a cuBLAS GEMM even at one row (a captured child graph each; fusion.head_gemv)."""
        self.weight_t = mx.contiguous(self.weight_t.T).T
        mx.eval(self.weight_t)

    def logits(self, h: mx.array) -> mx.array:
        out = h @ self.weight_t.astype(h.dtype)
        return out + self.bias.astype(h.dtype) if self.has_bias else out

    def expand(self, q: mx.array) -> mx.array:
        """[..., S] probabilities over the set -> [..., V] over the whole vocabulary (zero outside)."""
        flat = q.reshape(-1, q.shape[-1])
        out = mx.zeros((flat.shape[0], self.vocab_size), q.dtype)
        out[:, self.ids] = flat
        return out.reshape(q.shape[:-1] + (self.vocab_size,))


def plain_rows(head: MTPHead, ids: mx.array) -> Optional[mx.array]:
    """The rows for `ids` of the matrix W the head's logits are h @ W.T with, where W is a weight
    without a bias: its own projection or the trunk's lm_head (nn.Linear), or the trunk's tied
    embedding (nn.Embedding), or either quantized (its rows dequantized: the trunk's own embedding
    lookup, not quantized matmuls of basis vectors); None otherwise (biased, several depths)."""
    from ..models.mtp import text_model

    if type(head) is not MTPHead:
        return None
    if "head" in head:
        layer = head.head
    else:
        lm = text_model(head._trunk[0])
        layer = lm.lm_head if hasattr(lm, "lm_head") else lm.model.embed_tokens
    if "bias" in layer:
        return None
    if type(layer) in (nn.Linear, nn.Embedding):
        return layer.weight[ids]
    # (isinstance: qmm_rows' subclasses run the same product)
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        biases = layer.get("biases")
        return mx.dequantize(layer["weight"][ids], scales=layer["scales"][ids],
                             biases=None if biases is None else biases[ids], group_size=layer.group_size,
                             bits=layer.bits, mode=getattr(layer, "mode", "affine"))
    return None


def frequent_tokens(sequences: Sequence[Sequence[int]], starts: Sequence[int], size: int, vocab_size: int,
                    always: Sequence[int] = ()) -> np.ndarray:
    """The `size` most frequent token ids of the scored part of `sequences` (plus `always`, e.g. eos)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq, st in zip(sequences, starts):
        arr = np.asarray(seq[st:], dtype=np.int64)
        np.add.at(counts, arr[(arr >= 0) & (arr < vocab_size)], 1)
    extra = [int(t) for t in always if 0 <= int(t) < vocab_size]
    order = np.argsort(-counts, kind="stable")
    chosen = list(dict.fromkeys(extra + [int(t) for t in order[: max(size, 1)]]))[: max(size, len(extra))]
    return np.sort(np.asarray(chosen, dtype=np.int64))


def save_draft_vocab(out_dir, ids: np.ndarray) -> Path:
    path = Path(out_dir) / DRAFT_VOCAB_FILE
    np.save(path, np.asarray(ids, dtype=np.int32))
    return path


def load_draft_vocab(head: MTPHead, sidecar: Optional[str], vocab_size: int) -> Optional[DraftVocab]:
    """The sidecar's draft vocabulary, or None (a head without one drafts over the whole vocabulary)."""
    if sidecar is None or not (Path(sidecar) / DRAFT_VOCAB_FILE).exists():
        return None
    return DraftVocab(head, np.load(Path(sidecar) / DRAFT_VOCAB_FILE), vocab_size)


