"""What a one-stream 8B decode step spends outside its weight matmuls, and whether MLX's CUDA-graph size moves it.

Issue 20 asks for one-stream 8B decoding at >= 65% of the HBM roofline as a median (~5.25 ms a step);
the shipped path runs ~5.5 ms, of which the 145 weight matmuls chained alone are ~4.5 ms
(benchmarks/gemv_bandwidth). MLX's CUDA backend records the kernels of an eval into a CUDA graph and
launches it when the graph holds more than MLX_MAX_OPS_PER_BUFFER kernels or its inputs more than
MLX_MAX_MB_PER_BUFFER MB (mlx/backend/cuda/device.cpp: 100 ops / 1000 MB on an sm_90 GPU). A one-row 8B
step reads 16 GB of weights, so the MB limit cuts it into ~16 graphs (2-3 layers each); every cut
serializes the stream and costs a launch and a graph update on the host (MLX_USE_CUDA_GRAPHS=0 launches
each kernel directly instead). MLX reads these once per process, when its first GPU stream is made, so
each setting (SETTINGS) runs in a child process of its own:

  parent   for each round, for each setting (interleaved): a child with that environment; prints each
           child's runs as they come and the medians over all children after every round
  child    builds the random-weight Qwen3 shape (engine_efficiency.random_qwen3, fixed seed), runs the
           Engine's default one-stream plain decoding (compiled verify bank, stacked projections,
           rows_attention, layer_kernels: what a job runs) --runs times, timed from the first token to
           the last as decode_anatomy does, and once a bare pipelined loop over the same compiled step
           that times, per token, the host's queueing of the next step apart from its wait for the
           token (wait ~0: the host is the bottleneck; queueing << a step: the GPU is)
  --mlp    the first setting's children also run Engines with mtplx/mlp_kernel.py (the stacked gate/up
           product and SwiGLU as one kernel) and with it and mtplx/o_norm_kernel.py (o_proj + residual add +
           RMSNorm as one kernel), interleaved with the default one, tokens compared with the default's; the
           first such child runs both kernels' check (bit identity against MLX's ops), mlp_kernel's
           chained timing, and cProfile of one more default run (where the host's time goes)
  --gemv   a child running benchmarks/gemv_exact: MLX's gemv arithmetic with more loads in flight (same bits)
           against MLX's product, chained over 36 weights of each 8B matrix shape
  --trace  one more child (MLX defaults): the bare loop's last 24 steps under torch.profiler (CUPTI sees
           every kernel of the process, MLX's included); prints the GPU's time per kernel, its busy
           share, and the idle gaps between kernels by size (a graph cut, or the host starving it,
           shows as a long gap)

    python -m benchmarks.step_overhead --shape 8b --rounds 3 --runs 2 --peer --mlp --gemv --trace --out bench-out  # H200, ~3.5 min
    python -m benchmarks.step_overhead --shape tiny --tokens 8 --rounds 1 --runs 1              # CPU dry run

Writes step_overhead.json (and step_trace.json.gz with --trace) to --out.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# name -> environment for MLX's CUDA graph limits (read once per process: mlx/utils.h)
SETTINGS = {
    "default": {},
    "graphs x4": {"MLX_MAX_OPS_PER_BUFFER": "400", "MLX_MAX_MB_PER_BUFFER": "4000"},
    "one graph a step": {"MLX_MAX_OPS_PER_BUFFER": "4000", "MLX_MAX_MB_PER_BUFFER": "64000"},
    # no graphs (not in the default list): every kernel launched on the stream as recorded, no graph updates
    "no graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}
TAG = "@@ "  # a child's result lines


def _emit(**kv):
    print(TAG + json.dumps(kv), flush=True)


# -- the child ---------------------------------------------------------------------------------------

def _build(shape: str):
    import mlx.core as mx

    from .engine_efficiency import HBM_BYTES_PER_S, random_qwen3, weight_bytes

    mx.random.seed(0)
    bundle = random_qwen3(shape)
    return bundle, HBM_BYTES_PER_S / weight_bytes(bundle.model)


def _engine_run(eng, prompt, n):
    from mtplx.request import Request, SamplingParams

    eng.first_token_at = None
    (res,) = list(eng.generate([Request(key=0, prompt_tokens=list(prompt), params=SamplingParams(max_tokens=n))]))
    return list(res.tokens), time.perf_counter() - eng.first_token_at


def _split_loop(model, prompt, n, hook=None, hook_at=0):
    """generate_step's pipelined loop over the engine's compiled one-row step (CompiledVerifyBank over a
    BatchCache, the model as the engine patched it). Per token: seconds queueing the next step (the
    compiled call and async_eval: graph building and launches) and seconds waiting for this token.
    `hook()` is called once, before token `hook_at` (the trace starts there)."""
    import mlx.core as mx
    import numpy as np

    from mtplx.architectures import capture_backend
    from mtplx.cache import BatchCache
    from mtplx.generation import _Runtime
    from mtplx.graphbank import CompiledVerifyBank

    cache = BatchCache.for_model(model, 1)
    bank = CompiledVerifyBank(_Runtime(model, want_hidden=False), max_verify_len=1, request_max_tokens=len(prompt) + n + 1,
                              capture_backend=capture_backend(model))
    ones = np.ones(1, dtype=np.int64)
    logits = model(mx.array(prompt, dtype=mx.int32)[None], cache=cache.layers)
    cache.commit(np.array([len(prompt)]))
    y = mx.argmax(logits[:, -1], axis=-1)
    mx.async_eval(y)
    queue, wait = [], []
    for i in range(n):
        if hook is not None and i == hook_at:
            hook()
        t0 = time.perf_counter()
        nxt = None
        if i < n - 1:
            nxt = mx.argmax(bank.verify(y.reshape(1, 1), cache)[0][:, -1], axis=-1)
            cache.commit(ones)
            mx.async_eval(nxt)
        t1 = time.perf_counter()
        int(y.item())
        t2 = time.perf_counter()
        if i > 0:
            queue.append(t1 - t0)
            wait.append(t2 - t1)
        y = nxt
    return queue, wait


def child(args):
    import numpy as np

    from mtplx import layer_kernels, mlp_kernel, o_norm_kernel
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine

    t0 = time.perf_counter()
    bundle, roof = _build(args.shape)
    prompt = np.random.default_rng(1).integers(0, 1000, args.prompt).tolist()
    spec, sched = SpeculativeConfig(method="none", compiled_verify="on", adaptive_depth=False), ScheduleConfig(max_batch=1)
    eng = Engine(bundle, spec, sched)
    eng.eos = set()  # every run makes --tokens tokens
    _engine_run(eng, prompt, 16)  # warm-up: kernel builds, the compiled program
    engines = [("engine (default path)", eng, Engine.use_mlp_kernel, Engine.use_o_norm_kernel)]

    def state(mlp, onorm):  # the model as an engine's programs were traced (fusion.decode_paths)
        if mlp or onorm:
            mlp_kernel.install(bundle.model, reference=not mlp)
        else:
            mlp_kernel.uninstall(bundle.model)
        layer_kernels._State.o_norm = onorm

    if args.mlp and mlp_kernel.cuda_ready():  # mlp_kernel.py / o_norm_kernel.py: checks, timing, engines with them
        if args.mlp_check:
            for what, fn in (("mlp_kernel", mlp_kernel.check), ("o_norm_kernel", o_norm_kernel.check)):
                try:
                    rows = fn()
                    _emit(kind="check", what=what, cases=len(rows), identical=sum(r["bit-identical"] for r in rows),
                          worst=max(r["max abs diff"] for r in rows))
                except Exception as e:  # noqa: BLE001 (a kernel failing to build must not cost the rest)
                    _emit(kind="check", what=what, error=f"{type(e).__name__}: {e}")
            _emit(kind="timing", what="mlp_kernel", **mlp_kernel.time_it())
        for label, mlp, onorm in (("engine + mlp kernel", True, False), ("engine + mlp + o_norm kernels", True, True)):
            flags = (Engine.use_mlp_kernel, Engine.use_o_norm_kernel)
            Engine.use_mlp_kernel, Engine.use_o_norm_kernel = mlp, onorm
            try:
                e = Engine(bundle, spec, sched)  # installs the kernels on the shared model; its own programs
            finally:
                Engine.use_mlp_kernel, Engine.use_o_norm_kernel = flags
            e.eos = set()
            state(mlp, onorm)
            _engine_run(e, prompt, 16)
            engines.append((label, e, mlp, onorm))
            _emit(kind="ready", seconds=time.perf_counter() - t0, roofline=roof, paths=e.decode_paths, env={})
    state(*engines[0][2:])
    _emit(kind="ready", seconds=time.perf_counter() - t0, roofline=roof, paths=eng.decode_paths,
          env={k: os.environ.get(k) for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_USE_CUDA_GRAPHS")})
    first = None
    for r in range(args.runs):
        for label, e, mlp, onorm in engines:  # interleaved; each engine's programs were traced in its own state
            state(mlp, onorm)
            toks, dt = _engine_run(e, prompt, args.tokens)
            first = first or toks
            spt = dt / max(1, len(toks) - 1)
            _emit(kind="run", variant=label, spt=spt, tok_s=1 / spt, roofline_pct=100 / spt / roof, same_tokens=toks == first)
    state(*engines[0][2:])
    if args.host_profile:  # where the host's time goes in one more default run (cProfile: Python and the C++ calls it makes)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        _, dt = _engine_run(eng, prompt, args.tokens)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        lines = [ln for ln in text.getvalue().splitlines() if ln.strip()][-19:]
        _emit(kind="host_profile", tokens=args.tokens, seconds=dt, lines=lines)
    if args.peer:
        from .decode_anatomy import v_generate_step

        v_generate_step(bundle.model, prompt, 16)
        toks, dt = v_generate_step(bundle.model, prompt, args.tokens)
        spt = dt / max(1, len(toks) - 1)
        _emit(kind="run", variant="mlx-lm generate_step", spt=spt, tok_s=1 / spt, roofline_pct=100 / spt / roof)
    _split_loop(bundle.model, prompt, 8)
    queue, wait = _split_loop(bundle.model, prompt, args.tokens)
    _emit(kind="split", queue_ms=1e3 * statistics.median(queue), wait_ms=1e3 * statistics.median(wait),
          step_ms=1e3 * statistics.median([q + w for q, w in zip(queue, wait)]))
    spt = (sum(queue) + sum(wait)) / len(queue)
    _emit(kind="run", variant="bare loop, same step", spt=spt, tok_s=1 / spt, roofline_pct=100 / spt / roof)


# -- the kernel trace --------------------------------------------------------------------------------

def trace_child(args):
    """A bare loop over the engine's compiled step (as patched by an Engine), its last `steps` tokens under
    torch.profiler: CUPTI records every kernel of the process, MLX's included."""
    import torch  # noqa: F401 (imported before MLX's first kernel, so CUPTI sees the whole context)
    from torch.profiler import ProfilerActivity, profile

    import numpy as np

    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine

    bundle, _ = _build(args.shape)
    prompt = np.random.default_rng(1).integers(0, 1000, args.prompt).tolist()
    eng = Engine(bundle, SpeculativeConfig(method="none", compiled_verify="on", adaptive_depth=False), ScheduleConfig(max_batch=1))
    _emit(kind="ready", seconds=0.0, roofline=0.0, paths=eng.decode_paths, env={})
    _split_loop(bundle.model, prompt, 8)
    steps, warm = 24, 8
    prof = profile(activities=[ProfilerActivity.CUDA])
    _split_loop(bundle.model, prompt, warm + steps, hook=prof.start, hook_at=warm)
    prof.stop()
    path = Path(args.out) / "step_trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text()).get("traceEvents", [])
    with gzip.open(str(path) + ".gz", "wt") as f:
        json.dump(events, f)
    path.unlink()
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    _emit(kind="trace", **analyse(kernels, steps))


def _name(name: str) -> str:
    """A kernel's name without its template arguments and namespaces (custom kernels keep theirs)."""
    return name.split("<")[0].split("(")[0].split("::")[-1][:70]


def analyse(kernels, steps):
    """Per-kernel GPU time, busy share and idle gaps over the traced span (microseconds a step)."""
    if not kernels:
        return {"error": "no kernel events in the trace (CUPTI did not see MLX's kernels)"}
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    kinds = {}
    busy, gaps, end = 0.0, [], kernels[0]["ts"]
    for e in kernels:
        k = kinds.setdefault(_name(e["name"]), [0, 0.0])
        k[0] += 1
        k[1] += e["dur"]
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:
            gaps.append(start - end)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    edges = ((2, "<2us"), (5, "2-5us"), (20, "5-20us"), (100, "20-100us"), (float("inf"), ">100us"))
    time_in, count_in = {b: 0.0 for _, b in edges}, {b: 0 for _, b in edges}
    for g in gaps:
        b = next(label for top, label in edges if g < top)
        time_in[b] += g
        count_in[b] += 1
    per_kernel = {name: {"per step": round(c / steps, 2), "us/step": round(t / steps, 1), "us each": round(t / c, 2)}
                  for name, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1])}
    return {"steps": steps, "kernels": len(kernels), "span us/step": span / steps, "busy us/step": busy / steps,
            "idle us/step": (span - busy) / steps, "gap us/step by size": {b: v / steps for b, v in time_in.items()},
            "gaps/step by size": {b: v / steps for b, v in count_in.items()}, "by kernel": per_kernel}


# -- the parent --------------------------------------------------------------------------------------

def _spawn(args, extra_env, flag, limit, more=()):
    from mtplx import cuda_graphs

    # MLX's defaults unless the setting says otherwise: not what `import mtplx` set in this process
    env = {k: v for k, v in os.environ.items() if k not in cuda_graphs.applied}
    env.update(PYTHONUNBUFFERED="1", **extra_env)
    cmd = [sys.executable, "-m", "benchmarks.step_overhead", flag, "--shape", args.shape, "--tokens", str(args.tokens),
           "--prompt", str(args.prompt), "--runs", str(args.runs), "--out", args.out] + (["--peer"] if args.peer else []) + list(more)
    results = []
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        print(f"   child failed to start: {e}", flush=True)
        return results
    killer = threading.Timer(limit, proc.kill)  # a child that hangs silently is stopped all the same
    killer.start()
    for line in proc.stdout:
        if line.startswith(TAG):
            results.append(json.loads(line[len(TAG):]))
        elif line.strip() and "Warning" not in line:
            print("   |", line.rstrip()[:200], flush=True)
    proc.wait()
    if not killer.is_alive():
        print(f"   child over its {limit:.0f} s limit: killed", flush=True)
    killer.cancel()
    return results


def _medians(runs):
    rows = []
    for (setting, variant), spts in runs.items():
        m = statistics.median(spts)
        rows.append((setting, variant, 1 / m, m * 1e3, len(spts), " ".join(f"{1 / s:.0f}" for s in spts)))
    return rows


def _print_table(runs, roof, splits):
    print("| setting | variant | tok/s (median) | ms/token | % roofline | runs | tok/s each |", flush=True)
    print("|---|---|---|---|---|---|---|", flush=True)
    for setting, variant, tps, ms, n, each in _medians(runs):
        print(f"| {setting} | {variant} | {tps:.1f} | {ms:.3f} | {100 * tps / roof:.1f} | {n} | {each} |", flush=True)
    for setting, sp in splits.items():
        q = statistics.median(s["queue_ms"] for s in sp)
        w = statistics.median(s["wait_ms"] for s in sp)
        print(f"host split [{setting}]: queueing the next step {q:.2f} ms, waiting for the token {w:.2f} ms a step "
              f"({'host-bound' if w < 0.3 else 'device-bound'})", flush=True)


def parent(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; known: {', '.join(SETTINGS)}")
    runs, splits, ready, trace, notes = {}, {}, {}, None, []
    checked = False
    roof = None
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]  # alternate the order: drift hits every setting alike
        for name in order:
            if time.monotonic() - t_start > args.budget:
                print(f"budget of {args.budget} s spent: no more children", flush=True)
                break
            print(f"== round {rnd}, setting '{name}' {SETTINGS[name] or '(MLX defaults)'}", flush=True)
            more = []
            if args.mlp and name == names[0]:  # the kernel's variant in the first setting's children; its check once
                more = ["--mlp"] + ([] if checked else ["--mlp-check", "--host-profile"])
                checked = True
            for res in _spawn(args, SETTINGS[name], "--child", args.child_limit, more):
                if res["kind"] == "ready":
                    roof = res["roofline"]
                    ready.setdefault(name, []).append(res)
                    print(f"   ready in {res['seconds']:.1f} s; paths {res['paths']}", flush=True)
                elif res["kind"] == "run":
                    runs.setdefault((name, res["variant"]), []).append(res["spt"])
                    same = "" if res.get("same_tokens", True) else "  TOKENS DIFFER FROM THE DEFAULT PATH'S"
                    print(f"   {res['variant']:24s} {res['tok_s']:7.1f} tok/s  {1e3 * res['spt']:.3f} ms/tok  "
                          f"{res['roofline_pct']:.1f}% of roofline{same}", flush=True)
                elif res["kind"] == "host_profile":
                    notes.append(res)
                    print(f"   host profile of one default run ({res['tokens']} tokens, {res['seconds']:.2f} s under cProfile):", flush=True)
                    for ln in res["lines"]:
                        print("   |", ln, flush=True)
                elif res["kind"] in ("check", "timing"):
                    notes.append(res)
                    print(f"   {res}", flush=True)
                elif res["kind"] == "split":
                    splits.setdefault(name, []).append(res)
                    print(f"   host split: queue {res['queue_ms']:.2f} ms, wait {res['wait_ms']:.2f} ms, step {res['step_ms']:.2f} ms", flush=True)
        if runs and roof:
            print(f"-- medians after round {rnd}", flush=True)
            _print_table(runs, roof, splits)
    if args.gemv:
        print("== MLX's gemv with more loads in flight, same bits (benchmarks/gemv_exact)", flush=True)
        for res in _spawn(args, {}, "--gemv-child", 60):
            if res["kind"] == "gemv":
                notes.append(res)
    if args.trace and time.monotonic() - t_start < args.budget + 30:
        print("== kernel trace (torch.profiler / CUPTI), MLX defaults", flush=True)
        for res in _spawn(args, {}, "--trace-child", args.child_limit + 30):
            if res["kind"] == "trace":
                trace = res
                print(json.dumps(res, indent=1), flush=True)
    payload = {"shape": args.shape, "tokens": args.tokens, "settings": {n: SETTINGS[n] for n in names},
               "medians": [dict(zip(("setting", "variant", "tok/s", "ms/token", "n", "runs"), r)) for r in _medians(runs)],
               "runs": [{"setting": s, "variant": v, "spt": x} for (s, v), xs in runs.items() for x in xs],
               "splits": splits, "ready": ready, "trace": trace, "kernel checks": notes, "roofline tok/s": roof}
    (out / "step_overhead.json").write_text(json.dumps(payload, indent=1))
    if runs and roof:
        print("== final", flush=True)
        _print_table(runs, roof, splits)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", help="engine_efficiency.SHAPES key")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2, help="timed engine runs per child")
    ap.add_argument("--rounds", type=int, default=3, help="children per setting (interleaved)")
    ap.add_argument("--settings", default="default,graphs x4,one graph a step", help="comma-separated SETTINGS names: " + ", ".join(SETTINGS))
    ap.add_argument("--peer", action="store_true", help="also one mlx-lm generate_step run per child")
    ap.add_argument("--mlp", action="store_true", help="the first setting's children also run the engine with "
                    "mtplx/mlp_kernel.py (after its bit-identity check and chained timing, once)")
    ap.add_argument("--mlp-check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--host-profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gemv", action="store_true", help="a child timing benchmarks/gemv_exact (MLX's gemv arithmetic, "
                    "more loads in flight) against MLX's product on the 8B matrices")
    ap.add_argument("--gemv-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help="a last child under torch.profiler: the GPU's kernels")
    ap.add_argument("--budget", type=float, default=150, help="no child starts after this many seconds")
    ap.add_argument("--child-limit", type=float, default=70, help="seconds a child may run")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
    elif args.trace_child:
        trace_child(args)
    elif args.gemv_child:
        from .gemv_exact import run

        for row in run():
            _emit(kind="gemv", **row)
    else:
        parent(args)


if __name__ == "__main__":
    main()
