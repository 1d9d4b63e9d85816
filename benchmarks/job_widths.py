"""A whole job at several widths against `mlx_lm.batch_generate` at the same width, one process.

    python -m benchmarks.job_widths jobs/eval.yaml --set input.path=mmlu-1k --widths 32,64,128,256 \
        --rows-per-width 2 --tokens 64 --methods none,ngram --out bench-out

For each width W (rows in flight: our `schedule.max_batch`, batch_generate's completion batch
size) the first `rows-per-width x W` rows of the job run through the whole pipeline (read,
render, tokenize, order, generate, write Parquet) once per method, and batch_generate generates
the same rendered rows (it gets the token ids for free). The model loads once; a short run of
both sides first builds the kernels (a cold GPU host pays them inside the first timed step
otherwise), and before each width every side runs W of its rows untimed once (W rows fill one
batch: the shapes of that width exist before timing). Stop strings are dropped so both stop only
at EOS or max_tokens; cached shared prefixes are dropped before each timed run. A table row is
printed after every width, so a run cut short keeps what it finished; `--budget` seconds (from
the start) stops before a width that would begin past it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from mtplx.kernels import layer_kernels
from mtplx.kernels.fusion import fuse_projections, stacking_pays, unstack
from mtplx.generation import Engine
from mtplx.prefill import PrefixStore
from pipelines.execution.opening import load_engine
from pipelines.io.job_input import open_job
from pipelines.execution.session import run_job
from pipelines.io.rows import prepare
from pipelines.job.config import load_job

from .common import device_name, save_json, sync, table, versions


def peer(bundle, prompts, tokens, width):
    """batch_generate over `prompts` at `width` rows in flight: (tokens, seconds)."""
    from mlx_lm import batch_generate

    unstack(bundle.model)  # the peer runs the model as loaded (our engine may stack projections on CUDA)
    layer_kernels.uninstall(bundle.model)  # ... and patch its layers (layer_kernels)
    sync()
    t0 = time.perf_counter()
    r = batch_generate(bundle.model, bundle.tokenizer, prompts, max_tokens=tokens, return_token_ids=True,
                       completion_batch_size=width, prefill_batch_size=min(8, width))
    dt = time.perf_counter() - t0
    return sum(len(t) for t in r.token_ids), dt


def ours(job, engine, rows, width):
    """The whole job over its first `rows` rows at `width`: (completion tokens, seconds)."""
    if engine.spec.compiled_verify != "off" and stacking_pays():
        fuse_projections(engine.model)  # as kernels.install set it up (the peer unstacks)
    layer_kernels.install(engine.model)  # likewise (the peer uninstalls)
    engine.max_batch = width
    job.schedule.max_batch = width
    job.input.limit = rows
    engine.prefiller.store = PrefixStore()  # every run prefills its shared prefixes itself
    with tempfile.TemporaryDirectory() as tmp:
        job.output.dir = str(Path(tmp) / "run")
        sync()
        t0 = time.perf_counter()
        summary = run_job(job, restart=True, engine=engine)
        dt = time.perf_counter() - t0
    return summary.completion_tokens, dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--widths", default="32,64,128,256")
    ap.add_argument("--rows-per-width", type=float, default=2.0, help="rows per width: the batch refills this often")
    ap.add_argument("--tokens", type=int, default=64, help="generation.max_tokens")
    ap.add_argument("--methods", default="none,ngram", help="speculative.method of our runs (none, ngram)")
    ap.add_argument("--budget", type=float, default=0, help="seconds from the start after which no new width starts (0: no limit)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    start = time.perf_counter()
    widths = [int(w) for w in args.widths.split(",") if w]
    methods = [m for m in args.methods.split(",") if m]
    most = max(int(args.rows_per_width * w) for w in widths)
    job = load_job(args.job, args.overrides + ["generation.stop=[]", "output.keep_columns=[]",
                                              f"generation.max_tokens={args.tokens}", f"input.limit={most}"])
    base = load_engine(job)
    engines = {}
    for m in methods:  # one engine per method over the one loaded model
        same = m == job.speculative.method
        engines[m] = base if same else Engine(base.bundle, replace(job.speculative, method=m), job.schedule)
    prep = open_job(job, base.tokenizer)
    items = [it for it in prepare(prep.source.rows(), prep.renderer, job.input.id_column, [], base.max_context,
                                  None, most) if it.tokens]
    prompts = [it.tokens for it in items]
    print(f"loaded in {time.perf_counter() - start:.1f} s; {len(prompts)} rows, "
          f"{sum(map(len, prompts)) / max(1, len(prompts)):.0f} prompt tokens on average", flush=True)
    t0 = time.perf_counter()  # the host's warm-up: kernels for a small batch on both sides
    peer(base.bundle, prompts[:8], 8, 8)
    for m, eng in engines.items():
        ours(job, eng, 8, 8)
    print(f"warm-up (kernel builds) {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for w in widths:
        if args.budget and time.perf_counter() - start > args.budget:
            print(f"width {w}: not started, past --budget {args.budget:.0f} s", flush=True)
            break
        n = int(args.rows_per_width * w)
        if n > len(prompts):
            print(f"width {w}: only {len(prompts)} rows (wanted {n}): the batch may not fill", flush=True)
            n = len(prompts)
        t_w = time.perf_counter()
        peer(base.bundle, prompts[:w], args.tokens, w)  # untimed: this width's shapes
        peer_tokens, peer_s = peer(base.bundle, prompts[:n], args.tokens, w)
        row = {"width": w, "rows": n, "mlx-lm tok/s": peer_tokens / peer_s}
        for m, eng in engines.items():
            ours(job, eng, min(w, n), w)
            toks, s = ours(job, eng, n, w)
            row[f"ours {m} tok/s"] = toks / s
            row[f"{m} / mlx-lm"] = (toks / s) / (peer_tokens / peer_s)
            row[f"{m} tokens"] = toks
        row["mlx-lm tokens"] = peer_tokens
        row["seconds (width, all sides)"] = time.perf_counter() - t_w
        rows.append(row)
        print(table(rows), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"device": device_name(), "versions": versions(), "job": args.job, "overrides": args.overrides,
               "tokens": args.tokens, "rows": rows, "seconds": time.perf_counter() - start}
    save_json(out / "job_widths.json", payload)
    (out / "job_widths.md").write_text(f"device: {device_name()}; {args.job} {' '.join(args.overrides)}; "
                                       f"{args.tokens} tokens\n\n" + table(rows))
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
