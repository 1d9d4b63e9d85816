"""Startup: from a fresh process to the first generated token, ours against mlx-lm's, same model.

    ours     `python -m pipelines.cli run JOB --log-json` on a one-row job (max_tokens 1); its
             `startup` line gives the phases (import, config, tokenizer, weights, engine,
             first_token) and the outside wall clock the whole process
    mlx-lm   a fresh process: the same BLAS, `import mlx_lm`, `mlx_lm.load(dir)`, the same
             chat-templated prompt through `stream_generate` to its first token

Both load the same converted model directory and take the same short prompt (so that the prefill,
the same compute on both sides, does not hide the fixed costs), alternating run by run after one
untimed pair; the table has the medians and the ratio of the medians.

    python -m benchmarks.run --suite cpu --parts startup --repeats 3
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from .common import ROOT, Report, cli_run, median

PROMPT = "Write a Python function that adds two numbers."
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


def ours(job_file: Path, run_dir: Path):
    r = cli_run(str(job_file), [], run_dir)
    return r["wall s"], {k: r["startup"][k] for k in PHASES}


def peer(model_dir: str, prompt: str):
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PEER, model_dir, prompt], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(f"the mlx-lm peer exited {out.returncode}:\n{out.stderr[-3000:]}")
    imp, load, first, torn = next(ln for ln in out.stdout.splitlines() if ln.startswith("PEER")).split()[1:]
    return wall, {"import": float(imp), "load": float(load), "first_token": float(first), "transformers": torn == "True"}


def run(opts, report: Report):
    from mtplx.models.loading import resolve_model_path

    model_dir = str(resolve_model_path(opts.model))  # converts a GGUF once, before any timing
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    data = work / "in.jsonl"
    data.write_text(json.dumps({"id": "r0", "prompt": PROMPT}) + "\n")
    job = {"name": "startup", "model": {"path": model_dir},
           "speculative": {"method": "none"},
           "input": {"format": "jsonl", "path": str(data), "id_column": "id", "prompt_column": "prompt",
                     "chat_template": "auto"},
           "generation": {"max_tokens": 1, "temperature": 0.0},
           "schedule": {"max_batch": 1}, "output": {"dir": str(work / "run")}}
    job_file = work / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))

    ours_runs, peer_runs = [], []
    for i in range(opts.repeats + 1):  # the first pair warms the page cache, untimed
        o, p = ours(job_file, work / "run"), peer(model_dir, PROMPT)
        if i:
            ours_runs.append(o)
            peer_runs.append(p)
            report.say(f"run {i}: ours {o[0]:.2f} s (first token at {o[1]['total']:.2f} s) | mlx-lm {p[0]:.2f} s "
                       f"(first token at {sum(p[1][k] for k in ('import', 'load', 'first_token')):.2f} s)")

    our_phases = {k: median([r[1][k] for r in ours_runs]) for k in PHASES}
    peer_phases = {k: median([r[1][k] for r in peer_runs]) for k in ("import", "load", "first_token")}
    peer_first = median([sum(r[1][k] for k in ("import", "load", "first_token")) for r in peer_runs])
    rows = [
        ("import", our_phases["import"], peer_phases["import"]),
        ("load (config + tokenizer + weights)", our_phases["config"] + our_phases["tokenizer"] + our_phases["weights"],
         peer_phases["load"]),
        ("engine setup", our_phases["engine"], None),
        ("first prefill to its first token", our_phases["first_token"], peer_phases["first_token"]),
        ("process start to first token", our_phases["total"], peer_first),
        ("whole process (outside clock)", median([r[0] for r in ours_runs]), median([r[0] for r in peer_runs])),
    ]
    for phase, a, b in rows:
        report.row(f"startup, median of {opts.repeats}", phase=phase, **{"ours s": a, "mlx-lm s": "" if b is None else b,
                   "ours / mlx-lm": a / b if b else ""})
    report.note(f"mlx-lm imported transformers: {any(r[1]['transformers'] for r in peer_runs)}")
