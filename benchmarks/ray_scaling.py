"""Data-parallel scaling through the Ray executor: the same job on 1 GPU and on 2 GPUs.

    python -m benchmarks.ray_scaling --model models/smollm2 --prompts humaneval.jsonl --out bench-out

Runs `mtplx-batch run` (executor ray, one engine per GPU, `num_gpus: 1` per actor so Ray gives
each its own CUDA_VISIBLE_DEVICES) with concurrency 1 and 2, and reports rows/s and tokens/s
(over the whole run, and between the first and last shard commit, which leaves out start-up),
the scaling ratio, whether the 2-GPU texts equal the 1-GPU texts, and a kill-and-resume of the
2-GPU run that must end with every row exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from .common import save_json, table


def write_job(path: Path, model: str, prompts: str, out_dir: Path, gpus: int, rows: int, tokens: int, method: str):
    job = {
        "name": f"scaling-{gpus}gpu",
        "model": {"path": model},
        "speculative": {"method": method, "depth": 3, "compiled_verify": "on"},
        "input": {"format": "jsonl", "path": prompts, "id_column": "id", "prompt_column": "prompt", "limit": rows},
        "generation": {"max_tokens": tokens, "temperature": 0.0},
        "schedule": {"order": "prefix", "max_batch": 32},
        "output": {"dir": str(out_dir), "shard_rows": 16},
        "executor": {"type": "ray", "concurrency": gpus, "num_gpus": 1},
    }
    path.write_text(yaml.safe_dump(job, sort_keys=False))


def run_cli(job: Path, kill_after: float = None) -> float:
    cmd = [sys.executable, "-m", "pipelines.cli", "run", str(job), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return time.perf_counter() - t0
    rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"{job}: mtplx-batch run exited {rc}")
    return time.perf_counter() - t0


def read_run(run_dir: Path):
    """Committed rows (only shards recorded in the manifest count) and their commit times."""
    import pyarrow.dataset as ds

    shards = json.loads((run_dir / "manifest.json").read_text()).get("shards", [])
    if not shards:
        return [], []
    rows = ds.dataset([str(run_dir / s["file"]) for s in shards]).to_table().to_pylist()
    return rows, [s["committed"] for s in shards]


def measure(rows, wall, times):
    toks = sum(r["completion_tokens"] or 0 for r in rows)
    out = {"rows": len(rows), "tokens": toks, "wall_s": wall, "rows/s": len(rows) / wall, "tok/s": toks / wall}
    if len(times) >= 2:
        window = max(times) - min(times)
        out["steady tok/s"] = toks / window if window > 0 else float("nan")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--rows", type=int, default=164)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--work", default="/tmp/scaling")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results, texts = [], {}
    for gpus in (1, 2):
        job = work / f"job{gpus}.yaml"
        run_dir = work / f"run{gpus}"
        write_job(job, args.model, args.prompts, run_dir, gpus, args.rows, args.tokens, args.method)
        wall = run_cli(job)
        rows, times = read_run(run_dir)
        texts[gpus] = {(r["id"], r["sample"]): r["completion"] for r in rows}
        results.append({"gpus": gpus, **measure(rows, wall, times)})
        print(table(results), flush=True)
    same = sum(texts[1][k] == texts[2].get(k) for k in texts[1]) / max(1, len(texts[1]))
    # kill the 2-GPU run mid-way, resume, and count rows
    job = work / "job_kill.yaml"
    run_dir = work / "run_kill"
    write_job(job, args.model, args.prompts, run_dir, 2, args.rows, args.tokens, args.method)
    first = results[1]["wall_s"]
    run_cli(job, kill_after=0.6 * first)
    partial, _ = read_run(run_dir) if (run_dir / "manifest.json").exists() else ([], [])
    run_cli(job)
    rows, _ = read_run(run_dir)
    keys = [(r["id"], r["sample"]) for r in rows]
    resumed = {"rows before kill": len(partial), "rows after resume": len(rows), "expected": len(texts[2]),
               "duplicates": len(keys) - len(set(keys)), "missing": len(set(texts[2]) - set(keys)),
               "texts equal uninterrupted 2-GPU run": sum(r["completion"] == texts[2].get((r["id"], r["sample"])) for r in rows) / max(1, len(rows))}
    payload = {"runs": results, "scaling tok/s": results[1]["tok/s"] / results[0]["tok/s"],
               "scaling steady tok/s": results[1].get("steady tok/s", float("nan")) / results[0].get("steady tok/s", float("nan")),
               "2-GPU texts equal 1-GPU": same, "kill_resume": resumed}
    save_json(out / "ray_scaling.json", payload)
    md = table(results) + f"\nscaling (tok/s, whole run): {payload['scaling tok/s']:.2f}x; steady: {payload['scaling steady tok/s']:.2f}x\n" \
        + f"2-GPU texts equal to 1-GPU: {same:.1%}\n\nkill and resume (2 GPUs): {resumed}\n"
    (out / "ray_scaling.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
