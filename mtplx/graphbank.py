"""CompiledVerifyBank (after MTPLX's): the verify forward as compiled MLX programs, one per (width,
verify length, capacity bucket), over a shadow cache whose arrays and per-row lengths are the program's
inputs (a Python int offset would be frozen at trace time). Modes: docs/architecture.md (parity modes).
6-bit weights verify eagerly (`permanent_eager`); past `request_max_tokens` no bucket is compiled."""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import small_ops
from .architectures import capture_backend as model_capture_backend
from .cache import BatchCache, RowKVCache
from .row_lengths import RowLengths
from .config import verify_max_len_env
from .counters import Counters
from .sampling import SamplerBatch, accept_greedy, accept_sampled, shaped_probs

UNSUPPORTED_BITS = (6,)


class CompiledVerifyParityError(RuntimeError):
    pass


def unsupported_quantization(model) -> Optional[str]:
    for name, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and bits in UNSUPPORTED_BITS:
            return f"{bits}-bit quantized weights ({name}) are verified eagerly"
    return None


class Programs:
    """Compiled programs by key, counted in `counters`; a key whose call raises is `broken`: eager."""

    def __init__(self, counters: Optional[Counters] = None):
        self.counters = counters if counters is not None else Counters()
        self.built: Dict = {}
        self.broken: Dict = {}

    def call(self, key, build: Callable[[], Callable], *args):
        """The program of `key` (compiling `build()`) over `args`, or None where it does not compile."""
        if key in self.broken:
            return None
        fn, started = self.built.get(key), None
        if fn is None:
            if self.counters.on_build is not None:
                self.counters.on_build()
            started = time.perf_counter()
            fn = self.built[key] = mx.compile(build())
            self.counters.programs_built += 1
        try:
            out = fn(*args)
        except Exception as e:
            self.broken[key] = f"compile failed: {type(e).__name__}: {e}"
            return None
        if started is not None:
            self.counters.first_call_seconds += time.perf_counter() - started
        return out


class _ShadowRows(RowLengths):
    def __init__(self, device_lengths: mx.array, resident=None):
        self.device = device_lengths
        self.host = None
        self.shared = None  # inside a program lengths are an input, never a Python int
        if resident is not None:  # (padded copy, the view of it `device_lengths` is)
            self._resident = (device_lengths, resident[0], resident[1])


def shadow_cache(kinds, lengths: mx.array, arrays, resident=None) -> BatchCache:
    cache = BatchCache(kinds, rows=_ShadowRows(lengths, resident))
    it = iter(arrays)
    for layer in cache.leaves:
        if isinstance(layer, RowKVCache):
            layer.keys, layer.values = next(it), next(it)
            layer.attend_len = layer.keys.shape[2]  # the whole bucket, masked: shape-derived
        else:
            layer.cache = [next(it) for _ in layer.cache]
            layer.capturing = True
    return cache


def shadow_outputs(cache: BatchCache):
    out = []
    for layer in cache.leaves:
        if isinstance(layer, RowKVCache):
            out += [layer.keys, layer.values]
        else:
            out += layer._steps
    return out


def mirror(cache: BatchCache, arrays) -> None:
    """A program's cache outputs (`shadow_outputs`' order) into `cache`."""
    it = iter(arrays)
    for layer in cache.leaves:
        if isinstance(layer, RowKVCache):
            layer.keys, layer.values = next(it), next(it)
        else:
            layer.record_steps([next(it) for _ in layer.cache])


class CompiledVerifyBank:
    def __init__(self, runtime, max_verify_len: int = 4, request_max_tokens: int = 8192,
                 capture_backend: Optional[str] = None, parity=False, restored_tokens: int = 0,
                 growth_limit: Optional[int] = None, counters: Optional[Counters] = None):
        """`runtime`: `.model`, `.forward(tokens, cache) -> (logits, hidden)`; `parity`: "on" (False), "parity"
        (True) or "parity2"; `growth_limit`: default MTPLX_COMPILED_VERIFY_MAX_LEN, else max(8, max_verify_len)."""
        self.runtime = runtime
        self.max_verify_len = max_verify_len
        env = verify_max_len_env()
        self.growth_limit = growth_limit or (env if env is not None else max(8, max_verify_len))
        if int(request_max_tokens) < 1:
            raise ValueError(f"request_max_tokens (the longest context a row can reach) must be >= 1, got {request_max_tokens!r}")
        self.request_max_tokens = int(request_max_tokens)
        used = model_capture_backend(runtime.model)
        if capture_backend != used:
            raise ValueError(f"capture_backend={capture_backend!r} but the model's layers use {used!r}: pass "
                             f"capture_backend={used!r} (mtplx.architectures.capture_backend(model) reads it)")
        self.capture_backend = capture_backend
        self.mode = {True: "parity", False: "on", None: "on"}.get(parity, parity)
        if self.mode not in ("on", "parity", "parity2"):
            raise ValueError(f"parity must be False, True, 'parity' or 'parity2', got {parity!r}")
        reason = unsupported_quantization(runtime.model)
        self.permanent_eager = reason is not None
        self.reserve = 0  # entries a row may reach: a cache grown here holds them at once (one capacity a batch)
        self.stats: Dict[str, object] = {
            "compiled_calls": 0, "fallback_calls": 0, "parity_failures": 0,
            "fallback_reasons": {} if reason is None else {reason: 0}, "capture_backend": capture_backend,
            "request_max_tokens": self.request_max_tokens, "restored_tokens": int(restored_tokens)}
        self._eager_reason = reason
        self.programs = Programs(counters)

    def _run_shadow(self, kinds, tokens, lengths, *arrays):
        shadow = shadow_cache(kinds, lengths, arrays)
        logits, hidden = self.runtime.forward(tokens, shadow)
        return (logits, hidden if hidden is not None else mx.zeros((0,))) + tuple(shadow_outputs(shadow))

    def _run_round(self, kinds, accept, pending, drafts, limit, live, lengths, *rest):
        n_arrays = len(rest) - (0 if accept[0] == "greedy" else 5 + accept[3])
        arrays, extra = rest[:n_arrays], rest[n_arrays:]
        verify_in = small_ops.joined([pending], drafts)
        logits, hidden, *cache_out = self._run_shadow(kinds, verify_in, lengths, *arrays)
        if accept[0] == "greedy":
            n, nxt = accept_greedy(logits, drafts, limit)
        else:
            temps, top_p, top_k, u_accept, u_next = extra[:5]
            sampler = SamplerBatch(temps, top_p, top_k, False, accept[1], accept[2])
            q = extra[5] if accept[3] else None
            n, nxt = accept_sampled(shaped_probs(logits, sampler), drafts, q, u_accept, u_next, limit)
        n, nxt = n.astype(mx.int32), nxt.astype(mx.int32)
        counts = mx.where(live, n + 1, 0).astype(mx.int32)
        read = small_ops.joined([n, nxt], drafts)
        return (read, n, nxt, counts, lengths + counts, verify_in, hidden) + tuple(cache_out)

    def _build(self, key, kinds) -> Callable[[], Callable]:
        """What `key`'s program compiles: (W, L, capacity) verifies; an acceptance too (`verify_round`)."""
        if len(key) > 3:
            return lambda: partial(self._run_round, kinds, key[3])
        return lambda: partial(self._run_shadow, kinds)

    @property
    def restored_tokens(self) -> int:
        return self.stats["restored_tokens"]

    def note_restored(self, tokens: int) -> None:
        self.stats["restored_tokens"] += int(tokens)

    def set_budget(self, request_max_tokens: int) -> None:  # the longest context a row in flight can reach
        self.request_max_tokens = self.stats["request_max_tokens"] = int(request_max_tokens)

    def _fallback(self, reason: str):
        self.stats["fallback_calls"] += 1
        reasons = self.stats["fallback_reasons"]
        reasons[reason] = reasons.get(reason, 0) + 1

    def _compiled(self, W: int, L: int, cache: BatchCache):
        """(key, arrays) of the program verifying L tokens a row over `cache`, or (None, why not)."""
        reason = self._eager_reason
        if reason is None and L > self.max_verify_len:
            if L <= self.growth_limit:
                self.max_verify_len = L
            else:
                reason = (f"verify length {L} over the verify max length {self.growth_limit} "
                          "(speculative.verify_max_len, or MTPLX_COMPILED_VERIFY_MAX_LEN)")
        arrays = [a for c in cache.leaves for a in c.state_arrays()]
        longest = cache.rows.max
        if reason is None and any(a is None for a in arrays):
            reason = "empty cache"
        if reason is None and longest + L > self.request_max_tokens + self.growth_limit:
            reason = (f"a row's context {longest} + verify {L} is past the growth budget "
                      f"(request_max_tokens {self.request_max_tokens} + verify max length {self.growth_limit}): "
                      "no larger capacity bucket is compiled")
        if reason is not None:
            return None, reason
        kv = [c for c in cache.leaves if isinstance(c, RowKVCache)]
        need = max(longest, min(self.reserve, self.request_max_tokens)) + L
        if kv and need > min(c.keys.shape[2] for c in kv):
            for c in kv:
                c.ensure_capacity(W, c.keys, c.values, need)
            arrays = [a for c in cache.leaves for a in c.state_arrays()]
        return (W, L, max((c.keys.shape[2] for c in kv), default=0)), arrays

    def verify(self, tokens: mx.array, cache: BatchCache):
        """Forward `tokens` [W, L] over `cache`: (logits, hidden, compiled?, parity failures per row)."""
        W, L = tokens.shape
        key, arrays = self._compiled(W, L, cache)
        lengths = cache.rows.device
        out = None if key is None else self.programs.call(key, self._build(key, cache.kinds), tokens, lengths, *arrays)
        if out is None:
            self._fallback(arrays if key is None else self.programs.broken[key])
            logits, hidden = self.eager(tokens, cache)
            return logits, hidden, False, None
        failures = None
        if self.mode != "on":
            ref = self._run_shadow(cache.kinds, tokens, lengths, *arrays)
            failures = self._compare(out[0], ref[0])
            # later verifies read the cache it writes through both paths alike: compare it too
            cache_bad = self._compare_cache(out[2:], ref[2:])
            if self.mode == "parity" and (failures.any() or cache_bad.any()):
                if failures.any():
                    raise CompiledVerifyParityError(self._describe(out[0], ref[0], failures))
                raise CompiledVerifyParityError(
                    f"compiled verify wrote a different cache than eager at row {int(np.argmax(cache_bad))} "
                    f"(tolerance {self._tol(out[0]):g}; use compiled_verify: parity2 to count instead of raise)")
            failures = failures | cache_bad
            self.stats["parity_failures"] += int(failures.sum())
        mirror(cache, out[2:])
        self.stats["compiled_calls"] += 1
        hidden = out[1] if out[1].size else None
        return out[0], hidden, True, failures

    def verify_round(self, pending: mx.array, drafts: mx.array, limit: mx.array, live: mx.array, cache: BatchCache,
                     accept=None):
        """A round's verify of [pending, drafts] and its acceptance as one program: (read [W, 2 + K], n, next,
        counts, lengths after, verify_in, hidden), lengths not moved; None where not compiled."""
        W, K = drafts.shape
        if self.mode != "on":
            return None
        key, arrays = self._compiled(W, K + 1, cache)
        if key is None:
            return None
        akey, extra = self._accept_key(accept)
        key = key + (akey,)
        if key in self.programs.broken:
            return None
        out = self.programs.call(key, self._build(key, cache.kinds), pending, drafts, limit, live, cache.rows.device,
                                 *arrays, *extra)
        if out is None:
            self._fallback(self.programs.broken[key])
            return None
        mirror(cache, out[7:])
        self.stats["compiled_calls"] += 1
        return tuple(out[:6]) + ((out[6] if out[6].size else None),)

    @staticmethod
    def _accept_key(accept):
        if accept is None:
            return ("greedy",), []
        sampler, q, u_accept, u_next = accept
        key = ("sampled", sampler.any_top_k, sampler.any_top_p, q is not None)
        return key, [sampler.temps, sampler.top_p, sampler.top_k, u_accept, u_next] + ([] if q is None else [q])

    def eager(self, tokens, cache: BatchCache):
        cache.set_capturing(True)
        try:
            return self.runtime.forward(tokens, cache)
        finally:
            cache.set_capturing(False)

    @staticmethod
    def _tol(logits) -> float:
        return 1e-4 if logits.dtype == mx.float32 else 3e-2

    def _compare(self, got: mx.array, ref: mx.array) -> np.ndarray:
        """Per row: does the compiled verify differ from eager (any argmax, or beyond tolerance)?"""
        scale = mx.maximum(mx.abs(ref).max(axis=-1), 1.0)
        diff = (mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max(axis=-1) / scale).max(axis=-1)
        return np.array((mx.argmax(got, axis=-1) != mx.argmax(ref, axis=-1)).any(axis=-1) | (diff > self._tol(got)))

    def _compare_cache(self, got, ref) -> np.ndarray:
        bad = mx.zeros((got[0].shape[0] if got else 0,), mx.bool_)
        for a, b in zip(got, ref):
            if a is not None and b is not None and a.size:
                a32, b32 = a.astype(mx.float32).reshape(a.shape[0], -1), b.astype(mx.float32).reshape(b.shape[0], -1)
                bad = bad | (mx.abs(a32 - b32).max(axis=-1) / mx.maximum(mx.abs(b32).max(axis=-1), 1.0) > self._tol(a))
        return np.array(bad)

    def _describe(self, got, ref, failures) -> str:
        row = int(np.argmax(failures))
        d = mx.abs(got[row].astype(mx.float32) - ref[row].astype(mx.float32)).max(axis=-1)
        pos = int(mx.argmax(d).item())
        return (f"compiled verify differs from eager at row {row}, verify position {pos}: "
                f"max |logit diff| {d[pos].item():.3g}, argmax {int(mx.argmax(got[row, pos]).item())} vs "
                f"{int(mx.argmax(ref[row, pos]).item())} (tolerance {self._tol(got):g}; use compiled_verify: parity2 "
                "to count instead of raise)")
