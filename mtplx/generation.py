"""The generation engine: chunked prefill, prefix reuse, and continuous speculative batching.

One round, for every row in flight at once:
  draft K tokens (drafters.py) -> verify [pending, d1..dK] in one forward (graphbank.py)
  -> accept per row (sampling.py) -> commit each row's own count (cache.py) -> emit.
K = 0 is plain decoding through the same loop, so speculation changes nothing around it.
Rounds run one ahead where nothing needs the host between them (plain decoding, and drafters
that draft on the device): round r+1 is queued from round r's device arrays before round r is
read, so building one round's graph overlaps running the other, and each round is read once.
Rows join as others finish (continuous batching); each new row is prefilled in chunk spans
split at its stable-prefix edge, and a prefix shared with earlier rows is copied, not recomputed.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import BatchCache, RowKVCache
from .calibrate import AUTO_ROW_TOKENS, auto_max_batch, cost_shapes, load_profile, one_stream_eager, profile_path
from .config import ScheduleConfig, SpeculativeConfig, prefill_chunk_env, sustained_prefill_env
from .depth import DepthController
from .drafters import make_drafter
from . import fusion
from .fusion import DECODE_GROUPS, decode_paths, fuse_projections, quantize_head
from .architectures import PASSED_FILE, capture_backend, prepare, probe_key
from .graphbank import CompiledVerifyBank
from .models.loading import ModelBundle, cache_dir, context_length, load
from .models.mtp import has_trunk_split, project_logits, trunk_hidden
from .prefill import Prefiller, _iter_prefill_chunk_spans, _prefill_chunk_size, _split_spans_at  # noqa: F401 (the seed's names live here too)
from . import stops
from .request import Request, Result, RowStats
from .spec_rounds import REFILL_AT, SpeculativeRounds
from .sampling import SamplerBatch, sample_from, shaped_probs, uniforms

# -- memory ----------------------------------------------------------------------------------------
def device_memory_bytes() -> int:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _tree_bytes(tree) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(tree))


# -- the engine ------------------------------------------------------------------------------------
class _Runtime:
    """What a verify forward needs: the model, and whether hidden states are wanted (MTP)."""

    def __init__(self, model, want_hidden: bool):
        self.model = model
        self.want_hidden = want_hidden and has_trunk_split(model)
        self.split = has_trunk_split(model)

    def forward(self, tokens, cache: BatchCache):
        if self.want_hidden:
            h = trunk_hidden(self.model, tokens, cache.layers)
            return project_logits(self.model, h), h
        return self.model(tokens, cache=cache.layers), None


@dataclass
class _Row:
    req: Request
    rng: np.random.Generator
    max_tokens: int
    stats: RowStats
    started: float
    tokens: List[int]
    pending: int = 0
    width_sum: int = 0
    depth_sum: int = 0
    rounds: int = 0
    u_next: Optional[np.ndarray] = None  # uniforms drawn for a round not yet queued (Engine._plan)


class _Batch:
    """The rows in flight (slots), their cache, and the request stream feeding them."""

    def __init__(self, source):
        self.source = source
        self.waiting: List[Request] = []
        self.exhausted = False
        self.slots: List[Optional[_Row]] = []
        self.cache: Optional[BatchCache] = None

    @property
    def drained(self) -> bool:
        return self.exhausted and not self.waiting

    def next_request(self) -> Optional[Request]:
        if self.waiting:
            return self.waiting.pop(0)
        req = None if self.exhausted else next(self.source, None)
        self.exhausted = req is None
        return req

    def peek(self) -> None:
        """Learn whether a request waits (it is kept first in `waiting`), so `drained` is known."""
        if not self.waiting and not self.exhausted:
            req = self.next_request()
            if req is not None:
                self.waiting.insert(0, req)


class Engine(SpeculativeRounds):
    def __init__(self, bundle: ModelBundle, spec: Optional[SpeculativeConfig] = None, schedule: Optional[ScheduleConfig] = None):
        # Progress hook: on_progress("prefill", n) after each prefill span (n prompt tokens), and
        # on_progress("decode", n) after each decode round (n tokens generated over all rows).
        self.on_progress: Optional[Callable[[str, int], None]] = None
        self.bundle = bundle
        self.model = bundle.model
        self.tokenizer = bundle.tokenizer
        self.spec = spec or SpeculativeConfig()
        self.schedule = schedule or ScheduleConfig()
        cfg = bundle.config
        self.vocab_size = bundle.vocab_size
        self.max_context = context_length(cfg)
        self.eos = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        self.hybrid = prepare(self.model, bundle.model_type, self.vocab_size,  # refuses what it cannot batch exactly
                              remember=self._probe_memory(bundle))
        self.decode_paths = decode_paths(self.model, self.spec.compiled_verify != "off",  # CUDA only
                                         self.stack_projections, self.use_rows_attention, self.use_skinny_matmul,
                                         self.use_layer_kernels, self.use_mlp_kernel, self.use_o_norm_kernel)
        self.drafter = make_drafter(self.spec, bundle)
        if (self.stack_projections and self.spec.compiled_verify != "off" and fusion.stacking_pays()  # as decode_paths stacks
                and isinstance(getattr(self.drafter, "head", None), nn.Module)):
            # the MTP head's blocks take the trunk's kernels: quantized where the trunk is, and the stacked
            # one-row products (its draft steps are one row)
            self.decode_paths["head_quantized"] = quantize_head(self.drafter.head, self.model)
            # its float products of a few rows as matrix-vector products (fusion.HEAD_GEMV)
            self.decode_paths["head_gemv"] = fusion.head_gemv(self.drafter.head, getattr(self.drafter, "vocab", None))
            self.decode_paths["head_stacked_projections"] = fuse_projections(self.drafter.head, DECODE_GROUPS)
        self.runtime = _Runtime(self.model, want_hidden=self.drafter is not None and self.drafter.needs_hidden)
        self.weight_bytes = _tree_bytes(self.model.parameters())
        budget = self.schedule.memory_budget
        self.memory_budget = (
            int(budget) if str(budget) != "auto" else int(0.6 * device_memory_bytes()) - self.weight_bytes
        )
        chunk = self.schedule.prefill_chunk
        env_chunk = prefill_chunk_env()  # MTPLX_PREFILL_CHUNK_SIZE wins over schedule.prefill_chunk
        self.prefill_chunk = env_chunk if env_chunk is not None else (
            _prefill_chunk_size(cfg, self.memory_budget) if str(chunk) == "auto" else int(chunk))
        self.sustained_prefill = sustained_prefill_env()
        self.bank = None
        if self.spec.compiled_verify != "off":
            self.bank = CompiledVerifyBank(
                self.runtime,
                max_verify_len=self.spec.depth + 1,
                request_max_tokens=self.max_context,  # narrowed to the rows in flight at admission
                capture_backend=capture_backend(self.model),
                parity=self.spec.compiled_verify,
                growth_limit=self.spec.verify_max_len,
            )
        self.counters = {"prefill_tokens": 0, "cached_prompt_tokens": 0, "rounds": 0, "host_reads": 0}
        self._const = {}  # constant device arrays by shape (zero uniforms for all-greedy rounds)
        self.prefiller = Prefiller(self.runtime, self.prefill_chunk, self.hybrid, self.counters, self._progress,
                                  self.sustained_prefill)
        self._bytes_per_token, self._bytes_per_row = self._measure_cache()
        self.profile_file, profile = self._calibration(bundle)
        self.max_batch = (auto_max_batch(profile, self.memory_budget, self.row_bytes(AUTO_ROW_TOKENS, 0))
                          if str(self.schedule.max_batch) == "auto" else int(self.schedule.max_batch))
        self.depth_control = DepthController(self.spec.depth if self.drafter is not None else 0, self.spec.adaptive_depth,
                                             shapes=cost_shapes(profile),
                                             prior=getattr(self.drafter, "acceptance_prior", None))
        self.first_token_at: Optional[float] = None  # perf_counter() when the first prefill gave its token
        # one-row plain decoding eagerly (the same logits) where the calibration measured it faster
        self.one_stream_eager = self.bank is not None and one_stream_eager(profile)

    # fusion.decode_paths; benchmarks/decode_anatomy turns them off to measure without.
    stack_projections = True
    use_rows_attention = True
    use_skinny_matmul = False  # skinny_matmul.py: exact on the H200, but no faster than MLX's gemv at one row
    # layer_kernels.py for Qwen3 models (its DEFAULT_FAMILIES): bit-identical on the H200 and at or above
    # the unfused ops at the 8B shape (session 6: 177 vs 166, 180 vs 178 tok/s); CUDA only
    use_layer_kernels = True
    # mlp_kernel.py (gate/up product + SwiGLU, one kernel at one row): off until the H200 check passes
    use_mlp_kernel = False
    # o_norm_kernel.py with layer_kernels (a one-row product + residual add + RMSNorm as one kernel: o_proj with the
    # post-attention norm, down_proj with the next input norm): bit-identical on the H200, but slower than the
    # separate kernels once their small arrays are in device memory (session 7 final window: 187 vs 191 tok/s)
    use_o_norm_kernel = False

    @staticmethod
    def _probe_memory(bundle: ModelBundle):
        """Where a passed architecture probe is remembered: only beside a model we converted."""
        try:
            ours = Path(bundle.path).resolve().is_relative_to(cache_dir().resolve())
        except (OSError, TypeError):
            ours = False
        return (Path(bundle.path) / PASSED_FILE, probe_key(bundle.config, bundle.model)) if ours else None

    def _calibration(self, bundle: ModelBundle):
        """(profile file, profile) from `schedule.calibration` or beside the model; (None, None) when
        there is none for this device and model. A named profile that does not load is an error."""
        named = self.schedule.calibration
        path = Path(named) if named else profile_path(bundle.path)
        profile = load_profile(path, bundle.config)
        if named and profile is None:
            raise ValueError(f"schedule.calibration: {named} is missing, unreadable, or was measured on another "
                             f"device or model; make one with `mtplx-batch calibrate {bundle.path} --out {named}`")
        return (str(path), profile) if profile is not None else (None, None)

    @classmethod
    def load(cls, model_path, spec: Optional[SpeculativeConfig] = None, schedule: Optional[ScheduleConfig] = None,
             trust_remote_code: bool = False, gguf_mode: str = "auto", tokenizer=None):
        """`gguf_mode`: how a GGUF model (and a GGUF draft model) is converted (config.GGUF_MODES);
        `tokenizer`: the model's, already loaded (a job's session has it before weights load)."""
        return cls(load(model_path, trust_remote_code=trust_remote_code, gguf_mode=gguf_mode, tokenizer=tokenizer),
                   spec, schedule)

    def _progress(self, kind: str, tokens: int) -> None:
        if self.on_progress is not None and tokens:
            self.on_progress(kind, int(tokens))

    # -- memory admission --------------------------------------------------------------------------
    def _measure_cache(self) -> Tuple[float, int]:
        """Cache bytes per token (attention) and per row (recurrent state), from a 1-token probe."""
        probe = BatchCache.for_model(self.model, 1)
        self.model(mx.array([[0]], dtype=mx.int32), cache=probe.layers)
        probe.eval()
        per_token = sum(c.nbytes / c.keys.shape[2] for c in probe.leaves if isinstance(c, RowKVCache) and c.keys is not None)
        per_row = sum(c.nbytes for c in probe.leaves if not isinstance(c, RowKVCache))
        return per_token, per_row

    def row_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        depth = self.spec.depth + 1 if self.drafter else 1
        return int((prompt_tokens + max_tokens + depth + self.ahead_tokens) * self._bytes_per_token
                   + (1 + depth) * self._bytes_per_row)

    @property
    def ahead_tokens(self) -> int:
        """How far past its last token a row's cache can reach with rounds queued one ahead: a
        finished row is still in the round queued before it was read, and that round's
        verify writes past it (bounded by the host's upper-bound lengths, RowLengths)."""
        return 2 * (self.spec.depth + 1) if self.drafter is not None and self.drafter.device_side else 0

    # -- generation ----------------------------------------------------------------------------------
    def _new_row(self, req: Request) -> Tuple[Optional[_Row], Optional[Result]]:
        n = len(req.prompt_tokens)
        stats = RowStats(prompt_tokens=n)
        if n == 0:
            return None, Result(req.key, [], "", "error", "empty prompt: the row has no tokens", stats, req.seed)
        if n >= self.max_context:
            return None, Result(
                req.key, [], "", "error",
                f"prompt has {n} tokens but the model's context is {self.max_context}: shorten the prompt",
                stats, req.seed,
            )
        max_tokens = min(req.params.max_tokens, self.max_context - n)
        need = self.row_bytes(n, max_tokens)
        if need > self.memory_budget:
            return None, Result(
                req.key, [], "", "error",
                f"row needs ~{need / 2**20:.0f} MiB of cache ({n} prompt + {max_tokens} new tokens) but "
                f"schedule.memory_budget is {self.memory_budget / 2**20:.0f} MiB: raise the budget or lower max_tokens",
                stats, req.seed,
            )
        rng = np.random.default_rng(req.seed)
        return _Row(req, rng, max_tokens, stats, time.perf_counter(), []), None

    def _finish(self, row: _Row, reason: str) -> Result:
        hit = stops.cut(self.tokenizer.decode, row.tokens, row.req.params.stop) if row.req.params.stop else None
        if hit is not None:  # a round may have emitted past the token that completes the stop string
            del row.tokens[hit[0]:]
            text, reason = hit[1], "stop"
        else:
            text = self.tokenizer.decode(row.tokens)
        st = row.stats
        st.completion_tokens = len(row.tokens)
        st.decode_seconds = time.perf_counter() - row.started
        if row.rounds:
            st.batch_width = int(round(row.width_sum / row.rounds))
            st.draft_depth = int(round(row.depth_sum / row.rounds))
        return Result(row.req.key, list(row.tokens), text, reason, None, st, row.req.seed)

    def _emit(self, row: _Row, new_tokens: Sequence[int]) -> Optional[str]:
        """Append tokens; return a finish reason if the row is done."""
        for tok in new_tokens:
            if tok in self.eos:
                return "stop"
            row.tokens.append(int(tok))
            if len(row.tokens) >= row.max_tokens:
                return "length"
        if row.req.params.stop and stops.in_tail(self.tokenizer.decode, row.tokens, row.req.params.stop):
            return "stop"
        return None

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Results as rows finish, in any order; `max_batch` rows in flight while rows remain."""
        if self.drafter is not None:
            self.drafter.reset()
        self._carried = self._joining = None
        batch = _Batch(iter(requests))
        while True:
            # Fill free slots, then widen up to max_batch; repeat while rows finish at prefill.
            while (yield from self._admit(batch)):
                pass
            active = np.array([s is not None for s in batch.slots], dtype=bool)
            if not active.any():
                if batch.drained:
                    return
                continue
            if batch.drained and self._narrows(int(active.sum()), len(batch.slots)):
                yield from self._land_carried(batch.slots, batch.cache)  # narrowing reads exact lengths
                active = np.array([s is not None for s in batch.slots], dtype=bool)
                if not active.any():
                    continue
                keep = self._compact_keep(active, self._tail_target(int(active.sum()), len(batch.slots)))
                batch.cache.take_rows(keep)
                if self.drafter is not None:
                    self.drafter.take(keep)
                batch.slots = [batch.slots[i] for i in keep]
                active = active[keep]
            if self.drafter is None:
                yield from self._plain_rounds(batch.slots, active, batch.cache, drained=batch.drained)
            else:
                yield from self._round(batch.slots, active, batch.cache, drained=batch.drained)

    def _admit(self, batch: "_Batch"):
        """One admission pass (a generator: yields error rows). Returns True if it should run again."""
        slots = batch.slots
        free = [i for i, s in enumerate(slots) if s is None] + list(range(len(slots), self.max_batch))
        live = [s for s in slots if s is not None]
        used_bytes = sum(self.row_bytes(len(s.req.prompt_tokens), s.max_tokens) for s in live)
        admitted = []
        while len(admitted) < len(free) and not batch.drained:
            req = batch.next_request()
            if req is None:
                break
            row, err = self._new_row(req)
            if err is not None:
                yield err
                continue
            need = self.row_bytes(len(req.prompt_tokens), row.max_tokens)
            if (live or admitted) and used_bytes + need > self.memory_budget:
                # Fits alone, not beside the rows in flight: it waits for one to finish, and the
                # rows admitted so far in this pass run (they were taken from the source).
                batch.waiting.insert(0, req)
                break
            used_bytes += need
            admitted.append(row)
        if not admitted:
            return False
        if len(admitted) == len(free):  # the batch is full: whether a request waits is not known yet
            batch.peek()
        if self.bank is not None:  # the growth budget: the longest context a row of this call can reach
            before = self.bank.request_max_tokens if batch.cache is not None else 0
            self.bank.set_budget(max([before] + [len(s.req.prompt_tokens) + s.max_tokens + self.ahead_tokens
                                                 for s in live + admitted]))
            for bank in (self.bank, getattr(self.drafter, "bank", None)):
                if hasattr(bank, "reserve"):
                    bank.reserve = self.bank.request_max_tokens
        grow, finished_early = [], False
        # Behind a round in flight (a full batch: every free slot is a vacated one) the first tokens
        # are not read here: the round the rows join is queued from them on the device first, and
        # they are read after it (SpeculativeRounds._land_joined), so the device does not wait for
        # the host between the prefill and that round.
        defer = self._carried is not None and len(slots) >= self.max_batch
        with self._prefill_stream(defer):
            if defer:
                prefilled, firsts = self.prefiller.run(admitted, self.drafter, read=False)
            else:
                prefilled = self.prefiller.run(admitted, self.drafter)
        if self.bank is not None:
            self.bank.note_restored(sum(r.stats.cached_prompt_tokens for r in admitted))
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()  # the startup phases end here
        if defer:
            placed = list(zip(free, admitted))
            for slot, (row, (row_cache, state, _)) in zip(free, zip(admitted, prefilled)):
                slots[slot] = row
                if self.drafter is not None:
                    self.drafter.write(slot, state)
            batch.cache.put_rows([s for s, _ in placed], [c for c, _, _ in prefilled])
            self._joining = (firsts, placed)
            self._start(batch.cache)
            return False
        self._progress("decode", sum(1 for _, _, first in prefilled if first not in self.eos))
        fills = []  # (slot, the row's cache): placed together, one gather per prefill group and layer
        for row, (row_cache, state, first) in zip(admitted, prefilled):
            reason = self._emit(row, [first])
            if reason is not None:
                finished_early = True
                yield self._finish(row, reason)
                continue
            row.pending = row.tokens[-1]
            slot = free.pop(0)
            if slot < len(slots):
                slots[slot] = row
                fills.append((slot, row_cache))
                if self.drafter is not None:
                    self.drafter.write(slot, state)
            else:
                grow.append((row, row_cache, state))
        if fills:
            batch.cache.put_rows([s for s, _ in fills], [c for _, c in fills])
            if self._carried is not None:  # behind a round in flight: the device starts placing the rows
                self._start(batch.cache)  # (and the drafter's prefill of them) while the host queues the next
        if grow:
            new = BatchCache.gather([c for _, c, _ in grow])
            if batch.cache is None:
                batch.cache = new
            else:
                batch.cache.extend(new)
            slots += [r for r, _, _ in grow]
            if self.drafter is not None:
                self.drafter.extend([s for _, _, s in grow])
        return finished_early and not batch.drained

    # An admission behind a round in flight prefills on a stream of its own, so the device may run it
    # beside the rounds (a launch-bound round leaves most of a GPU idle) and the rounds' stream keeps its
    # own work; its results reach the rounds through MLX's cross-stream dependencies (H200, width 32:
    # 13.1 ms a round against 17.5 on one stream).
    _side = None

    def _prefill_stream(self, behind: bool):
        if not behind:
            return contextlib.nullcontext()
        if self._side is None:
            self._side = mx.new_stream(mx.default_device())
        return mx.stream(self._side)

    def _start(self, cache: BatchCache) -> None:
        """Queue the evaluation of the batch's cache and the drafter's state (nothing is read)."""
        arrays = [a for c in cache.leaves for a in c.state_arrays() if a is not None]
        drafter_cache = getattr(self.drafter, "cache", None)
        if drafter_cache is not None:
            arrays += [a for c in drafter_cache.leaves for a in c.state_arrays() if a is not None]
            arrays += list(getattr(self.drafter, "extra", []))
        mx.async_eval(arrays)

    @staticmethod
    def _compact_keep(active: np.ndarray, width: int) -> List[int]:
        """The slots a batch narrowed to `width` keeps: its live rows, then idle ones up to the width."""
        live = [int(i) for i in np.nonzero(active)[0]]
        spare = [int(i) for i in np.nonzero(~active)[0]][: width - len(live)]
        return sorted(live + spare)

    def _verify(self, tokens: mx.array, cache: BatchCache, eager: bool = False):
        """The target model over `tokens` [W, L]: (logits, hidden, compiled?, parity failures per row);
        `eager`: the eager forward even where the compiled bank is on."""
        if self.bank is not None and not eager:
            return self.bank.verify(tokens, cache)
        cache.set_capturing(True)
        logits, hidden = self.runtime.forward(tokens, cache)
        cache.set_capturing(False)
        return logits, hidden, False, None

    @staticmethod
    def _record_forward(st: RowStats, i: int, compiled: bool, failures) -> None:
        """Every decode forward of a row (drafting or not, plain rounds too) counts on one path."""
        if compiled:
            st.compiled_verify_calls += 1
        else:
            st.eager_verify_calls += 1
        if failures is not None:
            st.parity_failures += int(failures[i])

    def _plain_rounds(self, slots: List[Optional[_Row]], active: np.ndarray, cache: BatchCache, drained: bool = False):
        """Decoding without drafts, one round ahead: the next round is queued on the device before
        this round's tokens are read, so building one graph overlaps running the other (as
        mlx-lm's generate_step does). Returns, as the speculative rounds do, once finished rows
        have freed a REFILL_AT-th of the slots for admission (at least one; `drained`: no request
        waits, until half the slots are idle), or no row is left: each return drains the pipeline."""
        sampler = SamplerBatch.from_params([s.req.params if s else None for s in slots])
        ones = active.astype(np.int64)  # the rows a round advances; a finished row's slot stops
        eager = self.one_stream_eager and len(slots) == 1

        def launch(pending: mx.array):
            logits, _, compiled, failures = self._verify(pending[:, None], cache, eager)
            if sampler.all_greedy:  # no uniforms to draw: greedy rows never read their generator
                nxt = mx.argmax(logits[:, 0], axis=-1).astype(mx.int32)
            else:
                u = mx.array(np.array([uniforms(s.rng) if s is not None else 0.0 for s in slots], dtype=np.float32))
                nxt = sample_from(shaped_probs(logits, sampler)[:, 0], u)
            cache.commit(ones)
            mx.async_eval(nxt)
            return nxt, compiled, failures

        def emit(launched):
            tokens, compiled, failures = np.array(launched[0]), launched[1], launched[2]
            finished, emitted, vacated = [], 0, []
            n_active = sum(s is not None for s in slots)
            for i, row in enumerate(slots):
                if row is None:
                    continue
                self._record_forward(row.stats, i, compiled, failures)
                row.rounds += 1
                row.width_sum += n_active
                row.pending = int(tokens[i])
                before = len(row.tokens)
                reason = self._emit(row, [row.pending])
                emitted += len(row.tokens) - before
                if reason is not None:
                    slots[i] = None
                    ones[i] = 0
                    finished.append(self._finish(row, reason))
                    vacated.append(i)
            self._vacate(cache, vacated)
            self.counters["rounds"] += 1
            self._progress("decode", emitted)
            return finished

        def leave() -> bool:
            live = sum(s is not None for s in slots)
            if drained:  # only where the batch is narrowed next (else no reason to empty the pipeline)
                return self._narrows(live, len(slots)) or not live
            return len(slots) - live >= max(1, len(slots) // REFILL_AT) or not live

        current = launch(mx.array(np.array([s.pending if s else 0 for s in slots], dtype=np.int32)))
        while True:
            # a round after this one only if some row can still be going after it (each round emits
            # one token per row: a row a token short of max_tokens ends with this one)
            going = any(s is not None and len(s.tokens) + 1 < s.max_tokens for s in slots)
            following = launch(current[0]) if going else None
            finished = emit(current)
            if following is None or (finished and leave()):
                if following is not None:
                    finished += emit(following)  # rows that go on keep the round in flight
                yield from finished
                return
            yield from finished
            current = following
