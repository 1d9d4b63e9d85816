"""mtplx/skinny_matmul.py on the GPU: bit-identity across row counts, error against MLX, speed against MLX.

One command, printing as it goes, failing loudly (exit 1, the case named) at the first broken check:

    python -m benchmarks.skinny_check                 # the H200: ~1-1.5 min (kernel builds included)
    python -m benchmarks.skinny_check --reference --small   # CPU dry run: the script's own logic,
                                                            # per-row MLX products standing in for the kernel

1. identity: for each matrix (the 8B shape's q/k/v and gate/up stacked, o, down, the 151,936-row
   head; odd shapes: N not a multiple of a warp's columns, the SmolLM2 / Qwen K = 576, 896, 1536,
   fp16, a bias), rows 0..M-1 of an M-row product equal the first M rows of the 8-row product and
   each row computed alone, bit for bit, for M = 1..8; every tiling (R, U) gives the same bits; a 3-D
   input, an input at an odd offset, a row view of the weight (a stacked sibling's), and the product
   inside mx.compile too.
2. error: max |kernel - fp32 product| / max |fp32 product|, beside MLX's own `x @ W.T`'s.
3. speed: ms and GB/s per matrix at M = 1 and 4, MLX vs the kernel (and each tiling), weights cycled
   through copies that outgrow the L2 cache; then the 36-layer chained pass of benchmarks/gemv_bandwidth
   (eager and compiled) with MLX, MLX with the cut activations copied (what the kernel's contiguous
   input costs at M > 1), and the kernel.
4. engine: the random 0.6B shape (tied head) with the kernel installed, greedy plain decoding vs prompt
   lookup at depth 3, width 1 (compiled verify): the same tokens (--engine-baseline: also without it).

--match-mlx checks skinny_matmul.MATCH_MLX instead (MLX's gemv's split of K: every row must also equal
MLX's own one-row product; one-row steps then keep MLX's gemv, so the engine check compares MLX's plain
steps with the kernel's 4-row verifies):

    python3 -m benchmarks.skinny_check --match-mlx --skip chain   # ~1.5 min on the H200
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import mlx.core as mx

from benchmarks.engine_efficiency import SHAPES
from benchmarks.gemv_bandwidth import chain, layer_weights, time_pass
from mtplx import skinny_matmul as sk

TILES = ((1, 2), (1, 4), (2, 2), (4, 2))  # checked for the same bits
# timed (which is fastest per shape): (R, U) at 8 warps a block, or (R, U, warps a block)
TIMED_TILES = ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (1, 4, 4), (2, 2, 4))
# (label, N, K, dtype, bias, rows checked)
ALL_ROWS = tuple(range(1, sk.MAX_ROWS + 1))
CASES = [
    ("8b qkv", 6144, 4096, "bfloat16", False, ALL_ROWS),
    ("8b o", 4096, 4096, "bfloat16", False, ALL_ROWS),
    ("8b gate_up", 24576, 4096, "bfloat16", False, ALL_ROWS),
    ("8b down", 4096, 12288, "bfloat16", False, ALL_ROWS),
    ("8b head", 151936, 4096, "bfloat16", False, ALL_ROWS),
    ("smollm2 head+1", 49153, 576, "bfloat16", False, ALL_ROWS),
    ("odd N 1001 x 576", 1001, 576, "bfloat16", False, ALL_ROWS),
    ("qwen0.5b gate_up", 9728, 896, "bfloat16", False, (1, 3)),
    ("fp16 1537 x 1536", 1537, 1536, "float16", False, (1, 3)),
    ("bias 1151 x 896", 1151, 896, "bfloat16", True, (1, 3)),
]
TIMED = ["8b qkv", "8b o", "8b gate_up", "8b down", "8b head", "smollm2 head+1"]
MAX_REL_ERR = 8e-3  # bf16 output rounding is 2^-9 of each value; fp32 sums in another order add little


class Failed(Exception):
    pass


def fail(case, what):
    raise Failed(f"{case}: {what}")


def per_row_reference(x, w, bias=None, tiles=None):
    """The kernel's contract in MLX ops (each output its own fp32 sum over K, rounded once), for the
    CPU dry run (small shapes only: it forms the M x N x K products)."""
    k = w.shape[-1]
    rows = x.reshape(-1, k).astype(mx.float32)
    y = (rows[:, None, :] * w.astype(mx.float32)[None]).sum(axis=-1)
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.astype(w.dtype).reshape(*x.shape[:-1], w.shape[0])


def check_identity(label, w, bias, rows, mm, against_mlx=False):
    k = w.shape[1]
    x8 = mx.random.normal((sk.MAX_ROWS, k)).astype(w.dtype)
    full = mm(x8, w, bias)
    mx.eval(full)
    for m in rows:
        got = mm(x8[:m], w, bias)
        if not mx.array_equal(got, full[:m]).item():
            fail(label, f"rows 0..{m - 1} of the {m}-row product differ from the 8-row product's "
                        f"(max diff {mx.abs(got.astype(mx.float32) - full[:m].astype(mx.float32)).max().item():.3g})")
    for i in range(sk.MAX_ROWS):
        if not mx.array_equal(mm(x8[i:i + 1], w, bias), full[i:i + 1]).item():
            fail(label, f"row {i} computed alone differs from the same row of the 8-row product")
    for t in TILES:
        if not mx.array_equal(mm(x8[:4], w, bias, tiles=t), full[:4]).item():
            fail(label, f"tiles (R, U) = {t} give other bits than the default {sk.tile(w.shape[0], 4)}")
    if not mx.array_equal(mm(x8[None, :4], w, bias), full[None, :4]).item():
        fail(label, "a [1, 4, K] input gives other bits than [4, K]")
    wide = mx.random.normal((1, k + 3)).astype(w.dtype)
    odd = wide[:, 3:]  # a view 3 elements in: the kernel's unaligned x path (or MLX's copy)
    if not mx.array_equal(mm(odd, w, bias), mm(mx.array(odd) + 0, w, bias)).item():
        fail(label, "an input at an odd offset gives other bits than its copy")
    n = w.shape[0]
    a, b = n // 3, n // 3 + max(1, n // 4)  # a stacked sibling's rows: a view of the stacked weight
    part = mm(x8[:4], w[a:b], bias[a:b] if bias is not None else None)
    if not mx.array_equal(part, full[:4, a:b]).item():
        fail(label, f"the weight's rows {a}..{b - 1} (a view) give other bits than the same columns of the whole")
    if against_mlx:  # MATCH_MLX: every row equals MLX's own one-row product (its gemv)
        for i in range(sk.MAX_ROWS):
            ref = x8[i:i + 1] @ w.T
            if not mx.array_equal(full[i:i + 1], ref).item():
                d = mx.abs(full[i:i + 1].astype(mx.float32) - ref.astype(mx.float32)).max().item()
                fail(label, f"row {i} differs from MLX's one-row product x[{i}] @ W.T (max diff {d:.3g}; chunk {sk.chunk(w.shape[1])})")
    compiled = mx.compile(lambda a: mm(a, w, bias))
    if not mx.array_equal(compiled(x8[:4]), full[:4]).item():
        fail(label, "inside mx.compile the product gives other bits")
    return x8, full


def rel_err(x, w, bias, y):
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    if bias is not None:
        ref = ref + bias.astype(mx.float32)
    return (mx.abs(y.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()


def per_call_ms(fn, x, weights, repeats=5, calls=48):
    """Median over `repeats` of one eval of `calls` products cycling through `weights` (copies that
    together outgrow the L2 cache), per product."""
    seq = [weights[i % len(weights)] for i in range(calls)]
    mx.eval([fn(x, w) for w in seq[: len(weights)]])  # warm: kernel builds
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval([fn(x, w) for w in seq])
        times.append((time.perf_counter() - t) / calls)
    times.sort()
    return 1e3 * times[len(times) // 2]


def timing(label, w, mm, peak, out, calls):
    copies = [w] + [mx.array(w) + 0 for _ in range(max(0, min(7, math.ceil(400e6 / w.nbytes) - 1)))][: calls - 1]
    mx.eval(copies)
    paths = [("mlx", lambda a, v: a @ v.T), ("skinny", lambda a, v: mm(a, v, None))]
    paths += [(f"skinny R,U={t}", (lambda t: lambda a, v: mm(a, v, None, tiles=t))(t)) for t in TIMED_TILES]
    for m in (1, 4):
        x = mx.random.normal((m, w.shape[1])).astype(w.dtype)
        for name, fn in paths:
            ms = per_call_ms(fn, x, copies, calls=calls)
            gbs = w.nbytes / ms / 1e6
            out.append((label, m, name, ms, 100 * gbs / peak))
            print(f"| {label} | {w.shape[0]} x {w.shape[1]} | {m} | {name} | {ms:.4f} | {gbs:,.0f} | {100 * gbs / peak:.1f} |", flush=True)


def best_tiles(rows):
    """Per matrix and M: MLX, the default tiling, and the fastest tiling (what tile() should pick)."""
    print("| matrix | M | mlx ms | default ms | fastest tiling | its ms | % of peak | x mlx |\n|---|---|---|---|---|---|---|---|")
    for label, m in dict.fromkeys((r[0], r[1]) for r in rows):
        got = {name: (ms, pct) for lab, mm_, name, ms, pct in rows if (lab, mm_) == (label, m)}
        best = min((n for n in got if n.startswith("skinny R,U")), key=lambda n: got[n][0])
        print(f"| {label} | {m} | {got['mlx'][0]:.4f} | {got['skinny'][0]:.4f} | {best[len('skinny R,U='):]} | "
              f"{got[best][0]:.4f} | {got[best][1]:.1f} | {got['mlx'][0] / got[best][0]:.2f} |", flush=True)


def chained(shape_name, mm, peak, repeats, vocab):
    shape = SHAPES[shape_name]
    dtype = mx.bfloat16
    layers = [layer_weights(shape, dtype) for _ in range(shape["num_hidden_layers"])]
    head = (0.02 * mx.random.normal((vocab, shape["hidden_size"]))).astype(dtype)
    mx.eval(layers, head)
    nbytes = sum(v.nbytes for ws in layers for v in ws) + head.nbytes
    print(f"chained pass: {shape_name}, {len(layers)} layers, {nbytes / 1e9:.2f} GB")
    print("| rows | matmul | path | ms / pass | GB/s | % of peak |\n|---|---|---|---|---|---|", flush=True)
    fns = {"mlx": lambda a, v: a @ v.T, "mlx (cut copied)": lambda a, v: mx.contiguous(a) @ v.T,
           "skinny": lambda a, v: mm(a, v, None)}
    for r in (1, 4):
        x = (0.02 * mx.random.normal((r, shape["hidden_size"]))).astype(dtype)
        outs = {}
        for name, f in fns.items():
            eager = (lambda f: lambda a: chain(layers, head, a, f))(f)
            for path, fn in (("eager", eager), ("compiled", mx.compile(eager))):
                s = time_pass(fn, x, repeats)
                gbs = nbytes / s / 1e9
                print(f"| {r} | {name} | {path} | {1e3 * s:.3f} | {gbs:,.0f} | {100 * gbs / peak:.1f} |", flush=True)
            outs[name] = chain(layers, head, x, f)
        err = (mx.abs(outs["skinny"].astype(mx.float32) - outs["mlx"].astype(mx.float32)).max()
               / mx.abs(outs["mlx"].astype(mx.float32)).max()).item()
        print(f"  rows {r}: chained output, kernel vs MLX: max rel diff {err:.3g}", flush=True)
    del layers, head


def engine_check(shape_name, tokens, baseline=False):
    """Greedy plain decoding vs prompt lookup at depth 3, width 1 (compiled verify), with the kernel:
    the same tokens (fails otherwise). With `baseline`, the same without the kernel first, for
    comparison (MLX's gemv at one row and its matmul at four need not agree bit for bit: reported,
    not failed)."""
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.request import Request, SamplingParams

    from benchmarks.engine_efficiency import random_qwen3

    bundle = random_qwen3(shape_name)
    prompt = [5, 6, 7, 8, 9] * 8
    old = Engine.use_skinny_matmul
    try:
        for on in (False, True) if baseline else (True,):
            Engine.use_skinny_matmul = on
            sk.uninstall(bundle.model)
            outs = {}
            for method in ("none", "ngram"):
                eng = Engine(bundle, SpeculativeConfig(method=method, depth=3, adaptive_depth=False), ScheduleConfig(max_batch=1))
                eng.eos = set()
                (res,) = list(eng.generate([Request(key=0, prompt_tokens=prompt, params=SamplingParams(max_tokens=tokens))]))
                outs[method] = list(res.tokens)
                print(f"engine {shape_name} {method}: {eng.decode_paths}, {len(res.tokens)} tokens, {eng.counters['rounds']} rounds", flush=True)
            diff = [i for i, (a, b) in enumerate(zip(outs["none"], outs["ngram"])) if a != b]
            what = f"kernel {'on' if on else 'off'}: prompt lookup " + (
                f"== plain decoding ({tokens} tokens)" if not diff else f"differs from plain decoding from token {diff[0]}")
            print(f"engine {shape_name} {what}", flush=True)
            if diff and on:
                fail(f"engine {shape_name}", what)
    finally:
        Engine.use_skinny_matmul = old
        sk.uninstall(bundle.model)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", action="store_true", help="CPU dry run: per-row MLX products stand in for the kernel")
    ap.add_argument("--small", action="store_true", help="dry run sizes: no 8B matrices, the tiny chain")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: identity, timing, chain, engine")
    ap.add_argument("--match-mlx", action="store_true",
                    help="skinny_matmul.MATCH_MLX: MLX's gemv's split (checked: every row == MLX's one-row product; one-row "
                         "steps keep MLX's gemv, the engine check's plain steps too)")
    ap.add_argument("--engine-baseline", action="store_true", help="the engine check also without the kernel (two more engines)")
    ap.add_argument("--repeats", type=int, default=10, help="timed passes of the chain")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's memory bandwidth, GB/s (H200: 4800)")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    sk.MATCH_MLX = args.match_mlx
    mx.random.seed(0)
    if args.reference:
        mm = per_row_reference
    elif sk.cuda_ready():
        mm = sk.skinny_matmul
    else:
        sys.exit("skinny_check: the kernel needs MLX's CUDA backend (here: none); --reference runs the dry run")
    cases = [c for c in CASES if not (args.small and c[1] * c[2] > 2e6)]
    print(f"{mx.default_device()}, mlx {mx.__version__}, {'reference (dry run)' if args.reference else 'kernel'}"
          f"{', MATCH_MLX' if sk.MATCH_MLX else ''}", flush=True)
    t0 = time.perf_counter()
    timed_rows = []
    try:
        mats = {}
        for label, n, k, dt, with_bias, rows in cases:
            dtype = getattr(mx, dt)
            w = (0.02 * mx.random.normal((n, k))).astype(dtype)
            bias = mx.random.normal((n,)).astype(dtype) if with_bias else None
            mats[label] = w
            if "identity" in skip:
                continue
            x8, full = check_identity(label, w, bias, rows, mm, against_mlx=sk.MATCH_MLX and not args.reference and not with_bias)
            err, err_mlx = rel_err(x8, w, bias, full), rel_err(x8, w, bias, x8 @ w.T + (bias if with_bias else 0))
            same_as_mlx = "every row == MLX's one-row product, " if sk.MATCH_MLX and not args.reference and not with_bias else ""
            print(f"ok {label:18s} [{n} x {k}] {dt}{' +bias' if with_bias else ''}: {same_as_mlx}bit-identical at M = {','.join(map(str, sorted(set(rows) | {1, 4, 8})))}, "
                  f"each tiling, 3-D, odd offset, row view, compiled; max rel err {err:.2e} (MLX's {err_mlx:.2e})  "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            if err > MAX_REL_ERR:
                fail(label, f"max relative error {err:.3g} > {MAX_REL_ERR}")
        if "timing" not in skip:
            print("| matrix | N x K | M | path | ms | GB/s | % of peak |\n|---|---|---|---|---|---|---|", flush=True)
            for label in TIMED if not args.small else list(mats)[:1]:
                if label in mats:
                    timing(label, mats[label], mm, args.peak_gbs, timed_rows, 4 if args.small else 48)
            best_tiles(timed_rows)
        mats = None
        if "chain" not in skip:
            chained("tiny" if args.small else "8b", mm, args.peak_gbs, args.repeats, 4096 if args.small else 151936)
        if "engine" not in skip:
            engine_check("tiny" if args.small else "0.6b", 48, args.engine_baseline)
    except Failed as e:
        print(f"SKINNY CHECK FAILED: {e}", flush=True)
        sys.exit(1)
    except Exception as e:  # a kernel that does not build or launch: the traceback names the call
        print(f"SKINNY CHECK FAILED ({type(e).__name__}): {e}", flush=True)
        raise
    print(f"skinny check passed in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
