"""Whole jobs as a user runs them: a fresh `mtplx-batch run` process per run, the example jobs against
each other, and against mlx-lm's `batch_generate` in a fresh process on the same rows.

Settings (`--jobs`, comma-separated `JOB[:key=value...]`): by default jobs/eval.yaml (prompt
lookup), jobs/eval-mtp.yaml (the MTP head) and jobs/eval-mtp.yaml with method none (plain
decoding), on the same HumanEval rows, each as written (`--rows` sets `input.limit` where a
setting does not; `--tokens`, given on the command line, sets `generation.max_tokens`).

The peer, once for each distinct set of rows: a fresh process that binds the same BLAS, imports
mlx-lm, loads the same converted model directory and runs `batch_generate` over the prompt
tokens our run renders, with the job's width as its completion batch size (greedy, or mlx-lm's
sampler with the job's temperature, top-p and top-k). Every setting and peer runs once untimed
(the page cache, MLX's kernel caches on disk), then `--repeats` rounds in rotating order.
Columns: `wall s` the whole process (median), `run s` the run's own summary, `tok/s` tokens over
the wall, `x plain` the median per-round wall ratio to the setting with method none of the same job
and other overrides than `speculative.*` ones (e.g. `schedule.max_batch=1`; else the first setting
with method none),
`x mlx-lm` the median per-round tok/s ratio to the peer's process (mlx-lm has no stop strings,
so where a job has some the two sides generate different tokens: `x mlx-lm (wall)` is given
only where the token counts are equal; `generation.stop=[]` in a setting makes them equal),
`tokens/verify` from the output rows.

    python -m benchmarks.run --suite gpu --parts jobs
    python -m benchmarks.run --suite cpu --parts jobs --rows 2 --tokens 16
    python -m benchmarks.run --suite cpu --parts jobs --rows 4 --jobs \
        jobs/heldout-chat.yaml:schedule.max_batch=1,jobs/heldout-chat.yaml:schedule.max_batch=1:speculative.method=none
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from .common import ROOT, Report, cli_run, interleaved, median, median_ratio, spread

# The peer binds the same BLAS as we do (mtplx/blas.py, on a Linux CPU), then uses mlx-lm as its users do.
PEER = """
import json, sys, time
t0 = time.perf_counter()
from mtplx.blas import use_openblas
use_openblas()
import mlx_lm
from mlx_lm.sample_utils import make_sampler
spec = json.load(open(sys.argv[1]))
model, tokenizer = mlx_lm.load(spec["model"])
sampler = (make_sampler(temp=spec["temperature"], top_p=spec["top_p"] or 0.0, top_k=spec["top_k"] or 0)
           if spec["temperature"] > 0 else None)
t1 = time.perf_counter()
r = mlx_lm.batch_generate(model, tokenizer, spec["prompts"], max_tokens=spec["max_tokens"], sampler=sampler,
                          return_token_ids=True, completion_batch_size=spec["width"],
                          prefill_batch_size=min(8, spec["width"]))
t2 = time.perf_counter()
print("PEER", json.dumps({"start s": t1 - t0, "generate s": t2 - t1, "tokens": sum(map(len, r.token_ids))}))
"""


def settings(opts):
    """(label, job file, overrides) for every entry of `--jobs`."""
    out = []
    for entry in opts.jobs.split(","):
        job, *sets = entry.split(":")
        overrides = list(sets)
        if opts.rows and not any(s.startswith("input.limit=") for s in sets):
            overrides.append(f"input.limit={opts.rows}")
        if "tokens" in opts.explicit:
            overrides.append(f"generation.max_tokens={opts.tokens}")
        out.append((Path(job).stem + "".join(f" {s}" for s in sets), job, overrides))
    return out


def peer_input(job_file: str, overrides) -> dict:
    """What the peer runs: our run's rows as prompt tokens (rendered as the run renders them), its
    model directory, max_tokens, width and sampling."""
    from mtplx.models.loading import resolve_model_path
    from pipelines.execution.opening import load_tokenizer
    from pipelines.io.job_input import open_job
    from pipelines.io.rows import prepare
    from pipelines.job.config import load_job

    job = load_job(job_file, overrides)
    opened = open_job(job, load_tokenizer(job))
    items = prepare(opened.source.rows(), opened.renderer, job.input.id_column, [], None, None, job.input.limit)
    gen, width = job.generation, job.schedule.max_batch
    return {"model": str(resolve_model_path(job.model.path, job.model.gguf_mode)),
            "prompts": [it.tokens for it in items if it.tokens for _ in range(gen.n)],
            "max_tokens": gen.max_tokens, "width": int(width) if str(width) != "auto" else 32,
            "temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
            "method": job.speculative.method}


def tokens_per_verify(run_dir: Path):
    """(accepted + verifies) / verifies over the run's committed rows; '' when nothing was verified."""
    from pipelines.io.records import read_manifest

    accepted = verifies = 0
    for shard in read_manifest(str(run_dir))["shards"]:
        t = pq.read_table(run_dir / shard["file"], columns=["accepted_tokens", "verify_calls"]).to_pydict()
        accepted += sum(v or 0 for v in t["accepted_tokens"])
        verifies += sum(v or 0 for v in t["verify_calls"])
    return (accepted + verifies) / verifies if verifies else ""


def ours(job: str, overrides, run_dir: Path):
    def once() -> dict:
        r = cli_run(job, overrides, run_dir)
        tokens = r["summary"]["completion_tokens"]
        return {"wall s": r["wall s"], "run s": r["summary"]["seconds"], "tokens": tokens,
                "tok/s": tokens / r["wall s"], "rows": r["summary"]["outputs"], "tokens/verify": tokens_per_verify(run_dir)}
    return once


def peer(spec_file: Path):
    def once() -> dict:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", PEER, str(spec_file)], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"the mlx-lm peer exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        r = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("PEER"))[5:])
        return {"wall s": wall, "run s": r["generate s"], "tokens": r["tokens"], "tok/s": r["tokens"] / wall}
    return once


def same_job(job: str, overrides) -> tuple:
    """What a setting runs apart from its speculative settings: its `x plain` is the method-none
    setting's of the same job and other overrides (else the first method-none setting's)."""
    return job, tuple(sorted(s for s in overrides if not s.startswith("speculative.")))


def run(opts, report: Report):
    work = Path(tempfile.mkdtemp(prefix="jobs-bench-"))
    runs, peer_of, peers, plain, plain_of = {}, {}, {}, None, {}
    for i, (label, job, overrides) in enumerate(settings(opts)):
        spec = peer_input(job, overrides)
        key = json.dumps({k: v for k, v in spec.items() if k != "method"})
        if key not in peers and opts.peers:
            peers[key] = f"mlx-lm batch_generate ({label})" if peers else "mlx-lm batch_generate"
            spec_file = work / f"peer{len(peers)}.json"
            spec_file.write_text(key)
            runs[peers[key]] = peer(spec_file)
        peer_of[label] = peers.get(key)
        if spec["method"] == "none":
            plain = plain or label
            plain_of.setdefault(same_job(job, overrides), label)
        runs[label] = ours(job, overrides, work / f"run{i}")
        report.say(f"{label}: {len(spec['prompts'])} rows, max_tokens {spec['max_tokens']}, width {spec['width']}")
    plain_of = {label: plain_of.get(same_job(job, overrides), plain) for label, job, overrides in settings(opts)}
    for label, once in runs.items():  # untimed: the page cache and MLX's kernel caches on disk
        report.say(f"{label}: untimed first run {once()['wall s']:.2f} s")
    done = interleaved(runs, opts.repeats, report.say)
    for label, rs in done.items():
        cells = {"setting": label, "rows": rs[0].get("rows", ""), "tokens": rs[0]["tokens"],
                 "wall s": median([r["wall s"] for r in rs]), "spread": spread([r["wall s"] for r in rs]),
                 "run s": median([r["run s"] for r in rs]), "tok/s": median([r["tok/s"] for r in rs])}
        if label in peer_of:
            if plain_of[label] is not None:
                cells["x plain"] = median([p["wall s"] / r["wall s"] for r, p in zip(rs, done[plain_of[label]])])
            if peer_of[label] is not None:
                peer_runs = done[peer_of[label]]
                cells["x mlx-lm"] = median_ratio(rs, peer_runs)
                if rs[0]["tokens"] == peer_runs[0]["tokens"]:
                    cells["x mlx-lm (wall)"] = median([p["wall s"] / r["wall s"] for r, p in zip(rs, peer_runs)])
            cells["tokens/verify"] = rs[0]["tokens/verify"]
        report.row(f"jobs in fresh processes, median of {opts.repeats}", **cells)
