"""How close MLX's one-row matmuls come to the HBM roofline, apart from everything else in a decode step.

Issue 20 asks for one-stream 8B decoding at >= 65% of the HBM roofline. A decode step is the weight
matmuls (most of the bytes) plus norms, RoPE, attention and the residual adds (most of the kernels).
This times the matmuls alone, over the 8B shape's real weight matrices (36 layers, bf16, q/k/v and
gate/up stacked as the engine runs them, and the vocabulary head), chained layer after layer as a step
chains them, eager and compiled, so the gap between this and a whole step is what the other kernels
and the gaps between launches cost:

    python -m benchmarks.gemv_bandwidth --shape 8b --rows 1,4 --repeats 20
    python -m benchmarks.gemv_bandwidth --shape 0.6b --rows 1 --repeats 5   # CPU dry run

It prints, per row count, ms per chained pass, GB/s over the weight bytes, and that as a share of the
device's peak (--peak-gbs, 4800 for an H200's HBM3e).
"""
from __future__ import annotations

import argparse
import time

import mlx.core as mx

from benchmarks.engine_efficiency import SHAPES


def layer_weights(shape: dict, dtype) -> list[mx.array]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    d = shape["head_dim"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * d
    o_in = shape["num_attention_heads"] * d
    scale = 0.02
    return [(scale * mx.random.normal((n, k))).astype(dtype) for n, k in ((qkv, h), (h, o_in), (2 * i, h), (h, i))]


def mlx_matmul(x, w):
    return x @ w.T


def chain(layers, head, x, mm=mlx_matmul):
    """x [R, hidden] through every layer's four matmuls `mm(x, w)` = x @ w.T (each output cut to feed
    the next), then the head."""
    h = x
    for qkv, o, gate_up, down in layers:
        a = mm(h, qkv)
        h = mm(a[:, : o.shape[1]], o)
        g = mm(h, gate_up)
        h = mm(g[:, : down.shape[1]], down)
    return mm(h, head)


def time_pass(fn, x, repeats):
    mx.eval(fn(x))  # warm: kernel builds
    mx.eval(fn(x))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn(x))
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", help="engine_efficiency.SHAPES key")
    ap.add_argument("--rows", default="1,4", help="row counts (the M of each matmul)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the device's memory bandwidth, GB/s")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    shape = SHAPES[args.shape]
    layers = [layer_weights(shape, dtype) for _ in range(shape["num_hidden_layers"])]
    head = (0.02 * mx.random.normal((args.vocab, shape["hidden_size"]))).astype(dtype)
    mx.eval(layers, head)
    nbytes = sum(w.nbytes for ws in layers for w in ws) + head.nbytes
    print(f"{args.shape}: {len(layers)} layers, {nbytes / 1e9:.2f} GB of weights, {mx.default_device()}, {args.dtype}")
    print("| rows | path | ms / pass | GB/s | % of peak | matmuls / pass |")
    print("|---|---|---|---|---|---|")
    compiled = mx.compile(lambda x: chain(layers, head, x))
    for r in (int(v) for v in args.rows.split(",")):
        x = (0.02 * mx.random.normal((r, shape["hidden_size"]))).astype(dtype)
        for name, fn in (("eager", lambda x: chain(layers, head, x)), ("compiled", compiled)):
            s = time_pass(fn, x, args.repeats)
            gbs = nbytes / s / 1e9
            print(f"| {r} | {name} | {1e3 * s:.3f} | {gbs:,.0f} | {100 * gbs / args.peak_gbs:.1f} | {4 * len(layers) + 1} |", flush=True)


if __name__ == "__main__":
    main()
