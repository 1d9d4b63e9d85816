"""The kernels of a one-stream decode step, counted on any backend, and (on CUDA) layer_kernels' check.

Count (CPU or GPU): the engine's compiled one-row plain step exactly as it builds it on CUDA
(CompiledVerifyBank's program over a RowKVCache shadow, stacked q/k/v and gate/up, rows_attention)
on a random-weight Qwen3 of the 8B shape's widths (one layer, then two, and a small vocabulary: the
difference is what a layer costs, the rest what a step costs once), traced, compiled by `mx.compile`, and its primitives counted by
name (`mx.export_to_dot`). On the CPU MLX expands its fast ops (RMSNorm, RoPE) into their
fallbacks, so the count puts a stand-in of its own name in each fast op's place and in the custom
kernels' (rows_attention, and with `--layer-kernels` layer_kernels.py's two), each one node as on
CUDA; views (reshape, slice, transpose, broadcast) launch nothing and are listed apart. Fused
elementwise groups show as `Compiled...`.

Check (`--check`, CUDA only): layer_kernels' kernels against the unfused MLX ops on the GPU over
several widths, head counts, lengths and offsets, bf16 / fp16 / fp32: bit-identical, max abs diff;
then each fused kernel's time against the ops it replaces (`kernel_times`: a compiled chain of 36).

    python -m benchmarks.step_kernels                                 # the count, default path
    python -m benchmarks.step_kernels --layer-kernels                 # ... and with layer_kernels
    python -m benchmarks.step_kernels --mlp-kernel                    # ... and with layer_kernels + mlp_kernel
    python -m benchmarks.step_kernels --check                         # on the H200
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter

import mlx.core as mx
import numpy as np

from mtplx import fusion, layer_kernels, mlp_kernel, o_norm_kernel, rows_attention
from mtplx.cache import BatchCache
from mtplx.generation import _Runtime
from mtplx.graphbank import CompiledVerifyBank

from .round_graph import VIEWS, graph_primitives

# stand-in primitive (one node, not elementwise: compile does not fuse it) -> the CUDA kernel it is
STAND_INS = {"CumMax": "RMSNorm (mx.fast.rms_norm)", "CumProd": "RoPE (mx.fast.rope)",
             "CumMin": "rows_attention (custom)", "CumSum": "add + RMSNorm (layer_kernels)",
             "CumLogAddExp": "q/k norm + RoPE (layer_kernels)", "Sort": "gate/up + SwiGLU (mlp_kernel)",
             "Partition": "product + add + RMSNorm (o_norm_kernel)"}
NAMES = {"Matmul": "matmul (weights)", "ScatterAxis": "KV cache write (put_along_axis)", "Gather": "embedding (take)",
         "Add": "residual add", "CompiledSigmoidMultiplyMultiply": "SiLU x mul (compile-fused)"}


@contextlib.contextmanager
def stand_ins(layer: bool):
    """The CUDA path's ops, one named node each, on any backend (values are not meaningful)."""
    saved = [(mx.fast, "rms_norm"), (mx.fast, "rope"), (rows_attention, "rows_attention"), (rows_attention, "cuda_ready"),
             (layer_kernels, "cuda_ready"), (layer_kernels, "add_rms_norm"), (layer_kernels, "qk_norm_rope"),
             (fusion, "stacking_pays"), (mlp_kernel, "cuda_ready"), (mlp_kernel, "swiglu_gemv"),
             (o_norm_kernel, "cuda_ready"), (o_norm_kernel, "o_add_norm")]
    saved = [(o, n, getattr(o, n)) for o, n in saved]

    def rope(x, dims, traditional=False, base=None, scale=1.0, offset=0, freqs=None):
        y = mx.cumprod(x, axis=-1)
        return mx.depends([y], [offset])[0] if isinstance(offset, mx.array) else y

    def qk(q, k, q_norm, k_norm, rope_, offset, n_q, n_kv):
        B, L, _ = q.shape
        qo = mx.depends([mx.logcumsumexp(q, axis=-1)], [k] + ([offset] if isinstance(offset, mx.array) else []))[0]
        ko = mx.depends([k], [qo])[0]
        return (qo.reshape(B, L, n_q, -1).transpose(0, 2, 1, 3), ko.reshape(B, L, n_kv, -1).transpose(0, 2, 1, 3))

    def add_norm(x, r, w, eps):
        h = mx.depends([mx.cumsum(x, axis=-1)], [r])[0]
        return h, h

    def swiglu_gemv(x, w):
        n = w.shape[0] // 2
        return mx.depends([mx.sort(w[:n, 0])], [x])[0].reshape(*x.shape[:-1], n)

    def o_add_norm(a, wo, x, w, eps):
        h = mx.depends([mx.partition(x, 0, axis=-1)], [a, wo, w])[0]
        return h, h

    mlp_kernel.cuda_ready = o_norm_kernel.cuda_ready = lambda: True
    mlp_kernel.swiglu_gemv = swiglu_gemv
    o_norm_kernel.o_add_norm = o_add_norm
    mx.fast.rms_norm = lambda x, w, eps: mx.cummax(x, axis=-1)
    mx.fast.rope = rope
    rows_attention.rows_attention = lambda q, k, v, scale, lengths: mx.depends([mx.cummin(q, axis=-1)], [k, v, lengths])[0]
    rows_attention.cuda_ready = layer_kernels.cuda_ready = fusion.stacking_pays = lambda: True
    layer_kernels.add_rms_norm, layer_kernels.qk_norm_rope = add_norm, qk
    try:
        yield
    finally:
        for o, n, v in saved:
            setattr(o, n, v)
        rows_attention.uninstall()


def step_primitives(layers: int, layer: bool, context: int = 100, mlp: bool = False, o_norm: bool = False) -> Counter:
    """Primitives of the compiled one-row plain step (the bank's program) of an 8B-width Qwen3."""
    from .engine_efficiency import SHAPES, random_qwen3

    shape = dict(SHAPES["8b"], num_hidden_layers=layers)
    SHAPES["_count"] = shape
    try:
        bundle = random_qwen3("_count", vocab=4096)
    finally:
        del SHAPES["_count"]
    model = bundle.model
    with stand_ins(layer):
        fusion.decode_paths(model, compiled=True, layer=layer, mlp=mlp, o_norm=o_norm)
        cache = BatchCache.for_model(model, 1)
        model(mx.zeros((1, context), dtype=mx.int32), cache=cache.layers)  # a prefilled row (eager)
        cache.commit(np.array([context]))
        cache.eval()
        bank = CompiledVerifyBank(_Runtime(model, want_hidden=False), max_verify_len=1, request_max_tokens=4 * context)
        seen = Counter()
        real = bank._program

        def program(key, kinds):
            fn = real(key, kinds)

            def call(*args):
                out = fn(*args)
                seen.update(graph_primitives(list(out)))
                return out
            return call

        bank._program = program
        bank.verify(mx.zeros((1, 1), dtype=mx.int32), cache)
        layer_kernels.uninstall(model)
        mlp_kernel.uninstall(model)
        fusion.unstack(model)
    return seen


def count_table(one: Counter, two: Counter, layers: int = 36) -> str:
    """Per layer (two layers' count minus one's), once per step, and a `layers`-layer step."""
    rows = ["| primitive | CUDA kernel | per layer | once per step | 36-layer step |", "|---|---|---|---|---|"]
    totals = [0, 0, 0]
    for name in sorted(set(one) | set(two), key=lambda k: (k in VIEWS, -two[k], k)):
        per = two[name] - one[name]
        fixed = one[name] - per
        what = STAND_INS.get(name) or NAMES.get(name) or ("view: no kernel" if name in VIEWS else name)
        rows.append(f"| {name} | {what} | {per} | {fixed} | {fixed + layers * per} |")
        if name not in VIEWS:
            totals = [totals[0] + per, totals[1] + fixed, totals[2] + fixed + layers * per]
    rows.append(f"| **kernels** | | **{totals[0]}** | **{totals[1]}** | **{totals[2]}** |")
    return "\n".join(rows)


# -- the GPU check ---------------------------------------------------------------------------------
def _diff(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    d = mx.abs(a - b).max().item()
    same = bool(mx.array_equal(a, b).item())
    return same, d


NORM_CASES = ((64, 3), (576, 5), (1024, 1), (1024, 7), (4096, 1), (4096, 4), (5120, 2), (12288, 1))
# (q heads, kv heads, head dim, rows, tokens, q/k norm, rope base, offsets: an int or per row)
QK_CASES = ((32, 8, 128, 1, 1, True, 1e6, 37), (32, 8, 128, 1, 1, True, 1e6, [1000]), (16, 8, 128, 1, 4, True, 1e6, [513]),
            (32, 8, 128, 3, 1, True, 1e6, [5, 300, 2047]), (32, 8, 128, 2, 8, True, 1e6, [0, 999]),
            (32, 8, 128, 1, 1, False, 1e6, 37), (9, 3, 64, 1, 1, False, 1e5, 77), (9, 3, 64, 2, 3, False, 1e5, [12, 4000]), (32, 8, 128, 1, 32, True, 1e6, 0))


def check(dtypes=("bfloat16", "float16", "float32"), version=None):
    """layer_kernels' kernels vs the unfused ops on this device (every case in bf16, two of each in
    fp16 / fp32: each new shape is a kernel build); rows for a table, printed as it goes. `version`:
    layer_kernels.VERSION for the check (default: as it is)."""
    import mlx.nn as nn

    saved = layer_kernels.VERSION
    layer_kernels.VERSION = version or saved
    try:
        return _check(dtypes, nn)
    finally:
        layer_kernels.VERSION = saved


def _check(dtypes, nn):
    v = f"v{layer_kernels.VERSION} "

    out, tried = [], set()
    for name in dtypes:
        dt = getattr(mx, name)
        few = name != "bfloat16"
        for D, rows in ((NORM_CASES[1], NORM_CASES[5]) if few else NORM_CASES):  # SmolLM2 (fp16 on CUDA), 8B
            x = mx.random.normal((1, rows, D)).astype(dt)
            r = (0.1 * mx.random.normal((1, rows, D))).astype(dt)
            w = (1 + 0.1 * mx.random.normal((D,))).astype(dt)
            h, y = layer_kernels.add_rms_norm(x, r, w, 1e-6)
            h0, y0 = layer_kernels.add_rms_norm_reference(x, r, w, 1e-6)
            (sh, dh), (sy, dy) = _diff(h, h0), _diff(y, y0)
            out.append({"check": f"{v}add_rms_norm {name} D={D} rows={rows}", "bit-identical": sh and sy, "max abs diff": max(dh, dy),
                        "parts": f"sum {'=' if sh else 'DIFFERS'}, norm {'=' if sy else 'DIFFERS'}"})
            print("layer_kernels", out[-1], flush=True)
            if not (sh and sy) and "add" not in tried:  # which way of writing the sum gives MLX's bits
                tried.add("add")
                h1, y1 = layer_kernels.add_rms_norm(x, r, w, 1e-6, acc=1)
                print("layer_kernels variant add_rms_norm acc=1 (no fma):", _diff(h1, h0)[0] and _diff(y1, y0)[0], flush=True)
        for (Hq, Hk, D, B, L, norm, base, offsets) in (QK_CASES[3:4] + QK_CASES[7:8] if few else QK_CASES):
            q = mx.random.normal((B, L, Hq * D)).astype(dt)
            k = mx.random.normal((B, L, Hk * D)).astype(dt)
            qn, kn = (nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)) if norm else (None, None)
            if norm:
                qn.weight = (1 + 0.1 * mx.random.normal((D,))).astype(dt)
                kn.weight = (1 + 0.1 * mx.random.normal((D,))).astype(dt)
            rope = nn.RoPE(D, traditional=False, base=base)
            off = offsets if isinstance(offsets, int) else mx.array(offsets, dtype=mx.int32)
            got = layer_kernels.qk_norm_rope(q, k, qn, kn, rope, off, Hq, Hk)
            ref = layer_kernels.qk_norm_rope_reference(q, k, qn, kn, rope, off, Hq, Hk)
            (sq, dq), (sk, dk) = _diff(got[0], ref[0]), _diff(got[1], ref[1])
            out.append({"check": f"{v}qk_norm_rope {name} Hq={Hq} Hk={Hk} D={D} B={B} L={L} norm={norm} offset={offsets}",
                        "bit-identical": sq and sk, "max abs diff": max(dq, dk),
                        "parts": f"q {'=' if sq else 'DIFFERS'}, k {'=' if sk else 'DIFFERS'}"})
            print("layer_kernels", out[-1], flush=True)
            if not (sq and sk) and "qk" not in tried:  # which fma placement gives MLX's bits
                tried.add("qk")
                for rot in range(4):
                    for acc in range(2) if norm else range(1):
                        if rot or acc:
                            v = layer_kernels.qk_norm_rope(q, k, qn, kn, rope, off, Hq, Hk, rot=rot, acc=acc)
                            print(f"layer_kernels variant qk_norm_rope rot={rot} acc={acc}:",
                                  _diff(v[0], ref[0])[0] and _diff(v[1], ref[1])[0], flush=True)
    return out


def kernel_times(layers: int = 36, iters: int = 20, version=None):
    """us per layer of the fused kernels against the ops they replace, one row of the 8B shape (bf16),
    each a compiled chain of `layers` dependent calls (as a step chains them); rows for a table."""
    saved = layer_kernels.VERSION
    layer_kernels.VERSION = version or saved
    try:
        return _kernel_times(layers, iters)
    finally:
        layer_kernels.VERSION = saved


def _kernel_times(layers, iters):
    import time

    import mlx.nn as nn

    dt, D, Hq, Hk, hd = mx.bfloat16, 4096, 32, 8, 128
    w = (1 + 0.1 * mx.random.normal((D,))).astype(dt)
    qn, kn = nn.RMSNorm(hd, eps=1e-6), nn.RMSNorm(hd, eps=1e-6)
    qn.weight, kn.weight = qn.weight.astype(dt), kn.weight.astype(dt)
    rope = nn.RoPE(hd, base=1e6)
    off = mx.array([300], dtype=mx.int32)

    def norm_chain(fn):
        def run(x, r):
            for _ in range(layers):
                x, r = fn(x, r, w, 1e-6)
            return x, r
        return run

    def qk_chain(fn):
        def run(q, k):
            for _ in range(layers):
                qo, ko = fn(q, k, qn, kn, rope, off, Hq, Hk)
                q, k = qo.reshape(1, 1, -1), ko.reshape(1, 1, -1)
            return q, k
        return run

    cases = [("add + RMSNorm", norm_chain, layer_kernels.add_rms_norm, layer_kernels.add_rms_norm_reference,
              [mx.random.normal((1, 1, D)).astype(dt), (0.1 * mx.random.normal((1, 1, D))).astype(dt)]),
             ("q/k norm + RoPE", qk_chain, layer_kernels.qk_norm_rope, layer_kernels.qk_norm_rope_reference,
              [mx.random.normal((1, 1, Hq * hd)).astype(dt), mx.random.normal((1, 1, Hk * hd)).astype(dt)])]
    out = []
    for name, chain, fused, ref, args in cases:
        row = {"kernel": f"v{layer_kernels.VERSION} {name}"}
        for label, fn in (("fused", fused), ("unfused", ref)):
            prog = mx.compile(chain(fn))
            mx.eval(prog(*args))
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                mx.eval(prog(*args))
                times.append(time.perf_counter() - t0)
            row[f"{label} us/layer"] = 1e6 * float(np.median(times)) / layers
        row["saved us/layer"] = row["unfused us/layer"] - row["fused us/layer"]
        out.append(row)
        print("layer_kernels timing", row, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer-kernels", action="store_true", help="count with mtplx/layer_kernels.py installed")
    ap.add_argument("--mlp-kernel", action="store_true", help="also count with mtplx/mlp_kernel.py (and layer_kernels), "
                    "then with o_norm_kernel too")
    ap.add_argument("--check", action="store_true", help="CUDA: layer_kernels against the unfused ops")
    ap.add_argument("--version", type=int, default=None, help="layer_kernels.VERSION to check (1 or 2)")
    args = ap.parse_args()
    if args.check:
        rows = check(version=args.version)
        bad = [r for r in rows if not r["bit-identical"]]
        print(f"layer_kernels check: {len(rows) - len(bad)}/{len(rows)} bit-identical", flush=True)
        kernel_times(version=args.version)
        return
    cases = ([(False, False, False)] + ([(True, False, False)] if args.layer_kernels or args.mlp_kernel else [])
             + ([(True, True, False), (True, True, True)] if args.mlp_kernel else []))
    for layer, mlp, o_norm in cases:
        one, two = step_primitives(1, layer, mlp=mlp, o_norm=o_norm), step_primitives(2, layer, mlp=mlp, o_norm=o_norm)
        what = ("with layer_kernels" if layer else "without layer_kernels") + (" and mlp_kernel" if mlp else "") + (
            " and o_norm_kernel" if o_norm else "")
        print(f"\n### the compiled one-row step, {what}\n")
        print(count_table(one, two), flush=True)


if __name__ == "__main__":
    main()
