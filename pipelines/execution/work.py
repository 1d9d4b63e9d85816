"""From prepared rows to engine requests and back to output rows: the one request loop that the
local executor, the Ray actors and `MTPLXPredictor` all run.

    plan()         prepared items -> Work: a row's samples still to do, in scheduling order, with
                   its stable prefix and its own sampling settings and seed (openai-batch)
    engine_rows()  Work -> Requests -> engine.generate() -> output rows, in completion order;
                   a row that cannot run becomes its error row without reaching the engine
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Iterable, Iterator, Optional, Sequence, Tuple

from mtplx.request import Request, SamplingParams, derive_seed

from ..errors import RunError
from ..io.columns import output_row
from ..io.job_input import Prepared
from ..io.rows import Item, prepare
from ..job.config import JobConfig
from .ordering import ordered


@dataclass
class Work:
    """One input row for the engine: which samples to generate, with what."""

    item: Item  # item.index: the row's key (the input row index, or a position in a batch)
    samples: Sequence[int]
    prefix: int = 0  # stable prefix length (prefill splits there; shared prefixes are reused)
    params: Optional[SamplingParams] = None  # None: the job's generation settings
    seed_base: Optional[int] = None  # None: generation.seed


def plan(job: JobConfig, prep: Prepared, committed: Collection[Tuple[int, int]], limit: Optional[int],
         max_context: Optional[int]) -> Iterator[Work]:
    """The job's rows still to do: source rows -> `prepare` (id, tokens, per-row errors) -> drop
    (row, sample) keys already committed -> `ordered` (prefix groups or length, stable prefixes)."""
    n = job.generation.n
    items = prepare(prep.source.rows(), prep.renderer, job.input.id_column, job.output.keep_columns,
                    max_context, prep.check_keep, limit)
    # Committed rows leave before ordering, so the ordering window holds only work still to do.
    pending = (Work(it, [s for s in range(n) if (it.index, s) not in committed]) for it in items)
    row_params = getattr(prep.renderer, "row_params", None)  # a request's own settings (openai-batch)
    base = job.generation.sampling_params()
    for work, prefix in ordered((w for w in pending if w.samples), job.schedule.order, lambda w: w.item.tokens,
                                job.ordering.window_rows, job.ordering.min_prefix_tokens, n):
        work.prefix = prefix
        own = row_params(work.item.id) if row_params is not None and work.item.tokens is not None else None
        if own is not None:
            work.params, work.seed_base = own.apply(base), own.seed
        yield work


def engine_rows(engine, work: Iterable[Work], params: SamplingParams, seed: int,
                on_submit: Optional[Callable[[Tuple[int, int], int], None]] = None
                ) -> Iterator[Tuple[Dict[str, Any], bool]]:
    """(output row, reached the engine) for every (item, sample) of `work`, in completion order.

    `params` / `seed` apply where a Work carries none of its own. `on_submit((row, sample),
    prompt_tokens)` runs for every request the engine takes. An engine that stops with requests
    unanswered, or answers one it was never given, is a RunError (nothing of those rows is written)."""
    inflight: Dict[Tuple[int, int], Tuple[Item, int]] = {}
    ready: collections.deque = collections.deque()  # error rows met while the engine pulled requests

    def requests() -> Iterator[Request]:
        for w in work:
            item = w.item
            base = seed if w.seed_base is None else w.seed_base
            for s in w.samples:
                row_seed = derive_seed(base, item.id, s) if item.id is not None else 0
                if item.tokens is None:
                    ready.append(output_row(item, s, row_seed, error=item.error))
                    continue
                inflight[(item.index, s)] = (item, row_seed)
                if on_submit is not None:
                    on_submit((item.index, s), len(item.tokens))
                yield Request(key=(item.index, s), prompt_tokens=item.tokens,
                              params=params if w.params is None else w.params,
                              seed=row_seed, stable_prefix_len=w.prefix)

    feed = requests()
    try:
        for result in engine.generate(feed):
            while ready:
                yield ready.popleft(), False
            key = tuple(result.key)
            if key not in inflight:
                raise RunError(f"the engine returned a result for an unknown request {result.key!r}")
            item, row_seed = inflight.pop(key)
            yield output_row(item, key[1], row_seed, result=result), True
        for _ in feed:  # trailing error rows; a real request left here is a bug, reported below
            pass
    except Exception:
        while ready:  # error rows the engine pulled before it failed are still written
            yield ready.popleft(), False
        raise
    while ready:
        yield ready.popleft(), False
    if inflight:
        raise RunError(f"the engine stopped with {len(inflight)} requests unanswered; "
                       "they were not committed and a resume will generate them")
