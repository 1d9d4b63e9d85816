"""rows_attention on CUDA (mtplx/rows_attention.py): the same bits for a query whatever shares its
call, MLX's kernel's bits on the row's exact keys, and what a call costs against the other paths.

    timeout 90 python3 -m benchmarks.attn_check         # H200: all of it, printing as it goes
    python -m benchmarks.attn_check --dry               # CPU: the script only (the kernel replaced by
                                                        # the masked reference: says nothing of the kernel)

Per case (B rows, H_q / H_kv heads, head dim D, L queries, ragged lengths, dtype):
  chunks     every block chunk (1 query a block: MLX's layout and the kernel before chunks; split()'s;
             3; CHUNK_MOST) gives the same bits
  alone      query i of the L-query call == that query alone (L = 1 at length + i: the plain step)
  vs MLX     each query against mx.fast.scaled_dot_product_attention over its row's exact keys:
             how many are bit-identical (all, up to 1024 keys: MLX's one-pass kernel) and the
             largest difference (within TOL past 1024, where MLX sums in two passes); where rows
             share a length, also MLX over a slice of the cache (the plain step's path then; MLX may
             take cuDNN there past 256 keys: reported, not a failure)
Timing, SmolLM2-135M's attention (9 / 3 heads, D 64) then Qwen3-8B's (32 / 8, D 128), bf16, 250 keys
a row in a 512 bucket: microseconds a call, as a compiled chain of 30 calls (a layer each), the
median of REPEATS evals: `c=N` (rows_attention with N queries a block; c=1, a block per query, is
the layout before chunks), `split` (the chunk split() picks), `masked` (MLX's attention over the
bucket under the boolean mask:
what runs without rows_attention), `mlx exact` (MLX's attention over exactly the keys, all rows one
length: the path of a step whose rows share a length).
Exits 1 naming every failed case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from mtplx.kernels import rows_attention as ra
from mtplx.cache import capacity_bucket

from .common import table

SCALE = 0.125
TOL = {mx.bfloat16: 2e-2, mx.float16: 4e-3, mx.float32: 1e-5}
BITS = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}


def ragged(B, lo, hi):
    return [lo + (i * 97) % (hi - lo) for i in range(B)]


# name, B, H_q, H_kv, D, L, lengths, dtype
CASES = [
    ("smollm2 width 32, depth-3 verify", 32, 9, 3, 64, 4, ragged(32, 40, 400), mx.bfloat16),
    ("smollm2 width 32, plain step", 32, 9, 3, 64, 1, ragged(32, 40, 400), mx.bfloat16),
    ("smollm2 width 1, depth-3 verify", 1, 9, 3, 64, 4, [300], mx.bfloat16),
    ("smollm2 width 8, depth-7 verify", 8, 9, 3, 64, 8, ragged(8, 5, 700), mx.bfloat16),
    ("qwen3-8b width 8, depth-3 verify", 8, 32, 8, 128, 4, ragged(8, 100, 900), mx.bfloat16),
    ("D 96 fp16, 4 heads a KV head", 4, 16, 4, 96, 3, ragged(4, 30, 500), mx.float16),
    ("fp32, no GQA", 4, 8, 8, 64, 2, ragged(4, 1, 300), mx.float32),
    ("past 1024 keys", 2, 8, 2, 128, 4, [1500, 1900], mx.bfloat16),
]


def reference(q, k, v, scale, lengths, per_block=None):
    """The masked path: MLX's attention over the bucket under each row's causal mask."""
    L, cap = q.shape[2], k.shape[2]
    limit = lengths.astype(mx.int32)[:, None, None, None] + mx.arange(L)[None, None, :, None]
    mask = mx.arange(cap)[None, None, None, :] <= limit
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def inputs(B, Hq, Hk, D, L, lengths, dtype, seed=0):
    mx.random.seed(seed)
    cap = capacity_bucket(max(lengths) + L)
    q = mx.random.normal((B, Hq, L, D)).astype(dtype)
    k = mx.random.normal((B, Hk, cap, D)).astype(dtype)
    v = mx.random.normal((B, Hk, cap, D)).astype(dtype)
    return q, k, v, mx.array(lengths, dtype=mx.int32)


def same_bits(a, b, dtype) -> bool:
    return bool(mx.all(a.view(BITS[dtype]) == b.view(BITS[dtype])).item())


def layouts(attn, q, k, v, lens, got, dtype) -> list[str]:
    """rows_attention on views laid out as the model hands them (q a transposed slice of a wider
    [B, L, *] projection, as after a stacked q/k/v product and RoPE; k / v a slice of more heads), with
    ra.STRIDED on and off: the names of those whose bits differ from `got` (contiguous inputs)."""
    B, Hq, L, D = q.shape
    Hk = k.shape[1]
    wide = mx.concatenate([q.transpose(0, 2, 1, 3).reshape(B, L, Hq * D), mx.zeros((B, L, 3 * D), q.dtype)], axis=-1)
    q_view = wide[..., : Hq * D].reshape(B, L, Hq, D).transpose(0, 2, 1, 3)
    k_view = mx.concatenate([k, k[:, :1]], axis=1)[:, :Hk]
    v_view = mx.concatenate([v, v[:, :1]], axis=1)[:, :Hk]
    was, bad = ra.STRIDED, []
    try:
        for strided in (True, False):
            ra.STRIDED = strided
            for label, args in (("q view", (q_view, k, v)), ("k/v views", (q, k_view, v_view)),
                                ("all views", (q_view, k_view, v_view)), ("contiguous", (q, k, v))):
                out = attn(*args, SCALE, lens)
                if not same_bits(out, got, dtype):
                    bad.append(f"{label} (STRIDED={int(strided)})")
    finally:
        ra.STRIDED = was
    return bad


def check(attn, name, B, Hq, Hk, D, L, lengths, dtype) -> list[str]:
    """Prints the case's row; returns what failed."""
    t0 = time.perf_counter()
    q, k, v, lens = inputs(B, Hq, Hk, D, L, lengths, dtype)
    fails = []
    split = ra.split(B, Hk, Hq // Hk * L, D)[0]
    chunks = sorted({1, 3, split, ra.CHUNK_MOST[D]} & set(range(1, min(Hq // Hk * L, ra.CHUNK_MOST[D]) + 1)))
    outs = {c: attn(q, k, v, SCALE, lens, per_block=c) for c in chunks}
    got = outs[split]
    mx.eval(list(outs.values()))
    differ = [c for c in chunks if not same_bits(outs[c], got, dtype)]
    if differ:
        fails.append(f"{name}: chunks {differ} differ from split's {split}")
    alone_bad = [i for i in range(L) if not same_bits(attn(q[:, :, i:i + 1], k, v, SCALE, lens + i), got[:, :, i:i + 1], dtype)]
    if alone_bad:
        fails.append(f"{name}: queries {alone_bad} differ from the same query alone (L=1 at length + i)")
    bad_layouts = layouts(attn, q, k, v, lens, got, dtype)
    if bad_layouts:
        fails.append(f"{name}: {bad_layouts} differ from the row-contiguous call")
    diffs, ident = [], []
    for b in range(B):
        for i in range(L):
            n = lengths[b] + i + 1
            ref = mx.fast.scaled_dot_product_attention(q[b:b + 1, :, i:i + 1], mx.array(k[b:b + 1, :, :n]) + 0,
                                                       mx.array(v[b:b + 1, :, :n]) + 0, scale=SCALE)
            mine = got[b:b + 1, :, i:i + 1]
            diffs.append(mx.abs(mine.astype(mx.float32) - ref.astype(mx.float32)).max())
            ident.append(mx.all(mine.view(BITS[dtype]) == ref.view(BITS[dtype])))
    worst, same = mx.stack(diffs).max().item(), int(mx.stack(ident).sum().item())
    sliced = "-"
    if len(set(lengths)) == 1:  # the plain step's path where rows share a length: MLX over a slice of the cache
        n0 = lengths[0]
        refs = [mx.fast.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :n0 + i + 1], v[:, :, :n0 + i + 1], scale=SCALE)
                for i in range(L)]
        sliced = f"{sum(same_bits(r, got[:, :, i:i + 1], dtype) for i, r in enumerate(refs))}/{L}"
    short = max(lengths) + L <= 1024
    if worst > TOL[dtype]:
        fails.append(f"{name}: max |rows_attention - MLX| {worst:.3g} > {TOL[dtype]}")
    if short and same < B * L:
        fails.append(f"{name}: {B * L - same} of {B * L} queries not bit-identical to MLX's kernel (<= 1024 keys)")
    row = {"case": name, "B": B, "Hq/Hk": f"{Hq}/{Hk}", "D": D, "L": L, "dtype": str(dtype).split(".")[-1],
           "keys": f"{min(lengths) + 1}..{max(lengths) + L}", "chunks": ",".join(map(str, chunks)), "split": split,
           "chunks same": not differ, "alone same": not alone_bad,
           "layouts same": not bad_layouts, "MLX bit-identical": f"{same}/{B * L}",
           "MLX on a cache slice": sliced,
           "max abs diff": worst, "ok": not fails, "s": time.perf_counter() - t0}
    print(table([row]), flush=True)
    return fails


def chained(fn, n=30):
    def run(q, k, v, extra):
        for _ in range(n):
            q = fn(q, k, v, extra)
        return q
    return mx.compile(run)


def time_us(run, args, repeats) -> float:
    mx.eval(run(*args))
    mx.eval(run(*args))
    spent = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(run(*args))
        spent.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(spent) / 30


CHUNKS = (1, 2, 4, 6, 8)


def timing(attn, shape, widths, queries, repeats, length=250):
    """us a call per path; `c=N`: rows_attention with N queries a block (c=1: a block per query, the
    layout before chunks), `split`: what split() picks, then the masked fallback and MLX on exact keys."""
    name, Hq, Hk, D = shape
    columns = ["shape", "width", "L", "split", *[f"c={c} us" for c in CHUNKS], "split us", "masked us", "mlx exact us",
               "split / c=1", "split / masked", "fastest chunk"]
    out = []
    for B in widths:
        for L in queries:
            q, k, v, lens = inputs(B, Hq, Hk, D, L, [length] * B, mx.bfloat16)
            limit = lens[:, None, None, None] + mx.arange(L)[None, None, :, None]
            mask = mx.arange(k.shape[2])[None, None, None, :] <= limit
            ks, vs = mx.array(k[:, :, :length + L]) + 0, mx.array(v[:, :, :length + L]) + 0
            GL = Hq // Hk * L
            split = ra.split(B, Hk, GL, D)[0]
            paths = {f"c={c} us": (chained(lambda q, k, v, n, c=c: attn(q, k, v, SCALE, n, per_block=c)), (q, k, v, lens))
                     for c in CHUNKS if c <= min(GL, ra.CHUNK_MOST[D])}
            paths["split us"] = (chained(lambda q, k, v, n: attn(q, k, v, SCALE, n)), (q, k, v, lens))
            paths["masked us"] = (chained(lambda q, k, v, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=m)),
                                  (q, k, v, mask))
            paths["mlx exact us"] = (chained(lambda q, k, v, _: mx.fast.scaled_dot_product_attention(
                q, k, v, scale=SCALE, mask="causal" if L > 1 else None)), (q, ks, vs, lens))
            row = {"shape": name, "width": B, "L": L, "split": split}
            for label, (run, args) in paths.items():
                try:
                    row[label] = time_us(run, args, repeats)
                except Exception as e:  # a path that fails to run is reported, not fatal
                    row[label] = f"{type(e).__name__}: {e}"[:60]
            got = lambda key: row.get(key) if isinstance(row.get(key), float) else None
            if got("split us") and got("c=1 us"):
                row["split / c=1"] = row["split us"] / row["c=1 us"]
            if got("split us") and got("masked us"):
                row["split / masked"] = row["split us"] / row["masked us"]
            timed = [(row[f"c={c} us"], c) for c in CHUNKS if got(f"c={c} us")]
            row["fastest chunk"] = min(timed)[1] if timed else "-"
            out.append(row)
            print(table([row], columns), flush=True)
    print(table(out, columns), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="off CUDA: the masked reference in the kernel's place (the script only)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if not ra.cuda_ready() and not args.dry:
        raise SystemExit(f"attn_check: not on CUDA ({mx.default_device()}): rows_attention runs only there; --dry checks the script")
    attn = reference if args.dry else ra.rows_attention
    print(f"device {mx.default_device()}; CHUNK {ra.CHUNK}, CHUNK_MOST {ra.CHUNK_MOST}, SPREAD_BLOCKS {ra.SPREAD_BLOCKS}"
          f"{'; DRY RUN: the masked reference, not the kernel' if args.dry else ''}", flush=True)
    fails = []
    cases = CASES[:3] if args.dry else CASES
    for case in cases:
        try:
            fails += check(attn, *case)
        except Exception as e:
            fails.append(f"{case[0]}: {type(e).__name__}: {e}")
            print(f"CASE FAILED TO RUN {case[0]}: {type(e).__name__}: {e}", flush=True)
    print(f"checks done in {time.perf_counter() - t0:.1f} s: {'all passed' if not fails else f'{len(fails)} FAILED'}", flush=True)
    for f in fails:
        print("FAIL", f, flush=True)
    if not args.no_timing:
        small = args.dry
        timing(attn, ("smollm2", 9, 3, 64), (1, 4) if small else (1, 8, 32), (1, 4) if small else (1, 4, 8), 2 if small else args.repeats)
        if not small:
            timing(attn, ("qwen3-8b", 32, 8, 128), (8, 32), (1, 4), args.repeats)
        print(f"timing done at {time.perf_counter() - t0:.1f} s", flush=True)
    if fails:
        print(f"attn_check: {len(fails)} FAILED:\n  " + "\n  ".join(fails), flush=True)
        sys.exit(1)
    print("attn_check: all checks passed", flush=True)


if __name__ == "__main__":
    main()
