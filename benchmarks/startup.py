"""Startup: from a fresh process to the first generated token, ours against mlx-lm's, same model.

    ours     `python -m pipelines.cli run JOB --log-json` on a one-row job (max_tokens 1); its
             `startup` line gives the phases (import, config, tokenizer, weights, engine,
             first_token) and the outside wall clock the whole process
    mlx-lm   a fresh process: the same BLAS, `import mlx_lm`, `mlx_lm.load(dir)`, the same
             chat-templated prompt through `stream_generate` to its first token

Both load the same converted model directory and take the same prompt, alternating run by run;
medians and the ratio of the medians are printed as the table. The prompt is short by default so
that the prefill (compute, which is the same on both sides) does not hide the fixed costs:
`--prompt` changes it.

    python -m benchmarks.startup --model smollm2-135m-instruct --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("import", "config", "tokenizer", "weights", "engine", "first_token", "total")

# The peer binds the same BLAS as we do (mtplx/blas.py, on a Linux CPU), then imports mlx-lm as usual.
PEER = """
import time, sys
t0 = time.perf_counter()
from mtplx.blas import use_openblas
use_openblas()
import mlx_lm
mlx_lm.load  # mlx-lm's whole package, as a plain `import mlx_lm` loads it
t1 = time.perf_counter()
model, tok = mlx_lm.load(sys.argv[1])
t2 = time.perf_counter()
ids = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True)
for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=1):
    pass
t3 = time.perf_counter()
print("PEER", t1 - t0, t2 - t1, t3 - t2, "transformers" in sys.modules)
"""


def _run(cmd, env=None):
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return wall, out


def ours(job_file: Path, run_dir: Path):
    wall, out = _run([sys.executable, "-m", "pipelines.cli", "run", str(job_file), "--log-json", "--restart",
                      "--set", f"output.dir={run_dir}"])
    events = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    phases = next(e for e in events if e["event"] == "startup")
    return wall, {k: phases[k] for k in PHASES}


def peer(model_dir: str, prompt: str):
    wall, out = _run([sys.executable, "-c", PEER, model_dir, prompt])
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PEER"))
    imp, load, first, torn = line.split()[1:]
    return wall, {"import": float(imp), "load": float(load), "first_token": float(first),
                  "transformers": torn == "True"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model path or known name")
    ap.add_argument("--prompt", default="Write a Python function that adds two numbers.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="a directory for startup.md / startup.json")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from mtplx.models.loading import resolve_model_path

    model_dir = str(resolve_model_path(args.model))  # converts a GGUF once, before any timing
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    data = work / "in.jsonl"
    data.write_text(json.dumps({"id": "r0", "prompt": args.prompt}) + "\n")
    job = {"name": "startup", "model": {"path": model_dir},
           "speculative": {"method": "none"},
           "input": {"format": "jsonl", "path": str(data), "id_column": "id", "prompt_column": "prompt",
                     "chat_template": "auto"},
           "generation": {"max_tokens": 1, "temperature": 0.0},
           "schedule": {"max_batch": 1}, "output": {"dir": str(work / "run")}}
    job_file = work / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))

    ours_runs, peer_runs = [], []
    for i in range(args.repeats + 1):  # the first pair warms the page cache, untimed
        o, p = ours(job_file, work / "run"), peer(model_dir, args.prompt)
        if i:
            ours_runs.append(o)
            peer_runs.append(p)
            print(f"run {i}: ours {o[0]:.2f}s (first token at {o[1]['total']:.2f}s) | "
                  f"mlx-lm {p[0]:.2f}s (first token at {sum(p[1][k] for k in ('import', 'load', 'first_token')):.2f}s)",
                  flush=True)

    med = lambda xs: statistics.median(xs)  # noqa: E731
    our_phases = {k: med([r[1][k] for r in ours_runs]) for k in PHASES}
    peer_phases = {k: med([r[1][k] for r in peer_runs]) for k in ("import", "load", "first_token")}
    our_wall, peer_wall = med([r[0] for r in ours_runs]), med([r[0] for r in peer_runs])
    peer_first = med([sum(r[1][k] for k in ("import", "load", "first_token")) for r in peer_runs])
    rows = [
        ("import", our_phases["import"], peer_phases["import"]),
        ("load (config + tokenizer + weights)", our_phases["config"] + our_phases["tokenizer"] + our_phases["weights"],
         peer_phases["load"]),
        ("engine setup", our_phases["engine"], None),
        ("first prefill to its first token", our_phases["first_token"], peer_phases["first_token"]),
        ("process start to first token", our_phases["total"], peer_first),
        ("whole process (outside clock)", our_wall, peer_wall),
    ]
    lines = ["| phase | ours s | mlx-lm s | ours / mlx-lm |", "|---|---|---|---|"]
    for name, a, b in rows:
        lines.append(f"| {name} | {a:.3f} | {'' if b is None else f'{b:.3f}'} | "
                     f"{'' if not b else f'{a / b:.2f}'} |")
    detail = " ".join(f"{k}={v:.3f}" for k, v in our_phases.items())
    lines.append("")
    lines.append(f"our phases (median of {args.repeats}): {detail}; mlx-lm imported transformers: "
                 f"{any(r[1]['transformers'] for r in peer_runs)}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "startup.md").write_text(text + "\n")
        Path(args.out, "startup.json").write_text(json.dumps(
            {"ours": our_phases, "ours_wall": our_wall, "mlx_lm": peer_phases, "mlx_lm_wall": peer_wall,
             "mlx_lm_first_token": peer_first, "model": model_dir, "prompt": args.prompt}, indent=1))


if __name__ == "__main__":
    main()
