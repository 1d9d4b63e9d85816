"""Each row's committed length in a batch cache (cache.py), on the host and on the device."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from . import small_ops
from .kernels.device import padded


class RowLengths:
    """Per-row committed lengths, on the host (scheduling, admission) and on the device (RoPE positions,
    cache writes, attention). While rounds queued ahead have advanced the device lengths by counts the
    host has not read, the host lengths are upper bounds (good for sizing caches) until `correct` or
    `settle`. `shared` is the one length every row has where the host's are exact, else None."""

    # The plain per-row causal mask RowKVCache.make_mask last built (no window): the layers of one
    # forward share it, and rows_attention.py recognizes it by identity as "keys 0..length + i".
    mask: Optional[mx.array] = None
    _positions = None  # (device lengths, L, positions): see `positions`
    _resident = None  # (device lengths, their padded copy or themselves, the view of it): see `resident`

    def __init__(self, lengths: Sequence[int]):
        self.set(lengths)

    def set(self, lengths):
        self.host = np.asarray(lengths, dtype=np.int64)
        self.device = mx.array(self.host, dtype=mx.int32)
        self.unread = 0  # advances whose counts the host has not read
        self._share()

    def _share(self):
        exact = self.unread == 0 and self.host.size and (self.host == self.host[0]).all()
        self.shared = int(self.host[0]) if exact else None

    def positions(self, L: int) -> mx.array:
        """[B, 1, L, 1]: where a forward of L tokens writes each row's entries (its length + 0..L-1), built
        once per forward from `resident()` and shared by its layers (compile does not merge kernels across
        layers)."""
        c = self._positions
        if c is None or c[0] is not self.device or c[1] != L:
            self.resident()
            base = self._resident[1]  # the padded lengths where there are (then sliced back to B rows)
            pos = (base[:, None] + small_ops.arange(L))[: self.device.size]
            c = self._positions = (self.device, L, pos[:, None, :, None])
        return c[2]

    def resident(self) -> mx.array:
        """The device lengths as the kernels of a forward read them (rows_attention, RoPE offsets, the
        write positions): at one row a view of a padded copy in device memory (kernels.device.padded),
        built once per forward."""
        c = self._resident
        if c is None or c[0] is not self.device:
            p = padded(self.device)
            c = self._resident = (self.device, self.device, self.device) if p is None else (self.device, p, p[: self.device.size])
        return c[2]

    def advance(self, counts: mx.array, most: np.ndarray, exact: bool = False, after: Optional[mx.array] = None):
        """Device lengths += counts (lazy, not read; `after`: that sum, made by a compiled program);
        host lengths += most (counts <= most; `exact`: they are the counts)."""
        self.host = self.host + np.asarray(most, dtype=np.int64)
        self.unread += not exact
        if self.unread:
            self.device = after if after is not None else self.device + counts.astype(mx.int32)
        else:  # from the host: no chain of additions that nothing reads (the shared path reads none)
            self.device = mx.array(self.host, dtype=mx.int32)
        self._share()

    def expect(self, rounds: int):
        """`rounds` more (or, negative, fewer) rounds whose counts are not read and not advanced yet (a
        round MtpDrafter put off is corrected when the engine reads it, before or after it advances)."""
        self.unread += rounds
        self._share()

    def correct(self, excess: np.ndarray):
        """An advance's counts were read: the host lengths were `excess` too long."""
        self.host = self.host - np.asarray(excess, dtype=np.int64)
        self.unread = max(0, self.unread - 1)
        self._share()

    def place(self, slots: Sequence[int], lengths: Sequence[int]):
        """Rows `slots` now hold `lengths` entries (rows put in by admission); the other rows keep
        theirs, read or not: their device lengths stay the device's (never the host's upper bounds)."""
        host = self.host.copy()
        host[np.asarray(slots, dtype=np.int64)] = np.asarray(lengths, dtype=np.int64)
        if len(set(int(i) for i in slots)) == host.size:  # every row placed: all lengths are the host's
            self.set(host)
            return
        placed = np.zeros(host.size, dtype=bool)
        placed[np.asarray(slots, dtype=np.int64)] = True
        self.host = host
        self.device = mx.where(mx.array(placed), mx.array(host, dtype=mx.int32), self.device)
        self._share()

    def settle(self):
        """Host lengths := the device's (one read; exact again)."""
        self.host = np.array(self.device).astype(np.int64)
        self.unread = 0
        self._share()

    def mark(self):
        return self.host.copy(), self.device, self.unread

    def restore(self, mark):
        self.host, self.device, self.unread = mark[0].copy(), mark[1], mark[2]
        self._share()

    @property
    def max(self) -> int:
        return int(self.host.max()) if self.host.size else 0
