"""The generation engine: chunked prefill, prefix reuse, and continuous speculative batching.

`Engine` loads what a run needs and holds its collaborators (the scheduler, the prefiller, the rounds:
docs/architecture.md); `generate` alternates admission and rounds, rows joining as others finish.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from .architectures import PASSED_FILE, capture_backend, prepare, probe_key
from .cache import BatchCache, capacity_bucket
from .calibrate import AUTO_ROW_TOKENS, auto_max_batch, cost_shapes, load_profile, one_stream_eager, profile_path
from .config import ScheduleConfig, SpeculativeConfig, prefill_chunk_env, sustained_prefill_env
from .counters import Counters
from .depth import CPU_SLOPE, UNTRIED_SLOPE, DepthController
from .drafting import Drafter, make_drafter
from . import kernels
from .graphbank import CompiledVerifyBank
from .models.loading import ModelBundle, cache_dir, context_length, load
from .models.mtp import has_trunk_split, project_logits, trunk_hidden
from .prefill import (MIN_PREFIX_TOKENS, Prefiller, activation_bytes, _iter_prefill_chunk_spans,  # noqa: F401
                      _prefill_chunk_size, _split_spans_at)  # (the seed's names live here too)
from .request import Request, Result
from .rounds import Rounds
from .scheduler import Memory, Scheduler


def device_memory_bytes() -> int:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _spans(n: int, span: int):
    """(queries, queries x keys) of the largest spans of a prefill of `n` tokens in spans of `span`:
    the last whole one and the remainder (keys: the cache's capacity once the span is written)."""
    whole = n // span * span
    return [(q, q * capacity_bucket(end)) for q, end in ((min(span, n), whole or n), (n - whole, n)) if q]


class _Runtime:
    """What a forward needs: the model, and whether hidden states are wanted (MTP)."""

    def __init__(self, model, want_hidden: bool):
        self.model = model
        self.want_hidden = want_hidden and has_trunk_split(model)
        self.split = has_trunk_split(model)

    def forward(self, tokens, cache: BatchCache):
        if self.want_hidden:
            h = trunk_hidden(self.model, tokens, cache.layers)
            return project_logits(self.model, h), h
        return self.model(tokens, cache=cache.layers), None


class Engine:
    def __init__(self, bundle: ModelBundle, spec: Optional[SpeculativeConfig] = None,
                 schedule: Optional[ScheduleConfig] = None, drafter: Optional[Drafter] = None):
        """`drafter`: a draft source of one's own (any `Drafter`) in place of the one `spec.method` names."""
        # Progress hook: ("prefill", n) after each prefill span, ("decode", n) after each round (tokens
        # over all rows), ("build", 1) as a compiled program's first call starts (it builds)
        self.on_progress: Optional[Callable[[str, int], None]] = None
        self.counters = Counters(on_build=lambda: self._progress("build", 1))
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
        compiled = self.spec.compiled_verify != "off"
        self.decode_paths = kernels.install(self.model, compiled)  # CUDA only
        self.drafter = drafter if drafter is not None else make_drafter(self.spec, bundle, self.counters)
        if self.drafter is not None:  # the drafter's own modules take the trunk's paths
            self.decode_paths.update(self.drafter.fuse_kernels(compiled))
        self.runtime = _Runtime(self.model, want_hidden=self.drafter is not None and self.drafter.needs_hidden)
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        budget = self.schedule.memory_budget
        self.memory_budget = int(budget) if str(budget) != "auto" else int(0.6 * device_memory_bytes()) - self.weight_bytes
        chunk = self.schedule.prefill_chunk
        env_chunk = prefill_chunk_env()  # MTPLX_PREFILL_CHUNK_SIZE wins over schedule.prefill_chunk
        self.prefill_chunk = env_chunk if env_chunk is not None else (
            _prefill_chunk_size(cfg, self.memory_budget) if str(chunk) == "auto" else int(chunk))
        self.sustained_prefill = sustained_prefill_env()
        self.bank = None if self.spec.compiled_verify == "off" else CompiledVerifyBank(
            self.runtime, max_verify_len=self.spec.depth + 1,
            request_max_tokens=self.max_context,  # narrowed to the rows in flight at admission
            capture_backend=capture_backend(self.model), parity=self.spec.compiled_verify,
            growth_limit=self.spec.verify_max_len, counters=self.counters)
        self.prefiller = Prefiller(self.runtime, self.prefill_chunk, self.hybrid, self.counters, self._progress,
                                   self.sustained_prefill)
        self._bytes_per_token, self._bytes_per_row, self._hidden_per_token = self._measure_cache()
        self._activation_per_token = activation_bytes(cfg)
        # off a GPU, MLX's attention holds a float32 score per head and key (a GPU's fused kernels none)
        heads = cfg.get("num_attention_heads") or (cfg.get("text_config") or {}).get("num_attention_heads") or 1
        self._score_per_key = 0 if mx.default_device().type == mx.DeviceType.gpu else 4 * int(heads)
        self.profile_file, profile = self._calibration(bundle)
        self.max_batch = (auto_max_batch(profile, self.memory_budget, self.row_bytes(AUTO_ROW_TOKENS, 0))
                          if str(self.schedule.max_batch) == "auto" else int(self.schedule.max_batch))
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        self.depth_control = DepthController(self.spec.depth if self.drafter is not None else 0, self.spec.adaptive_depth,
                                             shapes=cost_shapes(profile),
                                             prior=self.drafter.acceptance_prior if self.drafter is not None else None,
                                             slope=CPU_SLOPE if on_cpu else UNTRIED_SLOPE,
                                             programs=self.drafter.programs if self.drafter is not None else 1,
                                             fixed_width=self.max_batch)
        self.first_token_at: Optional[float] = None  # perf_counter() when the first prefill gave its token
        # requests the next generate() call's stream holds, where its caller knows (a job: its rows left):
        # adaptive depth prices a program's build against the work left (rounds.py: Rounds._left)
        self.expected_requests: Optional[int] = None
        memory = Memory(self.memory_budget, self.ahead_tokens, self.slot_bytes, self.prefill_bytes, self.store_bytes)
        self.scheduler = Scheduler(self.tokenizer, self.eos, self.max_batch, self.max_context, memory, self.drafter)
        # one-row plain decoding eagerly (the same logits) where the calibration measured it faster
        self.rounds = Rounds(self.drafter, self.bank, self.runtime, self.depth_control, self.counters, self._progress,
                             self.spec.depth, self.max_batch, self.bank is not None and one_stream_eager(profile))
        self.side_stream = None  # the stream admissions behind a round in flight prefill on (`_prefill_stream`)

    @staticmethod
    def _probe_memory(bundle: ModelBundle):
        """Where a passed architecture probe is remembered: only beside a model we converted."""
        try:
            ours = Path(bundle.path).resolve().is_relative_to(cache_dir().resolve())
        except (OSError, TypeError):
            ours = False
        return (Path(bundle.path) / PASSED_FILE, probe_key(bundle.config, bundle.model)) if ours else None

    def _calibration(self, bundle: ModelBundle):
        """(profile file, profile) from `schedule.calibration` or beside the model, else (None, None); a
        named profile that does not load is an error."""
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

    # -- memory --------------------------------------------------------------------------------------
    def _measure_cache(self) -> Tuple[float, float, int]:
        """Cache bytes per entry (attention) and per row (recurrent state), and bytes of the trunk's
        hidden state per token where a drafter reads it: from a 1-token probe."""
        probe = BatchCache.for_model(self.model, 1)
        _, hidden = self.runtime.forward(mx.array([[0]], dtype=mx.int32), probe)
        probe.eval()
        return probe.row_bytes() + (0 if hidden is None else hidden.nbytes,)

    def _verify_len(self) -> int:
        return self.spec.depth + 1 if self.drafter is not None else 1

    def entries(self, reach: int) -> int:
        """Entries a row's target cache holds where the batch's rows reach `reach` tokens: a verify
        writes past the longest (the caches are made with room for them: Scheduler.place)."""
        return reach + self._verify_len()

    def _one_row(self, entries: int, drafter: bool = True) -> int:
        """One row of the target's cache holding `entries` (in its capacity bucket), and of the drafter's
        state where its row's context is as long."""
        own = self.drafter.slot_bytes(entries) if self.drafter is not None and drafter else 0
        return int(self._bytes_per_token * capacity_bucket(entries) + self._bytes_per_row) + own

    def slot_bytes(self, reach: int) -> int:
        """Bytes one slot of the batch holds where its rows reach `reach` tokens: the target's cache (a
        verify writes past the longest row) and the drafter's state in their capacity buckets, and a
        verify's captured recurrent states."""
        target = self._one_row(self.entries(reach), drafter=False) + int(self._verify_len() * self._bytes_per_row)
        return target + (self.drafter.slot_bytes(reach) if self.drafter is not None else 0)

    def row_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """A slot's bytes for a row of `prompt_tokens` + `max_tokens` (in a batch of rows no longer)."""
        return self.slot_bytes(prompt_tokens + max_tokens + self.ahead_tokens)

    def prefill_bytes(self, rows) -> int:
        """Bytes the prefill of `rows` holds beside the batch until they are placed: each row's caches
        (the target's and the drafter's, as long as the longest row) twice (a cache grows by copies), the
        hidden states its drafter reads, a shared prefix's snapshot, and the scratch of the largest
        forward over them (the drafter's model is taken to be no larger than the trunk)."""
        if not rows:
            return 0
        n = max(len(r.req.prompt_tokens) for r in rows)
        spans = [self.prefill_chunk if self.prefill_chunk and self.sustained_prefill else n]
        if self.drafter is not None and self.drafter.chunk:
            spans.append(self.drafter.chunk)
        forward = max(max(q * self._activation_per_token + qk * self._score_per_key for q, qk in _spans(n + 1, span))
                      for span in spans)
        per_row = 2 * self._one_row(n + 1) + n * self._hidden_per_token + forward
        edges = [self.prefiller.edge(r) for r in rows]
        return len(rows) * per_row + sum(self._one_row(e) for e in edges if e >= MIN_PREFIX_TOKENS)

    def store_bytes(self) -> int:
        """Bytes the prefix store holds: one row of each stored prefix."""
        return sum(self._one_row(prefix.rows.max) for prefix, _ in self.prefiller.store.values())

    @property
    def ahead_tokens(self) -> int:
        """How far past its last token a row's cache can reach with rounds queued one ahead (a finished
        row is still in the round queued before it was read, whose verify writes past it)."""
        return 2 * (self.spec.depth + 1) if self.drafter is not None and self.drafter.device_side else 0

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Results as rows finish, in any order; `max_batch` rows in flight while rows remain."""
        if self.drafter is not None:
            self.drafter.reset()
        self.rounds.reset()
        sched = self.scheduler
        sched.start(requests)
        sched.expected = self.expected_requests
        while True:
            # Fill free slots, then widen up to max_batch; repeat while rows finish at prefill.
            while (yield from self._admit()):
                pass
            if not sched.live:
                if sched.drained:
                    return
                continue
            if sched.drained and sched.narrows(sched.live) is not None:
                yield from self.rounds.land_carried(sched)  # narrowing reads exact lengths
                if not sched.live:
                    continue
                sched.narrow(sched.narrows(sched.live))
            yield from self.rounds.run(sched)

    def _admit(self):
        """One admission pass (a generator: yields the results of rows that cannot run, or that end at
        their first token). Returns True if it should run again."""
        sched = self.scheduler
        rows, free = yield from sched.select()
        if rows is None:  # nothing in flight, and the batch or the prefix store is in the next row's way
            yield from self.rounds.land_carried(sched)
            sched.release()
            self.prefiller.store.clear()
            return True
        if not rows:
            return False
        self.counters.admissions += 1
        if self.bank is not None:  # the growth budget: the longest context a row of the batch can reach
            self.bank.set_budget(sched.reach)
            # caches grow, when they first grow, to hold it: the batch runs at one capacity and its
            # programs (keyed by capacity) are built once
            self.bank.reserve = sched.reach
            if self.drafter is not None:
                self.drafter.reserve(sched.reach)
        # Behind a round in flight (a full batch) the first tokens are not read here: the round the rows
        # join is queued from them first and they are read after it (Rounds.join)
        behind = self.rounds.carried is not None and len(sched.slots) >= self.max_batch
        started = time.perf_counter()
        with self._prefill_stream(behind):
            prefilled = self.prefiller.run(rows, self.drafter, read=not behind)
        self.counters.prefill_seconds += time.perf_counter() - started
        if self.bank is not None:
            self.bank.note_restored(sum(r.stats.cached_prompt_tokens for r in rows))
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()  # the startup phases end here
        if behind:
            prefilled, firsts = prefilled
            sched.place(free, rows, prefilled, self.entries(sched.reach))
            self.rounds.join(sched, firsts, list(zip(free, rows)))
            return False
        self._progress("decode", sum(1 for _, _, first in prefilled if first not in self.eos))
        going, finished_early = [], False
        for row, got in zip(rows, prefilled):
            reason = sched.emit(row, [got[2]])
            if reason is not None:
                finished_early = True
                yield sched.finish(row, reason)
                continue
            row.pending = row.tokens[-1]
            going.append((row, got))
        sched.place(free, [r for r, _ in going], [g for _, g in going], self.entries(sched.reach))
        return finished_early and not sched.drained

    def _prefill_stream(self, behind: bool):
        """An admission behind a round in flight prefills on a stream of its own, so the device may run it
        beside the launch-bound rounds (H200, width 32: 13.1 ms a round against 17.5 on one stream)."""
        if not behind:
            return contextlib.nullcontext()
        if self.side_stream is None:
            self.side_stream = mx.new_stream(mx.default_device())
        return mx.stream(self.side_stream)
