"""A whole job through the pipeline vs `mlx_lm.batch_generate` on the same rows and model.

    python -m benchmarks.jobs_vs_peer jobs/mmlu.yaml --set speculative.method=none --out bench-out

Both get the same rendered prompt tokens (the job's own template / chat template), the same
max_tokens and the same width (rows in flight: the job's `schedule.max_batch`, which is
batch_generate's completion batch size), and each runs once untimed first (compiled programs and kernels exist before timing;
our cached shared prefixes are dropped after it). Stop strings are dropped so both stop only at
EOS or max_tokens. Reports end-to-end tokens/s of each and their ratio (sampled rows end at
different lengths on the two sides, so the token counts may differ: the wall-time ratio is shown
only when they are equal), and the prompt tokens the engine actually prefilled (shared prefixes
are prefilled once) against the prompt tokens in the rows.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mlx_lm.sample_utils import make_sampler

from mtplx.prefill import PrefixStore
from pipelines.job.config import load_job
from pipelines.io.rows import prepare
from pipelines.execution.opening import load_engine, open_job
from pipelines.execution.session import run_job

from .common import device_name, save_json, speed_ratio, sync, table, versions
from .real_models import mlx_batch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    job = load_job(args.job, args.overrides + ["generation.stop=[]"])
    engine = load_engine(job)
    prep = open_job(job, engine.tokenizer)
    items = [it for it in prepare(prep.source.rows(), prep.renderer, job.input.id_column, [], engine.max_context,
                                  None, job.input.limit) if it.tokens]
    gen = job.generation
    prompts = [it.tokens for it in items for _ in range(gen.n)]  # n samples per row: n rows for the peer
    max_tokens = gen.max_tokens
    sampler = make_sampler(temp=gen.temperature, top_p=gen.top_p or 0.0, top_k=gen.top_k or 0) if gen.temperature > 0 else None
    rows = []
    for rep in range(args.repeats):
        peer_run = mlx_batch(engine, prompts, max_tokens, width=engine.max_batch, sampler=sampler)
        peer_tokens, peer_s = peer_run["tokens"], peer_run["seconds"]
        with tempfile.TemporaryDirectory() as tmp:
            if rep == 0:  # warm-up, untimed, as mlx_batch does for the peer
                job.output.dir = str(Path(tmp) / "warm")
                run_job(job, restart=True, engine=engine)
            engine.prefiller.store = PrefixStore()  # each timed run prefills its shared prefixes again
            before = dict(engine.counters)
            job.output.dir = str(Path(tmp) / "run")
            sync()
            t0 = time.perf_counter()
            summary = run_job(job, restart=True, engine=engine)
            ours_s = time.perf_counter() - t0
        prefilled = engine.counters["prefill_tokens"] - before["prefill_tokens"]
        cached = engine.counters["cached_prompt_tokens"] - before["cached_prompt_tokens"]
        rows.append({
            "job": Path(args.job).stem, "method": job.speculative.method, "rows": len(prompts),
            "width": engine.max_batch,
            "prompt tokens": sum(map(len, prompts)), "prefilled by us": prefilled, "copied from shared prefix": cached,
            **speed_ratio(summary.completion_tokens, ours_s, peer_tokens, peer_s, "mlx-lm"),
            "mlx-lm s": peer_s, "ours s": ours_s,
        })
        print(table(rows), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"jobs_vs_peer-{Path(args.job).stem}-{job.speculative.method}-w{engine.max_batch}"
    save_json(out / f"{name}.json", {"device": device_name(), "versions": versions(), "overrides": args.overrides, "rows": rows})
    (out / f"{name}.md").write_text(f"device: {device_name()}\n\n" + table(rows))


if __name__ == "__main__":
    main()
