"""Where a job's time goes: wall time per engine phase, with the device synchronized at each edge.

    python -m benchmarks.phase_profile jobs/eval-mtp.yaml --set input.limit=64 --out bench-out

Wraps the engine's phases (trunk prefill, drafter prefill / propose / commit, verify forward,
compile of each new verify program) in timers. Synchronizing at every edge removes the overlap
the engine normally gets, so the total is a little above a normal run's; the split is what
counts. Also reports how many distinct input shapes each phase saw: on a GPU backend a new shape
can cost a kernel build, so a phase whose shape count grows with the rows is a suspect.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

from pipelines.job.config import load_job
from pipelines.execution.opening import load_engine
from pipelines.execution.session import run_job

from .common import device_name, save_json, sync, table

TIMES = defaultdict(float)
CALLS = defaultdict(int)
SHAPES = defaultdict(set)


def _shape_of(args):
    return tuple(tuple(a.shape) for a in args if isinstance(a, mx.array))


def timed_method(obj, name: str, label: str, state=lambda: []):
    """Time `obj.name`; `state()` lists the lazy arrays the call leaves behind instead of returning."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        mx.eval([a for a in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(a, mx.array)] + state())
        sync()
        TIMES[label] += time.perf_counter() - t0
        CALLS[label] += 1
        SHAPES[label].add(_shape_of(args))
        return out

    setattr(obj, name, wrapper)


def instrument(engine):
    timed_method(engine.prefiller, "run", "prefill (Prefiller.run, includes drafter.prefill_row)")
    if engine.drafter is not None:
        for name in ("prefill_row", "propose", "commit", "advance"):  # advance: commit of a pipelined round
            if hasattr(engine.drafter, name):
                timed_method(engine.drafter, name, f"drafter.{name}", lambda: list(getattr(engine.drafter, "extra", [])))
    if engine.bank is not None:
        bank = engine.bank
        make_program = bank._program

        def program(key, kinds):
            fresh = key not in bank._programs
            fn = make_program(key, kinds)
            if not fresh:
                return fn

            def first_call(*args):  # compile + first run of a new program
                sync()
                t0 = time.perf_counter()
                out = fn(*args)
                mx.eval(out)
                sync()
                dt = time.perf_counter() - t0
                TIMES["verify program compile (first call)"] += dt
                print(f"new verify program {key}: {dt:.2f} s", flush=True)
                CALLS["verify program compile (first call)"] += 1
                bank._programs[key] = fn
                return out

            bank._programs[key] = first_call
            return first_call

        bank._program = program
        timed_method(bank, "verify", "verify (incl. compiles)")
        # a speculative round's verify with its acceptance, one program (graphbank.verify_round)
        timed_method(bank, "verify_round", "verify + acceptance (incl. compiles)")
        timed_method(bank, "eager", "verify eager")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--tag", default="", help="suffix for the output files (runs of one job with other settings)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    job = load_job(args.job, args.overrides)
    t0 = time.perf_counter()
    engine = load_engine(job)
    print(f"engine loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    instrument(engine)
    with tempfile.TemporaryDirectory() as tmp:
        job.output.dir = str(Path(tmp) / "run")
        sync()
        t0 = time.perf_counter()
        summary = run_job(job, restart=True, engine=engine)
        total = time.perf_counter() - t0
    rows = [{"phase": k, "seconds": v, "share": v / total, "calls": CALLS[k], "distinct input shapes": len(SHAPES[k]) or ""}
            for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1])]
    rows.append({"phase": "whole job", "seconds": total, "share": 1.0, "calls": "", "distinct input shapes": ""})
    extra = {"completion_tokens": summary.completion_tokens, "bank": engine.bank.stats if engine.bank else None,
             "programs": sorted(map(str, engine.bank._programs)) if engine.bank else []}
    name = f"phase_profile-{Path(args.job).stem}-{job.speculative.method}{'-' + args.tag if args.tag else ''}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_json(out / f"{name}.json", {"device": device_name(), "overrides": args.overrides, "rows": rows, **extra})
    md = f"device: {device_name()}; {args.job} {' '.join(args.overrides)}; {summary.completion_tokens} tokens\n\n" + table(rows) + f"\nprograms: {extra['programs']}\n"
    (out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
