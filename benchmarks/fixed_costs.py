"""A job's fixed costs: everything but the model's arithmetic, phase by phase.

    python -m benchmarks.fixed_costs jobs/mmlu.yaml --set speculative.method=none --set input.limit=256

On a GPU a 135M model's forwards are milliseconds, so a few-shot job's wall time is what the
pipeline and the engine do around them: reading, rendering and tokenizing the rows, ordering them,
copying the shared prefix into every row, admission, Parquet shards, fsyncs, the manifest. On a CPU
the forwards hide all of that, so by default the job runs on a *thin* copy of its model: the same
tokenizer, layer count, KV heads, head size and vocabulary (so every cache write and copy moves
the same bytes and every row the same tokens), random weights, a hidden size of one attention row
and attention itself replaced by a pass-through of the queries (MLX's CPU attention with a mask
costs seconds per batch here; the cache writes it reads still happen and are evaluated), so its
forwards cost little and the rest shows. `--real` keeps the real weights and attention (use it on
a GPU).

The job runs once untimed (kernels, compiled programs), then once timed with the phases below;
each phase is wall time inside the named calls (the engine's phases end with a device sync).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map

from mtplx.models.loading import ModelBundle
from mtplx.prefill import PrefixStore
from pipelines.execution import session as session_mod
from pipelines.execution import ordering, work as work_mod
from pipelines.execution.opening import load_engine
from pipelines.io import checkpoint, sink
from pipelines.job.config import load_job

from .common import device_name, save_json, sync, table

TIMES = defaultdict(float)
CALLS = defaultdict(int)


def thin_bundle(bundle: ModelBundle) -> ModelBundle:
    """The model's cache layout and vocabulary with almost no arithmetic (random weights)."""
    import importlib

    cfg = dict(bundle.config)
    heads, head_dim = cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim, intermediate_size=64)
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    if hasattr(arch, "scaled_dot_product_attention"):  # this process only: the queries pass through
        arch.scaled_dot_product_attention = lambda queries, keys, values, *a, **k: queries
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    model.update(tree_map(lambda p: (p * 0.02).astype(dtype) if p.ndim > 1 else p.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return ModelBundle(model=model, tokenizer=bundle.tokenizer, config=cfg, path=Path("thin"))


def timed(owner, name: str, label: str, device: bool = False, generator: bool = False):
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        if device:
            sync()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if device:
            sync()
        TIMES[label] += time.perf_counter() - t0
        CALLS[label] += 1
        return out

    def gen(*args, **kwargs):  # time spent inside the generator's own steps only
        it = inner(*args, **kwargs)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                TIMES[label] += time.perf_counter() - t0
                return
            TIMES[label] += time.perf_counter() - t0
            CALLS[label] += 1
            yield item

    setattr(owner, name, gen if generator else call)


def instrument(engine):
    timed(work_mod, "prepare", "read, render, tokenize (rows.prepare)", generator=True)
    timed(ordering, "order_window", "order, prefix groups")
    timed(sink.ShardWriter, "_commit", "shards: Parquet, fsync, manifest")
    timed(checkpoint.RunDir, "prepare", "run dir: open / create")
    timed(session_mod, "fingerprint_parts", "fingerprint")
    timed(os, "fsync", "(of which fsync)")
    prefiller = engine.prefiller
    timed(prefiller, "run", "engine: prefill incl. prefix copies", device=True)
    timed(prefiller, "_hidden", "(of which forward graphs built)")
    timed(engine, "_plain_rounds", "engine: decode rounds", device=True, generator=True)


def same_tokens(job, tokenizer) -> bool:
    """The job's prompts tokenized together (a shared prefix once) against each encoded whole."""
    from pipelines.io.job_input import open_job

    prep = open_job(job, tokenizer)
    rows = [r.data for r in prep.source.rows() if r.error is None][: job.input.limit]
    together = prep.renderer.tokens_many(rows)
    alone = [tokenizer.encode(t, add_special_tokens=True) for t in map(prep.renderer._prompt, rows)]
    return together == alone


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--real", action="store_true", help="the real weights (the forwards then count too)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    job = load_job(args.job, args.overrides + ["generation.stop=[]"])
    engine = load_engine(job)
    if not args.real:
        from mtplx.generation import Engine

        engine = Engine(thin_bundle(engine.bundle), job.speculative, job.schedule)
    same = same_tokens(job, engine.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        job.output.dir = str(Path(tmp) / "warm")
        session_mod.run_job(job, restart=True, engine=engine)
        engine.prefiller.store = PrefixStore()
        instrument(engine)
        before = dict(engine.counters)
        job.output.dir = str(Path(tmp) / "run")
        sync()
        t0 = time.perf_counter()
        summary = session_mod.run_job(job, restart=True, engine=engine)
        total = time.perf_counter() - t0
    rows = [{"phase": k, "seconds": round(v, 4), "share": round(v / total, 3), "calls": CALLS[k]}
            for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1])]
    top = sum(v for k, v in TIMES.items() if not k.startswith("("))
    rows.append({"phase": "rest (session, progress, engine admission outside prefill)", "seconds": round(total - top, 4),
                 "share": round((total - top) / total, 3), "calls": ""})
    rows.append({"phase": "whole job", "seconds": round(total, 4), "share": 1.0, "calls": ""})
    counts = {k: engine.counters[k] - before[k] for k in ("prefill_tokens", "cached_prompt_tokens")}
    head = (f"device: {device_name()}; {args.job} {' '.join(args.overrides)}; "
            f"{'real' if args.real else 'thin'} model; {summary.outputs} rows, {summary.shards} shards; "
            f"prefilled {counts['prefill_tokens']}, copied {counts['cached_prompt_tokens']} prompt tokens; "
            f"prompt tokens identical to encoding each prompt whole: {same}")
    md = head + "\n\n" + table(rows)
    print(md, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"fixed_costs-{Path(args.job).stem}{'-real' if args.real else ''}{'-' + args.tag if args.tag else ''}"
    save_json(out / f"{name}.json", {"device": device_name(), "overrides": args.overrides, "rows": rows,
                                     "same_tokens": same, **counts})
    (out / f"{name}.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
