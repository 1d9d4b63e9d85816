"""`MTPLXPredictor`: the engine as a plain callable class for Ray Data's `map_batches`.

One instance holds one `Engine` (one model in memory); Ray Data makes one instance per actor:

    import ray
    from .ray_engine import MTPLXPredictor

    ds = ray.data.read_parquet("prompts.parquet")           # columns: id, prompt
    out = ds.map_batches(
        MTPLXPredictor,
        fn_constructor_kwargs={"model_path": "models/demo",
                               "speculative": {"method": "ngram"},
                               "generation": {"max_tokens": 128}},
        compute=ray.data.ActorPoolStrategy(size=2),          # two engines
        num_gpus=1,                                          # one GPU each (MLX CUDA)
        batch_size=64,
    )

`__call__(batch)` takes a batch as a dict of numpy arrays (Ray's default) or a `pyarrow.Table`
(`batch_format="pyarrow"`) and returns the same kind: one row per (input row, sample) holding the
output columns of DESIGN.md (`completion`, `finish_reason`, `error`, token counts, speculative
stats, ...) plus the input columns passed through. A row that cannot run (null prompt, prompt
longer than the context, engine refusal) becomes a row with `finish_reason == "error"` and the
reason in `error`; it never fails the batch.

The engine runs on a thread of its own (`EngineLoop`), in one long `engine.generate()` fed from
every batch the actor is handed: where Ray Data runs two calls on an actor at once (the
executor's setting, `ray_executor.actor_compute`), the next batch's rows fill the slots the last
rows of a batch leave, instead of the batch draining before the next call starts. MLX runs on
that thread alone (its streams belong to the thread that made them).

The `mtplx-batch` Ray executor (pipelines/execution/ray_executor.py) runs `JobPredictor`, a subclass that
takes rows already prepared by the job's own reader (row index, id, tokens, per-row errors), so a
job gives the same rows on Ray as it does locally; it yields its output rows as they finish.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np
import pyarrow as pa

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.request import SamplingParams

from ..io.columns import OUTPUT_COLUMNS, output_schema
from ..io.prompts import PromptRenderer, RowError
from ..io.rows import Item, check_context, content_id, row_id
from ..job.config import GenerationConfig, InputConfig, section_config
from .ordering import order_window
from .work import Work, engine_rows

# Columns the job's reader adds for JobPredictor (not output columns; never written to shards).
TOKENS_COL = "_mtplx_tokens"
SAMPLES_COL = "_mtplx_samples"
PREFIX_COL = "_mtplx_prefix"
PARAMS_COL = "_mtplx_params"  # JSON of a row's own SamplingParams (openai-batch requests), or null
SEED_COL = "_mtplx_seed"  # a row's own job seed (openai-batch `seed`), or null

Batch = Union[Dict[str, np.ndarray], pa.Table]


STREAM_EVERY = 0.5  # seconds: rows that finish within this of the first go out together


class EngineLoop:
    """One engine on a thread of its own, generating for every caller.

    `rows(work)` hands the engine a caller's Work and returns that caller's output rows, in lists
    as they finish; callers on other threads may do the same meanwhile. One `engine.generate()`
    runs as long as requests keep coming (continuous batching across the callers' batches) and
    ends when none waits and its rows are done; the next request starts another. `load()` builds
    the engine on the thread, so every MLX stream belongs to it; `ready()` waits for it."""

    def __init__(self, load: Callable[[], Any], params: SamplingParams, seed: int):
        self._todo: "queue.Queue[List[Work]]" = queue.Queue()
        self._owners: Dict[int, list] = {}  # key -> [caller's inbox, caller's own index, samples left]
        self._next_key = 0
        self._lock = threading.Lock()
        self._failed: Optional[BaseException] = None
        self._loaded = threading.Event()
        self.engine = None
        threading.Thread(target=self._serve, args=(load, params, seed), name="mtplx-engine", daemon=True).start()

    def ready(self):
        """The engine, once loaded; a failed load raises here."""
        self._loaded.wait()
        if self.engine is None:
            raise self._failed
        return self.engine

    def rows(self, work: List[Work]) -> Iterator[List[Dict[str, Any]]]:
        """The output rows of `work` (their `row`: the Work's own item.index), in lists as they
        finish. The work is queued at once, the rows are read as the iterator is."""
        inbox: "queue.Queue" = queue.Queue()
        with self._lock:
            if self._failed is not None:
                raise RuntimeError(f"the engine failed earlier: {self._failed}") from self._failed
            for w in work:  # keys unique across callers; each row goes back under its own index
                self._owners[self._next_key] = [inbox, w.item.index, len(w.samples)]
                w.item.index = self._next_key
                self._next_key += 1
        self._todo.put(work)
        return self._read(inbox, sum(len(w.samples) for w in work))

    @staticmethod
    def _read(inbox: "queue.Queue", left: int) -> Iterator[List[Dict[str, Any]]]:
        while left:
            got = [inbox.get()]
            until = time.monotonic() + STREAM_EVERY
            while len(got) < left:
                try:
                    got.append(inbox.get(timeout=max(0.0, until - time.monotonic())))
                except queue.Empty:
                    break
            for row in got:
                if isinstance(row, BaseException):
                    raise row
            left -= len(got)
            yield got

    def _serve(self, load, params: SamplingParams, seed: int) -> None:
        try:
            self.engine = load()
        except BaseException as e:
            self._failed = e
            return
        finally:
            self._loaded.set()
        while True:
            first = self._todo.get()  # idle: nothing in flight, nothing waiting
            try:
                for row, _ in engine_rows(self.engine, self._feed(first), params, seed):
                    with self._lock:
                        owner = self._owners[row["row"]]
                        owner[2] -= 1
                        if not owner[2]:
                            del self._owners[row["row"]]
                    row["row"] = owner[1]
                    owner[0].put(row)
            except BaseException as e:  # every caller waiting on the engine hears of it
                with self._lock:
                    self._failed = e
                    inboxes = {id(o[0]): o[0] for o in self._owners.values()}
                    self._owners.clear()
                for inbox in inboxes.values():
                    inbox.put(e)
                return

    def _feed(self, first: List[Work]) -> Iterator[Work]:
        yield from first
        while True:
            try:
                work = self._todo.get_nowait()
            except queue.Empty:
                return  # none waits: this generate() ends once its rows are done
            yield from work


def _py(v: Any) -> Any:
    """A numpy value (scalar, array, object array of arrays) as plain Python."""
    if isinstance(v, np.ndarray):
        return [_py(x) for x in v] if v.dtype == object else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {k: _py(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_py(x) for x in v]
    return v


def _batch_rows(batch: Batch) -> Tuple[List[str], List[Dict[str, Any]]]:
    if isinstance(batch, pa.Table):
        return batch.column_names, batch.to_pylist()
    names = list(batch)
    cols = {c: _py(np.asarray(batch[c]) if not isinstance(batch[c], np.ndarray) else batch[c]) for c in names}
    n = len(cols[names[0]]) if names else 0
    return names, [{c: cols[c][i] for c in names} for i in range(n)]


class MTPLXPredictor:
    """Generate completions for a batch of prompts with one MTPLX engine.

    Args:
        model_path: an mlx-lm model directory (or anything `mtplx` can load: GGUF, a known name).
        speculative: `SpeculativeConfig` or a dict of its fields (`{"method": "mtp", "depth": 3}`).
        generation: `GenerationConfig` or a dict (`max_tokens`, `temperature`, `top_p`, `top_k`,
            `seed`, `stop`, `n`); `n` > 1 gives n output rows per input row (`sample` 0..n-1).
        schedule: `ScheduleConfig` or a dict (`max_batch`, `prefill_chunk`, `memory_budget`,
            `order` within a batch).
        prompt_column / messages_column / template: where the prompt comes from, as in a job's
            `input:` section; the tokenizer's chat template applies per `chat_template`.
        tokens_column: a column of prompt token ids; when the batch has it, it is used as is
            (no template) and the text columns are ignored.
        id_column: the row id (seeds each row's sampler); without it, a hash of the prompt.
        gguf_mode: a GGUF model: auto | dequantize | quantized, as a job's `model.gguf_mode`.
        keep_input_columns: pass the input columns through (an input column whose name is an
            output column, e.g. `completion`, is replaced by the output).
    """

    def __init__(self, model_path: str, speculative: Any = None, generation: Any = None, schedule: Any = None,
                 *, prompt_column: Optional[str] = None, messages_column: Optional[str] = None,
                 template: Optional[str] = None, chat_template: str = "auto", tokens_column: str = "token_ids",
                 id_column: Optional[str] = "id", keep_input_columns: bool = True, trust_remote_code: bool = False,
                 gguf_mode: str = "auto", engine=None):
        # the job file's checks: n=0, top_p=0 or an unknown key is refused here as in a job file
        self.speculative = section_config(SpeculativeConfig, "speculative", speculative)
        self.generation = section_config(GenerationConfig, "generation", generation)
        self.schedule = section_config(ScheduleConfig, "schedule", schedule)
        self.inp = InputConfig(path=str(model_path), prompt_column=prompt_column, messages_column=messages_column,
                               template=template, chat_template=chat_template)
        self.params = self.generation.sampling_params()
        load = (lambda: engine) if engine is not None else (lambda: self._load(model_path, trust_remote_code, gguf_mode))
        self.loop = EngineLoop(load, self.params, self.generation.seed)
        self.engine = self.loop.ready()
        self._renderer: Optional[PromptRenderer] = None  # built on first text batch (may refuse the config)
        self.tokens_column = tokens_column
        self.id_column = id_column
        self.keep_input_columns = keep_input_columns

    def _load(self, model_path: str, trust_remote_code: bool, gguf_mode: str):
        """The engine, built on the engine loop's thread."""
        from mtplx.process import prepare_process

        prepare_process()  # here, not at import: the process is Ray's worker (mtplx/process.py)
        from mtplx.generation import Engine

        return Engine.load(model_path, self.speculative, self.schedule, trust_remote_code=trust_remote_code,
                           gguf_mode=gguf_mode)

    # ------------------------------------------------------------------ batch -> work
    @property
    def renderer(self) -> PromptRenderer:
        if self._renderer is None:
            self._renderer = PromptRenderer(self.inp, self.engine.tokenizer)
        return self._renderer

    def _work(self, names: List[str], rows: List[Dict[str, Any]]) -> List[Work]:
        """One `Work` per input row; item.index is the row's position in the batch."""
        out = []
        use_tokens = self.tokens_column in names
        max_context = self.engine.max_context
        for i, data in enumerate(rows):
            item = Item(index=i, id=None)
            try:
                if self.id_column and self.id_column in names:
                    item.id = row_id(data, self.id_column)
                else:  # a stable id from the prompt alone, so error rows get one too
                    cols = [self.tokens_column] if use_tokens else self.renderer.columns
                    item.id = content_id({c: data.get(c) for c in cols})
                if use_tokens:
                    toks = data.get(self.tokens_column)
                    if toks is None or isinstance(toks, (str, bytes)) or not all(
                            isinstance(t, int) and not isinstance(t, bool) for t in toks):
                        raise RowError(f"{self.tokens_column!r} must be a list of token ids")
                    tokens = [int(t) for t in toks]
                else:
                    tokens = self.renderer.tokens(data)
                if not tokens:
                    raise RowError("the prompt has no tokens")
                item.tokens = check_context(tokens, max_context)
            except RowError as e:
                item.error = e.reason
            out.append(Work(item, range(self.generation.n)))
        if self.schedule.order != "input":  # group shared prefixes / long rows first within the batch
            runnable = [w for w in out if w.item.tokens is not None]
            ordered, plen = order_window(runnable, self.schedule.order, lambda w: w.item.tokens,
                                         samples=self.generation.n)
            for w, p in zip(ordered, plen):
                w.prefix = p
            out = [w for w in out if w.item.tokens is None] + ordered
        return out

    # ------------------------------------------------------------------ generation
    def generate_work(self, work: Iterable[Work]) -> List[Dict[str, Any]]:
        """Output rows (DESIGN.md columns, `row` = item.index) for every (item, sample), ordered
        by (item.index, sample). Per-row problems are error rows; an engine crash raises."""
        rows = (row for chunk in self.loop.rows(list(work)) for row in chunk)
        return sorted(rows, key=lambda r: (r["row"], r["sample"]))

    def __call__(self, batch: Batch) -> Batch:
        names, rows = _batch_rows(batch)
        out = self.generate_work(self._work(names, rows))
        src = np.array([r["row"] for r in out], dtype=np.int64)
        drop = {"row"}
        passthrough = [c for c in names if c not in {n for n, _ in OUTPUT_COLUMNS}] if self.keep_input_columns else []
        if isinstance(batch, pa.Table):
            table = pa.Table.from_pylist(out, schema=output_schema()).drop_columns(list(drop))
            for c in passthrough:
                table = table.append_column(batch.schema.field(c), batch.column(c).take(pa.array(src)))
            return table
        cols = _numpy_columns(out, [(n, t) for n, t in OUTPUT_COLUMNS if n not in drop])
        for c in passthrough:
            cols[c] = np.asarray(batch[c])[src]
        return cols


def _numpy_columns(rows: List[Dict[str, Any]], columns) -> Dict[str, np.ndarray]:
    cols = {}
    for name, t in columns:
        vals = [r[name] for r in rows]
        if pa.types.is_integer(t):
            cols[name] = np.array(vals, dtype=np.int64)
        elif pa.types.is_floating(t):
            cols[name] = np.array(vals, dtype=np.float64)
        else:  # strings (nullable) and lists: object arrays, one Python value per row
            arr = np.empty(len(vals), dtype=object)
            for i, v in enumerate(vals):
                arr[i] = np.array(v, dtype=np.int64) if isinstance(v, list) else v
            cols[name] = arr
    return cols


def params_to_json(params: Optional[SamplingParams]) -> Optional[str]:
    return None if params is None else json.dumps(dataclasses.asdict(params))


def params_from_json(text: Optional[str]) -> Optional[SamplingParams]:
    if text is None:
        return None
    fields = json.loads(text)
    fields["stop"] = tuple(fields.get("stop") or ())
    return SamplingParams(**fields)


class JobPredictor(MTPLXPredictor):
    """The Ray executor's actor: one engine per actor, fed rows the job's reader prepared.

    Input (pyarrow): `row`, `id`, `error`, `_mtplx_tokens`, `_mtplx_samples`, `_mtplx_prefix`,
    then the job's keep_columns. Output: tables of the shard schema (`output_schema(keep_types)`),
    one row per (row, sample), yielded as the rows finish, built by the same `engine_rows` the
    local executor runs.
    """

    def __init__(self, job, max_context: int):
        self.job = job
        super().__init__(job.model.path, job.speculative, job.generation, job.schedule)
        if self.engine.max_context != max_context:
            raise RuntimeError(f"the reader checked prompts against a context of {max_context} tokens, "
                               f"the engine has {self.engine.max_context}; report this as a bug")
        self.keep = list(job.output.keep_columns)

    def _load(self, *_):
        from .opening import load_engine

        return load_engine(self.job)

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        cols = {c: batch.column(c).to_pylist()
                for c in ("row", "id", "error", TOKENS_COL, SAMPLES_COL, PREFIX_COL, PARAMS_COL, SEED_COL)}
        work = []
        for i in range(batch.num_rows):
            item = Item(index=i, id=cols["id"][i], tokens=cols[TOKENS_COL][i], error=cols["error"][i])
            params = params_from_json(cols[PARAMS_COL][i])
            work.append(Work(item, cols[SAMPLES_COL][i], cols[PREFIX_COL][i], params, cols[SEED_COL][i]))
        rows = cols["row"]
        for out in self.loop.rows(work):
            pos = pa.array([r["row"] for r in out], type=pa.int64())
            for r in out:
                r["row"] = rows[r["row"]]  # batch position -> the input row index
            table = pa.Table.from_pylist(out, schema=output_schema())
            for c in self.keep:
                table = table.append_column(batch.schema.field(c), batch.column(c).take(pos))
            yield table
