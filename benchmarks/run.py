"""The benchmark suite: named parts, each against a peer in the same run, printing rows as it goes.

    python -m benchmarks.run --suite cpu --out bench-cpu                    # this machine's CPU
    python -m benchmarks.run --suite gpu --out bench-gpu                    # an MLX CUDA / Metal GPU
    python -m benchmarks.run --suite gpu --parts decode,jobs --out bench-gpu

Parts (each module's docstring says how it measures):
  decode       plain decoding on random-weight Qwen3 shapes, 1 and 32 streams, vs generate_step /
               batch_generate, and the batch-1 roofline of the device present
  speculative  SmolLM2 + its MTP head: none / ngram / mtp at widths 1, 8, 32, warm, vs mlx-lm
  jobs         whole `mtplx-batch run` jobs in fresh processes: the example jobs against each other
               and against batch_generate in a fresh process
  startup      a fresh process to its first token, ours vs mlx-lm
  round_cost   one forward of K tokens a row against one of 1 token: is a verify nearly free?
  draft_pair   Qwen2.5-Coder 1.5B + its 0.5B draft: method draft vs speculative_generate_step
  ray          rows/s through the Ray executor with 2 actors vs the local executor
  manifest     bytes written per shard commit at the start and the end of 10,000 commits, and the resume

Each part writes OUT/PART.md and OUT/PART.json as its rows come in; several parts run one
after another, each in a fresh process (an engine installs its decode paths into the model it
runs, and a part that fails costs only itself), then OUT/SUMMARY.md collects them. The options
below apply to the parts that use them; where not given, the suite's defaults apply (SUITES).

On a Linux CPU, `import benchmarks` binds MLX to OpenBLAS first (mtplx.process.prepare_process, the
`cpu` extra's wheel) for us and for mlx-lm alike: MLX's bundled BLAS is ~15x slower.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import traceback
from pathlib import Path

PARTS = {"decode": "decode", "speculative": "speculative", "jobs": "jobs", "startup": "startup",
         "round_cost": "round_cost", "draft_pair": "draft_pair", "ray": "ray_rows",
         "manifest": "manifest"}

COMMON = dict(model="smollm2-135m-instruct", head="heads/smollm2-135m-instruct", methods="none,ngram,mtp", depth=3,
              data="humaneval,gsm8k-100", target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
              jobs="jobs/eval.yaml,jobs/eval-mtp.yaml,jobs/eval-mtp.yaml:speculative.method=none",
              ray_job="jobs/eval.yaml", peers=1, streams=32, widths="1,8,32", waves=2, adaptive=1, shards=10_000)
SUITES = {
    "cpu": dict(COMMON, parts="decode,speculative,jobs,startup,round_cost,ray,manifest", shapes="tiny", tokens=32, rows=4,
                repeats=3, context=256),
    "gpu": dict(COMMON, parts="decode,speculative,jobs,startup,round_cost,draft_pair", shapes="0.6b,8b", tokens=128,
                rows=8, repeats=3, context=1024),
}
OPTIONS = {  # name: (type, help)
    "parts": (str, "comma-separated parts (default: the suite's)"),
    "shapes": (str, "decode, round_cost: random-weight Qwen3 shapes (0.6b, 8b, tiny)"),
    "tokens": (int, "new tokens a row; jobs and ray: generation.max_tokens when given here"),
    "rows": (int, "speculative, draft_pair: rows at width 1 (width W: max(rows, waves x W)); jobs, ray: input.limit"),
    "widths": (str, "speculative, draft_pair: rows in flight"),
    "waves": (int, "speculative, draft_pair: a width W runs at least waves x W rows"),
    "streams": (int, "decode, round_cost: the batched width"),
    "repeats": (int, "timed runs of every setting, interleaved"),
    "model": (str, "speculative, round_cost, startup: the real model"),
    "head": (str, "speculative: the MTP head ('' for none)"),
    "methods": (str, "speculative: our methods"),
    "depth": (int, "speculative, draft_pair: drafted tokens per verify (adaptive depth lowers it)"),
    "adaptive": (int, "speculative, draft_pair: 1: adaptive depth, as a job runs it; 0: fixed at --depth"),
    "data": (str, "speculative, draft_pair: datasets (known names or JSONL files with a prompt field)"),
    "target": (str, "draft_pair: the target model"),
    "draft": (str, "draft_pair: the draft model"),
    "jobs": (str, "jobs: comma-separated JOB[:key=value...] settings"),
    "ray_job": (str, "ray: the job file"),
    "peers": (int, "jobs: 1: mlx-lm's batch_generate beside each set of rows; 0: ours only"),
    "context": (int, "round_cost: cached tokens before the forward"),
    "shards": (int, "manifest: shard commits"),
}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    ap.add_argument("--out", default="bench-out")
    for name, (kind, text) in OPTIONS.items():
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)
    opts = ap.parse_args(argv)
    opts.explicit = {name for name in OPTIONS if getattr(opts, name) is not None}
    for name, value in SUITES[opts.suite].items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    unknown = set(opts.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    return opts


def run_part(name: str, opts) -> None:
    from .common import Report

    report = Report(Path(opts.out), name)
    try:
        importlib.import_module(f"benchmarks.{PARTS[name]}").run(opts, report)
    except Exception:  # the rows measured so far stay in the report
        report.note("failed:\n```\n" + traceback.format_exc() + "```")
        raise


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(argv)
    parts = opts.parts.split(",")
    if len(parts) == 1:
        return run_part(parts[0], opts)
    failed = []
    for part in parts:  # each in a fresh process
        print(f"$ python -m benchmarks.run ... --parts {part}", flush=True)
        if subprocess.call([sys.executable, "-m", "benchmarks.run", *argv, "--parts", part]) != 0:
            failed.append(part)
    out = Path(opts.out)
    summary = "\n".join(f"## {p}\n\n{(out / f'{p}.md').read_text()}" for p in parts if (out / f"{p}.md").exists())
    (out / "SUMMARY.md").write_text(f"# python -m benchmarks.run {' '.join(argv)}\n\n{summary}")
    print(summary)
    if failed:
        sys.exit(f"failed parts: {', '.join(failed)}")


if __name__ == "__main__":
    main()
