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

The `mtplx-batch` Ray executor (pipelines/execution/ray_executor.py) runs `JobPredictor`, a subclass that
takes rows already prepared by the job's own reader (row index, id, tokens, per-row errors), so a
job gives the same rows on Ray as it does locally.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

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
        if engine is None:
            from mtplx import cuda_graphs

            cuda_graphs.apply_for(self.schedule.max_batch, self.speculative.method)  # before mlx.core loads
            from mtplx.generation import Engine

            engine = Engine.load(model_path, self.speculative, self.schedule, trust_remote_code=trust_remote_code,
                                 gguf_mode=gguf_mode)
        self.engine = engine
        self.params = self.generation.sampling_params()
        self._renderer: Optional[PromptRenderer] = None  # built on first text batch (may refuse the config)
        self.tokens_column = tokens_column
        self.id_column = id_column
        self.keep_input_columns = keep_input_columns

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
        rows = engine_rows(self.engine, work, self.params, self.generation.seed)
        return sorted((row for row, _ in rows), key=lambda r: (r["row"], r["sample"]))

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
    then the job's keep_columns. Output: the shard schema (`output_schema(keep_types)`), one row
    per (row, sample), built by the same `engine_rows` the local executor runs.
    """

    def __init__(self, job, max_context: int):
        from .opening import load_engine

        engine = load_engine(job)
        if engine.max_context != max_context:
            raise RuntimeError(f"the reader checked prompts against a context of {max_context} tokens, "
                               f"the engine has {engine.max_context}; report this as a bug")
        super().__init__(job.model.path, job.speculative, job.generation, job.schedule, engine=engine)
        self.keep = list(job.output.keep_columns)

    def __call__(self, batch: pa.Table) -> pa.Table:
        cols = {c: batch.column(c).to_pylist()
                for c in ("row", "id", "error", TOKENS_COL, SAMPLES_COL, PREFIX_COL, PARAMS_COL, SEED_COL)}
        work = []
        for i in range(batch.num_rows):
            item = Item(index=i, id=cols["id"][i], tokens=cols[TOKENS_COL][i], error=cols["error"][i])
            params = params_from_json(cols[PARAMS_COL][i])
            work.append(Work(item, cols[SAMPLES_COL][i], cols[PREFIX_COL][i], params, cols[SEED_COL][i]))
        out = self.generate_work(work)
        pos = pa.array([r["row"] for r in out], type=pa.int64())
        rows = cols["row"]
        for r in out:
            r["row"] = rows[r["row"]]  # batch position -> the input row index
        table = pa.Table.from_pylist(out, schema=output_schema())
        for c in self.keep:
            table = table.append_column(batch.schema.field(c), batch.column(c).take(pos))
        return table
