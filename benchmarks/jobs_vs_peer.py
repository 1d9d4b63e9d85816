"""A whole job through the pipeline vs `mlx_lm.batch_generate` on the same rows and model.

    python -m benchmarks.jobs_vs_peer jobs/mmlu.yaml --set speculative.method=none --out bench-out
    python -m benchmarks.jobs_vs_peer jobs/eval-mtp.yaml --set input.limit=64 --methods mtp,ngram,none

Both get the same rendered prompt tokens (the job's own template / chat template), the same
max_tokens and the same width (rows in flight: the job's `schedule.max_batch`, which is
batch_generate's completion batch size), and each runs once untimed first (compiled programs and kernels exist before timing;
our cached shared prefixes are dropped after it). Stop strings are dropped so both stop only at
EOS or max_tokens. Reports end-to-end tokens/s of each and their ratio (sampled rows end at
different lengths on the two sides, so the token counts may differ: the wall-time ratio is shown
only when they are equal), and the prompt tokens the engine actually prefilled (shared prefixes
are prefilled once) against the prompt tokens in the rows.

Several settings of the same job in one process (`--methods`, or `--variant "k=v k=v"` for any
overrides): the model loads once, each setting gets its own engine, warm-up run and timed run,
and the peer runs once, last, on a fresh copy of the model (an engine installs its decode paths
into the model it runs). Every phase prints as it ends, with its seconds (`[  12.3s] phase: ...`,
the bracket is time since the process started): loading, preparing rows, each engine's setup,
warm-up and timed run, with the compiled programs each run made and the seconds their first calls
took (tracing, compiling, kernel builds; one line for each first call over a second), then the
peer's warm-up and timed run. The table files are rewritten after every setting, so a run cut off
by a time limit still shows where its time went.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml
from mlx_lm.sample_utils import make_sampler

from mtplx.models.loading import load
from mtplx.prefill import PrefixStore
from pipelines.execution.startup import process_age
from pipelines.job.config import load_job
from pipelines.io.rows import prepare
from pipelines.io.job_input import open_job
from pipelines.execution.session import run_job

from .common import device_name, save_json, speed_ratio, sync, table, versions
from .real_models import mlx_batch

_BEGAN = time.perf_counter() - process_age()
SLOW_FIRST_CALL = 1.0  # seconds: a first call at least this slow prints its own line (kernel builds)


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - _BEGAN:7.1f}s] {msg}", flush=True)


class FirstCalls:
    """Counts the compiled programs an engine makes (verify bank, MTP draft bank) and times the
    first call of each, synchronized (tracing, compiling, kernel builds), the seconds in
    admission's prefills, and the custom-kernel instantiations mtplx/kernel_cache.py built or found
    in MLX's cache: `take()` returns what was made and spent since the last take."""

    def __init__(self, engine):
        self.made, self.seconds, self.prefill_s = {"verify": 0, "head": 0}, 0.0, 0.0
        self._built = _kernel_counts()  # at the last take
        run = engine.prefiller.run

        def prefill(*args, **kwargs):  # admission's prefills (their first tokens are read there anyway)
            t0 = time.perf_counter()
            out = run(*args, **kwargs)
            sync()
            self.prefill_s += time.perf_counter() - t0
            return out

        engine.prefiller.run = prefill
        if engine.bank is not None:
            self._wrap(engine.bank, "_program", "verify")
        head_bank = getattr(engine.drafter, "bank", None)
        if head_bank is not None and hasattr(head_bank, "_get"):
            self._wrap(head_bank, "_get", "head")

    def _wrap(self, bank, name: str, kind: str):
        inner = getattr(bank, name)

        def get(key, *rest):
            if key in bank._programs:
                return inner(key, *rest)
            fn = inner(key, *rest)
            self.made[kind] += 1
            return self._timed_once(bank, key, fn)

        setattr(bank, name, get)

    def _timed_once(self, bank, key, fn):
        import mlx.core as mx

        def first(*args):
            sync()
            t0 = time.perf_counter()
            out = fn(*args)
            mx.eval(out)
            sync()
            took = time.perf_counter() - t0
            self.seconds += took
            if took >= SLOW_FIRST_CALL:
                say(f"  first call of {bank.__class__.__name__} program {key}: {took:.2f} s")
            bank._programs[key] = fn  # later calls go straight to the program
            return out

        bank._programs[key] = first
        return first

    def take(self) -> dict:
        built = _kernel_counts()
        out = {"new verify programs": self.made["verify"], "new head programs": self.made["head"],
               "first calls s": round(self.seconds, 2), "prefill s": round(self.prefill_s, 2),
               "kernels built": built[0] - self._built[0], "kernel builds s": round(built[1] - self._built[1], 2),
               "kernels found": built[2] - self._built[2]}
        self.made, self.seconds, self.prefill_s, self._built = {"verify": 0, "head": 0}, 0.0, 0.0, built
        return out


def _kernel_counts() -> tuple:
    """(built, seconds building, found) of mtplx/kernel_cache.py in this process so far."""
    from mtplx.kernels import kernel_cache

    return kernel_cache.stats["built"], kernel_cache.stats["build_s"], kernel_cache.stats["found"]


def counters(engine) -> dict:
    """The engine's own counters that say what a run did (rounds, reads, fallbacks)."""
    out = {k: engine.counters[k] for k in ("rounds", "host_reads", "prefill_tokens", "cached_prompt_tokens")}
    if engine.bank is not None:
        out.update({"verify compiled": engine.bank.stats["compiled_calls"], "verify eager": engine.bank.stats["fallback_calls"]})
    head_bank = getattr(engine.drafter, "bank", None)
    if head_bank is not None and hasattr(head_bank, "stats"):
        out.update({"head compiled": head_bank.stats.get("compiled_calls", 0), "head eager": head_bank.stats.get("eager_calls", 0)})
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def variants(args) -> list:
    """Each setting run: a label and its overrides (after the common --set ones)."""
    out = [("method=" + m, [f"speculative.method={m}"]) for m in args.methods.split(",") if m] if args.methods else []
    out += [(v, v.split()) for v in args.variant]
    return out or [("as written", [])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--methods", default="", help="comma-separated speculative.method values, one setting each")
    ap.add_argument("--variant", action="append", default=[],
                    help='a setting as space-separated key=value overrides, e.g. "speculative.method=ngram '
                         'speculative.adaptive_depth=true"; engine.NAME=V sets an Engine class attribute on that '
                         'engine (e.g. engine.TAIL_KEEPS_WIDTH=1); repeatable, after --methods')
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per setting (each with its own table row)")
    ap.add_argument("--no-peer", action="store_true", help="skip batch_generate (only our settings and their phases)")
    ap.add_argument("--attr", action="append", default=[],
                    help="MODULE.NAME=V: set a module attribute before anything runs (e.g. mtplx.prefill.PAD_QUERIES=false)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds since start after which no new setting starts (the peer still runs); 0: no limit")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    for a in args.attr:
        import importlib

        target, value = a.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, yaml.safe_load(value))
    say(f"start (imports done): {device_name()}{'; ' + ', '.join(args.attr) if args.attr else ''}")
    base = args.overrides + ["generation.stop=[]"]
    job = load_job(args.job, base)
    t = time.perf_counter()
    bundle = load(job.model.path, trust_remote_code=job.model.trust_remote_code, gguf_mode=job.model.gguf_mode)
    say(f"load: {time.perf_counter() - t:.2f} s ({fmt({k: round(v, 2) for k, v in bundle.phases.items()})})")
    t = time.perf_counter()
    prep = open_job(job, bundle.tokenizer)
    from mtplx.models.loading import context_length

    items = [it for it in prepare(prep.source.rows(), prep.renderer, job.input.id_column, [], context_length(bundle.config),
                                  None, job.input.limit) if it.tokens]
    gen = job.generation
    prompts = [it.tokens for it in items for _ in range(gen.n)]  # n samples per row: n rows for the peer
    width = job.schedule.max_batch
    if str(width) == "auto" and not args.no_peer:
        raise SystemExit("schedule.max_batch: auto: the peer needs the width before any engine is built: "
                         "--set schedule.max_batch=N (or --no-peer)")
    say(f"prepare rows: {time.perf_counter() - t:.2f} s ({len(prompts)} rows, {sum(map(len, prompts))} prompt tokens, "
        f"max_tokens {gen.max_tokens}, width {width})")
    sampler = make_sampler(temp=gen.temperature, top_p=gen.top_p or 0.0, top_k=gen.top_k or 0) if gen.temperature > 0 else None
    rows = []
    settings = variants(args)
    method = load_job(args.job, base + settings[0][1]).speculative.method if len(settings) == 1 else "settings"
    write = _writer(args, f"jobs_vs_peer-{Path(args.job).stem}-{method}-w{width}")
    from mtplx.generation import Engine

    for label, extra in settings:
        if args.budget and time.perf_counter() - _BEGAN > args.budget:
            say(f"{label}: skipped (past --budget {args.budget:g} s; the peer still runs)")
            continue
        attrs = dict(e[len("engine."):].split("=", 1) for e in extra if e.startswith("engine."))
        vjob = load_job(args.job, base + [e for e in extra if not e.startswith("engine.")])
        t = time.perf_counter()
        engine = Engine(bundle, vjob.speculative, vjob.schedule)
        for name, value in attrs.items():  # an engine class attribute (benchmarks measure with and without)
            setattr(engine, name, yaml.safe_load(value))
        first_calls = FirstCalls(engine)
        say(f"{label}: engine setup {time.perf_counter() - t:.2f} s (width {engine.max_batch})")
        with tempfile.TemporaryDirectory() as tmp:
            before = counters(engine)
            vjob.output.dir = str(Path(tmp) / "warm")
            t = time.perf_counter()
            run_job(vjob, restart=True, engine=engine)  # warm-up, untimed, as mlx_batch does for the peer
            sync()
            say(f"{label}: warm-up run {time.perf_counter() - t:.2f} s ({fmt(first_calls.take())}; "
                f"{fmt(delta(counters(engine), before))})")
            for rep in range(args.repeats):
                engine.prefiller.store = PrefixStore()  # each timed run prefills its shared prefixes again
                before = counters(engine)
                vjob.output.dir = str(Path(tmp) / f"run{rep}")
                sync()
                t0 = time.perf_counter()
                summary = run_job(vjob, restart=True, engine=engine)
                ours_s = time.perf_counter() - t0
                did = delta(counters(engine), before)
                say(f"{label}: timed run {ours_s:.2f} s ({summary.completion_tokens} tokens, "
                    f"{summary.completion_tokens / ours_s:.0f} tok/s; {fmt(first_calls.take())}; {fmt(did)})")
                row = {"job": Path(args.job).stem, "setting": label, "rows": len(prompts), "width": engine.max_batch,
                       "prompt tokens": sum(map(len, prompts)), "prefilled by us": did["prefill_tokens"],
                       "copied from shared prefix": did["cached_prompt_tokens"], "ours tokens": summary.completion_tokens,
                       "ours tok/s": summary.completion_tokens / ours_s, "ours s": ours_s}
                rows.append(row)
        write(rows)
    if not args.no_peer:
        # a fresh copy of the model: our engines installed their decode paths into the one they ran on
        t = time.perf_counter()
        fresh = load(job.model.path, trust_remote_code=job.model.trust_remote_code, gguf_mode=job.model.gguf_mode)
        say(f"peer: fresh model load {time.perf_counter() - t:.2f} s")
        t = time.perf_counter()
        from mlx_lm import batch_generate  # noqa: F401  (mlx-lm's own __init__: transformers, and torch where installed)

        say(f"peer: import mlx_lm {time.perf_counter() - t:.2f} s")
        peer = mlx_batch(fresh, prompts, gen.max_tokens, width=int(width), sampler=sampler,
                         warmed=lambda s: say(f"peer batch_generate: warm-up {s:.2f} s"))
        say(f"peer batch_generate: timed {peer['seconds']:.2f} s ({peer['tokens']} tokens, {peer['tok_s']:.0f} tok/s)")
        for r in rows:
            r.update(speed_ratio(r["ours tokens"], r["ours s"], peer["tokens"], peer["seconds"], "mlx-lm"))
            r["mlx-lm s"] = peer["seconds"]
        write(rows)
    print(table(rows), flush=True)
    say("done")


def _writer(args, name: str):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(rows):
        if not rows:
            return
        fastest = max(r["ours tok/s"] for r in rows)
        for r in rows:
            r["x fastest setting"] = r["ours tok/s"] / fastest
        save_json(out / f"{name}.json", {"device": device_name(), "versions": versions(), "overrides": args.overrides, "rows": rows})
        (out / f"{name}.md").write_text(f"device: {device_name()}\n\n" + table(rows))

    return write


if __name__ == "__main__":
    main()
