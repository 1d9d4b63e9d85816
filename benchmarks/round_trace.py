"""One-stream MTP rounds against plain rounds: interleaved repeats, the host's split, and a kernel trace.

    python -m benchmarks.round_trace --model smollm2-135m-instruct --head heads/smollm2-135m-instruct \
        --prompts humaneval --heldout --rows 4 --tokens 96 --settings plain,3,3:fold_accept=0 --repeats 5 --trace
    python -m benchmarks.round_trace --tiny --rows 2 --tokens 12 --repeats 2                      # CPU dry run

Issue 18 asks for >= 1.6x plain decoding at one stream; a host as noisy as the H200's (plain ran 269-370
tok/s in three runs of one window) needs the settings interleaved, not one run each. Every setting gets
its own Engine (same model), warmed once (every program and kernel built), then the repeats run
setting after setting, so a slow spell of the host hits all of them; medians and spread are printed
after every repeat (a cut-off run still has its numbers).

A setting is `plain`, or an MTP depth (`3`: fixed; `a3`: adaptive depth up to 3), with `lN` for speculative.mtp_lookup N
(`3l2`), and
`:attr=value` pairs that set an Engine attribute before its warm-up, for A/B of engine switches
(`3:fold_accept=0`, dotted into the engine: `3:drafter.vocab.use_table=0`; an attribute the Engine does not have is
refused), or a module's attribute while that engine is built and warmed, its programs traced
(`3:mtplx.fusion.STACK_FEW_ROWS=0`).

Per round the host's split: ms building its graph (a plain round's verify call, a speculative round's
`_launch`: program calls, eager ops, the drafter), ms dispatching it (`mx.async_eval`: the eval's graph
walk and kernel launches); for MTP also ms waiting for a round's read (`_read`: large when the device is
behind the host, ~0 when the host is the bottleneck) and ms landing it (`_land`: bookkeeping, emit). `--trace` (CUDA, torch
installed) then runs each of --trace-settings (default the first two) once more (its first --trace-rows rows) under
torch.profiler (CUPTI sees MLX's kernels) and prints per round: kernels, GPU-busy and idle microseconds,
and the costliest kernel names, so what an MTP round adds over a plain round shows by kernel; every
kernel and CUDA runtime call of those runs is written to trace-N.json.gz (N: the setting's index) for a look round by round.

Writes round_trace.json to --out. `--compare trace-0.json.gz trace-1.json.gz` (no run) prints saved traces side
by side, per round: kernels and host CUDA calls by name.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_setting(text: str):
    """'plain' | '[a]DEPTH[lN][:attr=value...]' -> (label, depth or None, lookup, {attr: value}, adaptive)."""
    head, *pairs = text.split(":")
    m = re.fullmatch(r"plain|(a?)(\d+)(?:l(\d+))?", head)
    if m is None:
        raise SystemExit(f"--settings: {text!r} is not 'plain' or [a]DEPTH[lN][:attr=value...] (e.g. 3, 3l2, a3l2, 3:fold_accept=0)")
    attrs = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise SystemExit(f"--settings: {p!r} in {text!r} is not attr=value")
        attrs[k] = int(v) if re.fullmatch(r"-?\d+", v) else v
    depth = None if head == "plain" else int(m.group(2))
    return text, depth, int(m.group(3) or 0) if depth else 0, attrs, bool(m.group(1))


def _split_timers(eng):
    """Time a run's host work: `mx.async_eval` (dispatch: the eval's graph walk and kernel launches,
    every setting), and the round's graph building: a speculative round's `_launch` less its
    dispatch, a plain round's verify call (`_verify`: its compiled program's replay); for a
    speculative round also `_read` (the host waiting for the device) and `_land` (bookkeeping)."""
    import mlx.core as mx

    spent = {"build": 0.0, "dispatch": 0.0, "read": 0.0, "land": 0.0}
    real_async = mx.async_eval

    def dispatch(*args):
        t0 = time.perf_counter()
        out = real_async(*args)
        spent["dispatch"] += time.perf_counter() - t0
        return out
    mx.async_eval = dispatch
    names = {"_launch": "build", "_read": "read", "_land": "land"} if eng.drafter is not None else {"_verify": "build"}
    for attr, label in names.items():
        inner = getattr(eng, attr)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            t0, d0 = time.perf_counter(), spent["dispatch"]
            out = _inner(*args, **kwargs)
            spent[_label] += time.perf_counter() - t0 - (spent["dispatch"] - d0)
            return out
        setattr(eng, attr, timed)

    def undo():
        mx.async_eval = real_async
        for attr in names:
            eng.__dict__.pop(attr, None)
    return spent, undo


def make_engine(bundle, head: str, setting, width: int):
    """The setting's Engine, warmed (one run of the rows is the caller's). Module attributes
    (`mtplx.MODULE.NAME=V`) hold only while it is built and warmed: its programs are traced then."""
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine

    _, depth, lookup, attrs, adaptive = setting
    spec = (SpeculativeConfig(method="none") if depth is None else
            SpeculativeConfig(method="mtp", depth=depth, mtp_head=head, mtp_lookup=lookup, adaptive_depth=adaptive))
    modules = {k: v for k, v in attrs.items() if k.startswith("mtplx.")}
    restore = []
    for k, v in modules.items():
        mod, name = importlib.import_module(k.rsplit(".", 1)[0]), k.rsplit(".", 1)[1]
        if not hasattr(mod, name):
            raise SystemExit(f"--settings: {k.rsplit('.', 1)[0]} has no attribute {name!r} (setting {setting[0]!r})")
        old = getattr(mod, name)
        restore.append((mod, name, old))
        setattr(mod, name, type(old)(v) if isinstance(old, (bool, int)) else v)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width))
    for k, v in attrs.items():  # a dotted name reaches into the engine (drafter.vocab.use_table)
        if k in modules:
            continue
        *path, name = k.split(".")
        owner = eng
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            raise SystemExit(f"--settings: the Engine has no attribute {k!r} (setting {setting[0]!r})")
        old = getattr(owner, name)
        setattr(owner, name, type(old)(v) if isinstance(old, (bool, int)) else v)
    return eng, restore


def timed_run(eng, reqs):
    from .common import sync

    split, undo = _split_timers(eng)
    rounds0 = eng.counters["rounds"]
    sync()
    t0 = time.perf_counter()
    res = list(eng.generate(reqs))
    sync()
    dt = time.perf_counter() - t0
    undo()
    rounds = eng.counters["rounds"] - rounds0
    n = sum(len(r.tokens) for r in res)
    out = {"tok/s": n / dt, "ms/round": 1e3 * dt / max(rounds, 1), "rounds": rounds, "tokens": n,
           "texts": {r.key: list(r.tokens) for r in res}}
    if eng.drafter is not None:
        verifies = sum(r.stats.verify_calls for r in res)
        out["tokens/verify"] = (sum(r.stats.accepted_tokens for r in res) + verifies) / max(verifies, 1)
    out.update({f"{k} ms": 1e3 * v / max(rounds, 1) for k, v in split.items()
                if eng.drafter is not None or k in ("build", "dispatch")})
    return out


def trace(eng, reqs, save=None):
    """One run under torch.profiler: kernels, GPU busy / idle and the costliest kernels, per round;
    `save`: a .json.gz path for every kernel and CUDA runtime call [category, name, start us, us]
    (the runtime calls are the host's launches and waits: a round's read is a synchronize)."""
    from torch.profiler import ProfilerActivity, profile

    from .common import sync
    from .step_overhead import analyse

    rounds0 = eng.counters["rounds"]
    with tempfile.TemporaryDirectory() as tmp:
        prof = profile(activities=[ProfilerActivity.CUDA])
        sync()
        prof.start()
        list(eng.generate(reqs))
        sync()
        prof.stop()
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    rounds = max(eng.counters["rounds"] - rounds0, 1)
    calls = {}  # the host's CUDA runtime calls (graph instantiations vs updates vs launches, syncs, copies)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = calls.setdefault(e.get("name", "?"), [0, 0.0])
            c[0] += 1
            c[1] += e.get("dur", 0)
    if save is not None:
        import gzip

        kept = sorted(([e.get("cat"), e.get("name", "")[:120], e["ts"], e.get("dur", 0)] for e in events
                       if e.get("ph") == "X" and e.get("cat") in ("kernel", "cuda_runtime", "cuda_driver", "gpu_memcpy", "gpu_memset")),
                      key=lambda e: e[2])
        with gzip.open(save, "wt") as f:
            json.dump({"rounds": rounds, "events": kept}, f)
    out = analyse(kernels, rounds)
    out["writes by size"] = writes_by_size(kernels, rounds)
    out["runtime calls"] = {k: {"per round": round(n / rounds, 2), "us/round": round(t / rounds, 1)}
                            for k, (n, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])}
    return out


def writes_by_size(kernels, rounds: int) -> dict:
    """Copy and scatter kernels a round by their launch size (blocks of the grid, CUPTI's `grid`): a copy of
    a whole KV cache (a scatter MLX could not do in place) launches many blocks, a dtype cast of a round's
    few tokens one, so the counts tell the two apart (issue 18: copy_v in pipelined MTP rounds)."""
    from .step_overhead import _name

    sizes = {}
    for e in kernels:
        name = _name(e["name"])
        if not (name.startswith("copy") or name.startswith("scatter")):
            continue
        grid = (e.get("args") or {}).get("grid") or [0]
        blocks = 1
        for g in grid:
            blocks *= int(g)
        c = sizes.setdefault(f"{name} x{blocks}", [0, 0.0])
        c[0] += 1
        c[1] += e.get("dur", 0)
    return {k: {"per round": round(n / rounds, 2), "us each": round(t / n, 2)}
            for k, (n, t) in sorted(sizes.items(), key=lambda kv: -kv[1][0])}


def compare(paths):
    """Two or more saved traces (trace-N.json.gz) side by side, per round: kernels by name, their GPU
    microseconds, and the host's CUDA runtime calls by name (what one setting adds over another)."""
    import gzip
    from collections import defaultdict

    from .step_overhead import _name

    per = []
    for p in paths:
        with gzip.open(p, "rt") as f:
            d = json.load(f)
        R = max(d["rounds"], 1)
        k, r = defaultdict(lambda: [0.0, 0.0]), defaultdict(lambda: [0.0, 0.0])
        for cat, name, _, dur in d["events"]:
            into = k if cat == "kernel" else r
            into[_name(name) if cat == "kernel" else name][0] += 1 / R
            into[_name(name) if cat == "kernel" else name][1] += dur / R
        per.append((k, r, R, graph_sizes(d["events"])))
    for label, idx in (("kernels", 0), ("host CUDA calls", 1)):
        names = sorted({n for x in per for n in x[idx]}, key=lambda n: -max(x[idx][n][1] for x in per if n in x[idx]))
        print(f"| {label} a round | " + " | ".join(f"{Path(p).name} (n, us)" for p in paths) + " |")
        print("|---|" + "---|" * len(paths))
        for n in names:
            print(f"| {n} | " + " | ".join(f"{x[idx][n][0]:.1f}, {x[idx][n][1]:.0f}" if n in x[idx] else "-" for x in per) + " |")
        print("| all | " + " | ".join(f"{sum(v[0] for v in x[idx].values()):.0f}, {sum(v[1] for v in x[idx].values()):.0f}"
                                       for x in per) + f" |  (rounds: {', '.join(str(x[2]) for x in per)})")
        print()
    for p, x in zip(paths, per):  # where a round's graphs are cut: a few nodes past a cut cost a whole launch
        common = ", ".join(f"{n} x{c}" for n, c in x[3].most_common(8))
        print(f"{Path(p).name}: {sum(x[3].values()) / x[2]:.2f} graphs a round; kernel nodes a graph (most common): {common}")


def graph_sizes(events):
    """Counter of kernel nodes a CUDA graph: the cudaGraphAddKernelNode calls between two cudaGraphLaunch calls."""
    from collections import Counter

    sizes, n = Counter(), 0
    for _, name, _, _ in sorted(events, key=lambda e: e[2]):
        if name == "cudaGraphAddKernelNode":
            n += 1
        elif name == "cudaGraphLaunch":
            sizes[n] += 1
            n = 0
    return sizes


def _summary(label, runs, plain_runs):
    """A setting's medians over its runs; x plain as the median of its ratios to plain's run of the same
    repeat (the host's slow spells hit both), and as the ratio of the medians."""
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    tps = [r["tok/s"] for r in runs]
    ratios = [r["tok/s"] / p["tok/s"] for r, p in zip(runs, plain_runs or [])]
    row = {"setting": label, "tok/s": med["tok/s"], "spread": f"{min(tps):.0f}-{max(tps):.0f}",
           "x plain": statistics.median(ratios) if ratios else "-",
           "x plain spread": f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-",
           "x plain (medians)": med["tok/s"] / statistics.median(p["tok/s"] for p in plain_runs) if plain_runs else "-",
           "ms/round": med["ms/round"], "runs": len(runs)}
    for k in ("tokens/verify", "build ms", "dispatch ms", "read ms", "land ms"):
        row[k] = med.get(k, "-")  # (a plain round's read and emit are a closure's: not split)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="round_cost's 30-layer width-64 random llama and random head (CPU)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct")
    ap.add_argument("--prompts", default="humaneval", help="a dataset name or .jsonl file (rows' `prompt`, chat-rendered)")
    ap.add_argument("--heldout", action="store_true", help="only the rows of --prompts outside the head's training "
                    "sample (`sample_rows` in its mtp_head.json): the job's held-out rows")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--settings", default="plain,3,3l2", help="comma-separated: plain | DEPTH[lN][:attr=value...]")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace", action="store_true", help="CUDA: a kernel trace of one run of each of the first two settings")
    ap.add_argument("--trace-rows", type=int, default=1, help="rows in each traced run (the first ones)")
    ap.add_argument("--trace-settings", default="0,1", help="which settings --trace traces (indices into --settings)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs="+", metavar="TRACE", help="no run: saved traces (trace-N.json.gz) side by side, per round")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    if args.trace:
        try:
            import torch  # noqa: F401 (before MLX's first kernel, so CUPTI sees the whole context)
        except ImportError:
            print("--trace: torch is not installed; no trace", flush=True)
            args.trace = False
    import mlx.core as mx

    from mtplx.request import Request, SamplingParams

    from .common import device_name, table
    from .round_cost import real_setup, tiny_setup
    from .real_models import load_prompts

    settings = [parse_setting(s) for s in args.settings.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            bundle, head, prompts = tiny_setup(Path(tmp))
        else:
            bundle, head, _ = real_setup(args.model, args.head, None)
            prompts = load_prompts(args.prompts, bundle.tokenizer, 1000)
            if args.heldout:
                seen = set(json.loads((Path(head) / "mtp_head.json").read_text()).get("sample_rows", []))
                prompts = [p for i, p in enumerate(prompts) if i not in seen]
        reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=args.tokens))
                for i, p in enumerate(prompts[: args.rows])]
        print(f"device: {device_name()}; width {args.width}, {len(reqs)} rows x {args.tokens} tokens; "
              f"settings {args.settings}, {args.repeats} repeats interleaved", flush=True)
        engines = {}
        for s in settings:  # each warmed once: every program and kernel its runs need exists
            t0 = time.perf_counter()
            eng, restore = make_engine(bundle, head, s, args.width)
            engines[s[0]] = eng
            list(eng.generate(reqs))
            for mod, name, old in restore:
                setattr(mod, name, old)
            print(f"warm-up {s[0]}: {time.perf_counter() - t0:.2f} s", flush=True)
        runs = {s[0]: [] for s in settings}
        reference = None
        same = {s[0]: 0 for s in settings}
        for rep in range(args.repeats):
            for s in settings[rep % len(settings):] + settings[: rep % len(settings)]:  # rotated: no setting always runs first
                r = timed_run(engines[s[0]], reqs)
                texts = r.pop("texts")
                reference = reference or texts
                same[s[0]] += texts == reference
                runs[s[0]].append(r)
                print(f"repeat {rep + 1} {s[0]}: {r['tok/s']:.1f} tok/s, {r['ms/round']:.2f} ms/round", flush=True)
            plain_runs = runs[settings[0][0]] if settings[0][1] is None else None
            rows = [_summary(s[0], runs[s[0]], plain_runs) for s in settings]
            for row in rows:
                row["texts = first setting's"] = f"{same[row['setting']]}/{len(runs[row['setting']])}"
            print(table(rows), flush=True)
        result = {"device": device_name(), "args": vars(args), "runs": runs, "summary": rows}
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "round_trace.json").write_text(json.dumps(result, indent=1, default=str))
        if args.trace and mx.default_device().type == mx.DeviceType.gpu:
            for i in [int(x) for x in args.trace_settings.split(",")]:
                s = settings[i]
                save = None if not args.out else Path(args.out) / f"trace-{i}.json.gz"
                try:
                    t = trace(engines[s[0]], reqs[: args.trace_rows], save)
                except Exception as e:  # the timings above stand; say why there is no trace
                    print(f"trace {s[0]}: failed: {type(e).__name__}: {e}", flush=True)
                    continue
                result.setdefault("trace", {})[s[0]] = t
                top = list(t.get("by kernel", {}).items())[:14]
                print(f"trace {s[0]}: {t.get('kernels', 0)} kernels; per round: span {t.get('span us/step', 0):.0f} us, "
                      f"busy {t.get('busy us/step', 0):.0f}, idle {t.get('idle us/step', 0):.0f}; gaps {t.get('gap us/step by size')}",
                      flush=True)
                for name, k in top:
                    print(f"   {name}: {k['per step']} a round, {k['us/step']} us a round ({k['us each']} us each)", flush=True)
                for name, c in list(t.get("writes by size", {}).items())[:12]:
                    print(f"   {name} blocks: {c['per round']} a round ({c['us each']} us each)", flush=True)
                for name, c in list(t.get("runtime calls", {}).items())[:10]:
                    print(f"   host {name}: {c['per round']} a round, {c['us/round']} us a round", flush=True)
            if args.out:
                (Path(args.out) / "round_trace.json").write_text(json.dumps(result, indent=1, default=str))

if __name__ == "__main__":
    sys.exit(main())
