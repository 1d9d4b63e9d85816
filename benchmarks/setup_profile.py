"""Where a fresh process's engine setup goes (cProfile of `Engine(...)` for a job, after its model loads):
the calls over 1% of it, by cumulative seconds.

    python -m benchmarks.setup_profile jobs/eval-mtp.yaml [--set key=value ...] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from mtplx.generation import Engine
    from mtplx.models.loading import load
    from pipelines.job.config import load_job

    job = load_job(args.job, args.overrides)
    t = time.perf_counter()
    bundle = load(job.model.path, trust_remote_code=job.model.trust_remote_code, gguf_mode=job.model.gguf_mode)
    print(f"load {time.perf_counter() - t:.2f} s", flush=True)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    Engine(bundle, job.speculative, job.schedule)
    prof.disable()
    print(f"engine setup {time.perf_counter() - t:.2f} s ({job.speculative.method})", flush=True)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    print("\n".join(line[:200] for line in out.getvalue().splitlines() if line.strip()), flush=True)


if __name__ == "__main__":
    main()
