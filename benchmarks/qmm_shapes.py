"""Which MLX kernel serves a quantized product of SmolLM2-135M's shapes, by row layout and padded or not, at what cost.

MLX's CUDA qmm kernels take M = x.shape[-2] and run the other leading axes as a batch of the grid, so the
engine's x [W, L, K] (a plain step at width W is [W, 1, K], a depth-3 verify [W, 4, K]) is W products of L rows;
mtplx/qmm_rows.py runs it as one [W * L, K] matrix. Their qmm_sm80 (tensor cores) takes only output widths N
that are multiples of 128, so SmolLM2's 576 / 192 / 960 get qmm_naive; padding N to 128 with zero rows was the
first guess. This times, for each product shape of the model (4-bit, groups of 32, fp16, as its Q4_1 GGUF
loads) and each row layout ([W, L, K] and the same rows as one [rows, K] matrix), unpadded against padded
(sliced to N):
- the kernel each ran (torch.profiler / CUPTI, where torch imports) and its device microseconds;
- the wall microseconds a product of a chain of `--chain` evaluated together (median of --repeats);
- whether the padded product's first N outputs equal the unpadded one's bit for bit, and whether each
  product's first 8 rows are the same bits whatever the layout (plain step vs verify: greedy speculation
  stays token-identical only where they are);
- for the stacked siblings (q/k/v, gate/up) whether the stacked product's parts equal the siblings' own.

    python -m benchmarks.qmm_shapes --repeats 20          # the H200 (benchmarks/gpu_mtp.sh has no step for it)
    python -m benchmarks.qmm_shapes --repeats 2 --chain 2 --layouts 8x1,2x4   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

# SmolLM2-135M: hidden 576, 9 query heads / 3 KV heads of 64, MLP 1536
# (N, K, bits): its projections 4-bit, the tied vocabulary head (Q8_0 embeddings) 8-bit
SHAPES = {"q": (576, 576, 4), "k/v": (192, 576, 4), "qkv (stacked)": (960, 576, 4), "o": (576, 576, 4),
          "gate/up": (1536, 576, 4), "gate_up (stacked)": (3072, 576, 4), "down": (576, 1536, 4), "vocab": (49152, 576, 8)}
STACKS = {"qkv (stacked)": [576, 192, 192], "gate_up (stacked)": [1536, 1536]}
LAYOUTS = "8x1,32x1,8x4,32x4,8,32,128"  # WxL: [W, L, K]; N: [N, K]
GROUP = 32


def padded_width(n: int) -> int:
    return -(-n // 128) * 128  # qmm_sm80's output tile


def quantized(n, k, bits, seed):
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.float16) * 0.05
    wq, s, b = mx.quantize(w, GROUP, bits)
    return wq, s.astype(mx.float16), b.astype(mx.float16)


def pad_rows(arrays, n_to):
    return tuple(mx.concatenate([a, mx.zeros((n_to - a.shape[0],) + a.shape[1:], a.dtype)]) for a in arrays)


def product(x, arrays, n=None):
    bits = arrays[0].shape[-1] * 32 // x.shape[-1]  # (packed uint32 words a row)
    y = mx.quantized_matmul(x, *arrays, transpose=True, group_size=GROUP, bits=bits)
    return y if n is None or n == y.shape[-1] else y[..., :n]


def layout_x(xs, spec, k):
    """The first W * L rows of xs [128, K] shaped as the layout: 'WxL' -> [W, L, K], 'N' -> [N, K]."""
    if "x" in spec:
        w, l = (int(v) for v in spec.split("x"))
        return xs[: w * l].reshape(w, l, k)
    return xs[: int(spec)]


def wall_us(fn, chain, repeats):
    mx.eval([fn() for _ in range(chain)])  # warm: kernel builds, buffers
    times = []
    for _ in range(repeats):
        outs = [fn() for _ in range(chain)]
        t = time.perf_counter()
        mx.eval(outs)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times) / chain


def profiled(cases, chain):
    """Each case's kernels under torch.profiler: [(names, mean us)] in case order, or None without torch."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None
    prof = profile(activities=[ProfilerActivity.CUDA])
    mx.synchronize()
    prof.start()
    for fn in cases:
        mx.eval([fn() for _ in range(chain)])
        mx.synchronize()
    prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    if len(kernels) != chain * len(cases):  # (something else ran a kernel: names by position would lie)
        print(f"profile: {len(kernels)} kernels for {chain * len(cases)} products; per-case kernel names not given")
        return None
    out = []
    for i in range(len(cases)):
        ks = kernels[i * chain:(i + 1) * chain]
        names = sorted({k["name"].split("<")[0].split("(")[0].replace("mlx::core::cu::", "") for k in ks})
        out.append((",".join(names), statistics.mean(k.get("dur", 0) for k in ks)))
    return out


def same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(np.array(a), np.array(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=LAYOUTS, help="row layouts: WxL ([W, L, K], as the engine calls) or N ([N, K])")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="product shapes (names of SHAPES)")
    ap.add_argument("--chain", type=int, default=40, help="products evaluated together (one timing)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    print(f"device: {mx.default_device()}; groups of {GROUP}, fp16; chain {args.chain}, {args.repeats} repeats")
    layouts = args.layouts.split(",")
    rows, cases, checks = [], [], []
    for si, name in enumerate(args.shapes.split(",")):
        n, k, bits = SHAPES[name]
        arrays = quantized(n, k, bits, si)
        n_pad = padded_width(n)
        padded = pad_rows(arrays, n_pad) if n_pad != n else None
        xs = mx.random.normal((128, k), key=mx.random.key(100 + si)).astype(mx.float16)
        mx.eval(arrays, padded, xs)
        first_rows = {}
        for spec in layouts:
            x = layout_x(xs, spec, k)
            m = x.size // k
            u = product(x, arrays)
            first_rows.setdefault("unpadded", []).append(u.reshape(-1, n)[:8])
            variants = [("unpadded", arrays, None)] + ([("padded", padded, n)] if padded is not None else [])
            agree = "-"
            if padded is not None:
                p = product(x, padded, n)
                first_rows.setdefault("padded", []).append(p.reshape(-1, n)[:8])
                agree = "same" if same(u, p) else "differ"
                full = product(x, padded)
                assert not np.any(np.array(full[..., n:])), "padded rows must give exact zeros"
            for label, arr, cut in variants:
                fn = (lambda x=x, arr=arr, cut=cut: product(x, arr, cut))
                cases.append(fn)
                rows.append({"shape": name, "N": n, "K": k, "bits": bits, "layout": spec, "rows": m, "variant": label,
                             "N run": arr[0].shape[0], "wall us": wall_us(fn, args.chain, args.repeats),
                             "padded = unpadded": agree})
        for label, outs in first_rows.items():
            checks.append({"shape": name, "check": f"{label}: the first 8 rows' bits in every layout",
                           "same": all(same(outs[0], o) for o in outs[1:])})
        if name in STACKS:  # the stacked product's parts against each sibling's own product (same values, new arrays)
            x = layout_x(xs, "32x4", k)
            stacked = product(x, padded, n) if padded is not None else product(x, arrays)
            a = 0
            for part in STACKS[name]:
                own = product(x, tuple(t[a:a + part] for t in arrays))
                checks.append({"shape": name, "check": f"32x4: the stacked product's outputs {a}:{a + part} vs that "
                               "sibling's own product", "same": same(stacked[..., a:a + part], own)})
                a += part
    prof = profiled(cases, min(args.chain, 8))
    for r, p in zip(rows, prof or []):
        r["kernel"], r["device us"] = p[0], round(p[1], 2)
    cols = ["shape", "N", "K", "bits", "layout", "rows", "variant", "N run", "kernel", "device us", "wall us", "padded = unpadded"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r.get(c, '-'):.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols) + " |")
    print()
    print("| shape | check | same bits |")
    print("|---|---|---|")
    for c in checks:
        print(f"| {c['shape']} | {c['check']} | {c['same']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
