"""The benchmark harness: each suite runs its benchmarks (peers in the same run) and collects tables.

    python -m benchmarks.run --suite cpu --out bench-out     # this machine's CPU
    python -m benchmarks.run --suite gpu --out bench-out     # an MLX CUDA / Metal GPU

Every benchmark writes `NAME.md` and `NAME.json` into --out; the harness prints the tables and
writes `bench-out/SUMMARY.md`, which is what BENCHMARKS.md quotes together with this command.
On a Linux CPU, `import benchmarks` binds MLX to OpenBLAS first (mtplx.process.prepare_process, the
`cpu` extra's wheel) for us and for mlx-lm alike: MLX's bundled BLAS is ~15x slower.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MODEL = "smollm2-135m-instruct"
CODE_PROMPTS = "benchmarks/data/head_train_prompts.jsonl"  # stdlib code prompts: not HumanEval

SUITES = {
    "cpu": [
        ["benchmarks.jobs_vs_peer", "jobs/eval.yaml", "--set", "speculative.method=none"],
        ["benchmarks.jobs_vs_peer", "jobs/eval.yaml", "--set", "speculative.method=ngram"],
        ["benchmarks.jobs_vs_peer", "jobs/mmlu.yaml", "--set", "speculative.method=none"],
        ["benchmarks.real_models", "--model", MODEL, "--prompts", CODE_PROMPTS, "--head", "heads/smollm2-135m-instruct",
         "--rows", "8", "--tokens", "64", "--widths", "8", "--depths", "1,2,3", "--compiled", "off"],
    ],
    "gpu": [  # benchmarks/gpu_session.sh runs these in steps that fit one device call each
        ["benchmarks.engine_efficiency", "--shapes", "0.6b,8b"],
        ["benchmarks.real_models", "--model", MODEL, "--prompts", CODE_PROMPTS, "--head", "heads/smollm2-135m-instruct",
         "--rows", "32", "--tokens", "128", "--widths", "1,8,32", "--depths", "1,2,3", "--repeats", "2"],
        ["benchmarks.torch_peer", "--model", MODEL, "--prompts", CODE_PROMPTS, "--widths", "1,32"],
        ["benchmarks.jobs_vs_peer", "jobs/mmlu.yaml", "--set", "speculative.method=none", "--set", "input.limit=256"],
        ["benchmarks.jobs_vs_peer", "jobs/eval-mtp.yaml", "--set", "input.limit=64"],
        ["benchmarks.phase_profile", "jobs/eval-mtp.yaml", "--set", "input.limit=16"],
    ],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["cpu", "gpu", "all"], default="cpu")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commands = SUITES["cpu"] + SUITES["gpu"] if args.suite == "all" else SUITES[args.suite]
    failed = []
    for cmd in commands:
        print("$ python -m " + " ".join(cmd), flush=True)
        if subprocess.call([sys.executable, "-m", *cmd, "--out", str(out)]) != 0:
            failed.append(" ".join(cmd))
    parts = [f"## {p.stem}\n\n{p.read_text()}" for p in sorted(out.glob("*.md")) if p.name != "SUMMARY.md"]
    (out / "SUMMARY.md").write_text(f"# python -m benchmarks.run --suite {args.suite}\n\n" + "\n".join(parts))
    print((out / "SUMMARY.md").read_text())
    if failed:
        sys.exit(f"failed: {failed}")


if __name__ == "__main__":
    main()
