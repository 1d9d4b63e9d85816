"""Where one-stream decoding loses time against mlx-lm: the same decode, piece by piece, one process.

One stream, a short prompt, N greedy tokens, on the random-weight shapes of engine_efficiency
(or a real model with --model). Each variant is warmed up, then timed from its first token to
its last (prefill excluded), and its tokens are compared with mlx-lm's:

  mlx-lm generate_step        the peer
  bare+KVCache                model + mlx-lm KVCache in a pipelined loop (what generate_step does)
  bare+BatchCache masked      the same loop over our BatchCache, per-row writes, masked capacity
  bare+BatchCache exact       ... with the shared-length path (slice write, exact keys, no mask)
  bank                        the same loop through CompiledVerifyBank
  engine eager / compiled     Engine plain decoding (compiled_verify off / on)
  +fused, +gemv               with q/k/v and gate/up stacked (mtplx/fusion.py) and/or the CUDA
                              gemv of mtplx/gemv.py (CUDA only)

It also checks that mtplx/gemv.py's kernel is bit-identical to MLX's matmul on every weight shape
and times both, and compares mtplx/rows_attention.py's kernel with MLX's over exact keys (+rowattn
variants: the masked paths with that kernel). Prints a line per variant as it goes; writes decode_anatomy.{json,md} to --out.

    python -m benchmarks.decode_anatomy --shapes 0.6b,8b --tokens 128 --out bench-out
    python -m benchmarks.decode_anatomy --shapes tiny --tokens 16            # CPU dry run
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mtplx import gemv, rows_attention
from mtplx.architectures import capture_backend
from mtplx.cache import BatchCache, RowKVCache
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.fusion import fuse_projections
from mtplx.generation import Engine, _Runtime
from mtplx.graphbank import CompiledVerifyBank
from mtplx.request import Request, SamplingParams

from .common import device_name, save_json, sync, table, versions
from .engine_efficiency import HBM_BYTES_PER_S, random_qwen3, weight_bytes


def pipelined(step, prompt, n):
    """generate_step's loop: queue token i+1 before reading token i. Returns (tokens, seconds from
    the first token to the last)."""
    y = step(mx.array(prompt, dtype=mx.int32)[None])
    mx.async_eval(y)
    toks, t0 = [], None
    for i in range(n):
        nxt = step(y.reshape(1, 1)) if i < n - 1 else None
        if nxt is not None:
            mx.async_eval(nxt)
        toks.append(int(y.item()))
        if i == 0:
            t0 = time.perf_counter()
        y = nxt
    return toks, time.perf_counter() - t0


def v_generate_step(model, prompt, n):
    from mlx_lm.generate import generate_step

    toks, t0 = [], None
    for i, (tok, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=n)):
        toks.append(int(tok))
        if i == 0:
            t0 = time.perf_counter()
    return toks, time.perf_counter() - t0


def v_bare_kv(model, prompt, n):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)

    def step(tok):
        return mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)

    return pipelined(step, prompt, n)


def v_bare_batch(exact):
    def run(model, prompt, n):
        RowKVCache.exact_when_shared = exact
        cache = BatchCache.for_model(model, 1)

        def step(tok):
            logits = model(tok, cache=cache.layers)
            cache.commit(np.array([tok.shape[1]]))
            return mx.argmax(logits[:, -1], axis=-1)

        try:
            return pipelined(step, prompt, n)
        finally:
            RowKVCache.exact_when_shared = True
    return run


def v_bank(model, prompt, n):
    cache = BatchCache.for_model(model, 1)
    bank = CompiledVerifyBank(_Runtime(model, want_hidden=False), max_verify_len=1, request_max_tokens=len(prompt) + n + 1,
                              capture_backend=capture_backend(model))
    ones = np.ones(1, dtype=np.int64)

    def step(tok):
        if tok.shape[1] > 1:  # prefill eagerly: the bank verifies short spans
            logits = model(tok, cache=cache.layers)
            cache.commit(np.array([tok.shape[1]]))
        else:
            logits = bank.verify(tok, cache)[0]
            cache.commit(ones)
        return mx.argmax(logits[:, -1], axis=-1)

    return pipelined(step, prompt, n)


def v_engine(compiled, exact=True):
    engines = {}  # one engine per bundle for this variant's warm-up and timed run

    def run(bundle, prompt, n):
        RowKVCache.exact_when_shared = exact
        try:
            eng = engines.get(id(bundle)) or Engine(bundle, SpeculativeConfig(method="none", compiled_verify=compiled, adaptive_depth=False),
                                                    ScheduleConfig(max_batch=1))
            engines[id(bundle)] = eng
            eng.eos = set()  # as generate_step: every run makes n tokens
            eng.first_token_at = None
            (res,) = list(eng.generate([Request(key=0, prompt_tokens=list(prompt), params=SamplingParams(max_tokens=n))]))
            return list(res.tokens), time.perf_counter() - eng.first_token_at
        finally:
            RowKVCache.exact_when_shared = True
    run.wants_bundle = True
    return run


def timed(fn, bundle, prompt, n):
    target = bundle if getattr(fn, "wants_bundle", False) else bundle.model
    fn(target, prompt, min(n, 16))  # warm-up: kernels, compiled programs, allocator
    sync()
    toks, dt = fn(target, prompt, n)
    return toks, dt / max(1, len(toks) - 1)


def gemv_check(model, repeats=50):
    """mtplx/gemv.py against MLX's matmul on each distinct 2-d weight shape: identical? how fast?"""
    from mlx.utils import tree_flatten

    rows, seen = [], set()
    for name, w in tree_flatten(model.parameters()):
        if w.ndim != 2 or w.shape in seen:
            continue
        seen.add(w.shape)
        x = (mx.random.normal((1, 1, w.shape[1])) * 0.5).astype(w.dtype)
        if not gemv.usable(x, w):
            continue
        ref, got = x @ w.T, gemv.matvec(x, w)
        same = bool(mx.array_equal(ref, got).item())
        out = {}
        for label, f in (("mlx", lambda: x @ w.T), ("ours", lambda: gemv.matvec(x, w))):
            mx.eval(f())
            sync()
            t0 = time.perf_counter()
            ys = [f() for _ in range(repeats)]
            mx.eval(ys)
            sync()
            out[label] = (time.perf_counter() - t0) / repeats * 1e6
        gbs = w.nbytes / (out["ours"] * 1e-6) / 1e9
        rows.append({"weight": name, "shape": f"{w.shape[0]}x{w.shape[1]}", "bit-identical": same,
                     "mlx us": round(out["mlx"], 1), "ours us": round(out["ours"], 1),
                     "ours/mlx": round(out["ours"] / out["mlx"], 3), "ours GB/s": round(gbs)})
        print("gemv", rows[-1], flush=True)
    return rows


def rows_attention_check(dtype=mx.bfloat16):
    """mtplx/rows_attention.py against MLX's own kernel over each row's exact keys (contiguous copies
    of 37 / 300 / 1000 keys: MLX's one-pass vector kernel). Returns rows for the table."""
    out = []
    for L in (1, 3):
        B, Hq, Hk, D, cap = 3, 8, 2, 128, 1024
        q = mx.random.normal((B, Hq, L, D)).astype(dtype)
        k = mx.random.normal((B, Hk, cap, D)).astype(dtype)
        v = mx.random.normal((B, Hk, cap, D)).astype(dtype)
        lengths = mx.array([37, 300, 1000 - L], dtype=mx.int32)
        got = rows_attention.rows_attention(q, k, v, 0.088, lengths)
        worst, same = 0.0, True
        for b in range(B):
            for i in range(L):
                n = int(lengths[b].item()) + i + 1
                ref = mx.fast.scaled_dot_product_attention(q[b:b + 1, :, i:i + 1], mx.array(k[b:b + 1, :, :n]) + 0, mx.array(v[b:b + 1, :, :n]) + 0, scale=0.088)
                d = mx.abs(got[b:b + 1, :, i:i + 1].astype(mx.float32) - ref.astype(mx.float32)).max().item()
                worst, same = max(worst, d), same and d == 0
        out.append({"check": f"rows_attention L={L}", "bit-identical": same, "max abs diff": worst})
        print("rows_attention", out[-1], flush=True)
    return out


PLAIN = [
    ("mlx-lm generate_step", v_generate_step),
    ("bare+KVCache", v_bare_kv),
    ("bare+BatchCache masked", v_bare_batch(False)),
    ("bare+BatchCache exact", v_bare_batch(True)),
    ("bank", v_bank),
    ("engine eager masked", v_engine("off", exact=False)),
    ("engine eager", v_engine("off")),
    ("engine compiled", v_engine("on")),
]
def transformed():
    """Fresh variants for a transformed model (an engine made before a transform runs stale programs)."""
    return [("bare+KVCache", v_bare_kv), ("bank", v_bank), ("engine eager", v_engine("off")), ("engine compiled", v_engine("on"))]


def load_model(name):
    if name.startswith(("0.6b", "8b", "tiny")) and not Path(name).exists():
        return random_qwen3(name)
    from mtplx.models.loading import load

    return load(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.6b,8b", help="random-weight shapes (engine_efficiency.SHAPES), comma-separated")
    ap.add_argument("--model", default=None, help="also a real model: a path or known name (smollm2-135m-instruct)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--skip-transforms", action="store_true", help="only the unchanged model")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.shapes.split(",") if s] + ([args.model] if args.model else [])
    rows, gemv_rows, attn_rows = [], [], []
    for name in names:
        t0 = time.perf_counter()
        bundle = load_model(name)
        wb = weight_bytes(bundle.model)
        roof = HBM_BYTES_PER_S / wb
        print(f"== {name}: {wb / 1e9:.2f} GB of weights, roofline {roof:.0f} tok/s, loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        prompt = np.random.default_rng(1).integers(0, 1000, args.prompt).tolist()
        ref = None

        def measure(label, fn):
            nonlocal ref
            try:
                toks, spt = timed(fn, bundle, prompt, args.tokens)
            except Exception as e:  # noqa: BLE001 (one variant failing must not cost the others)
                print(f"{name:8s} {label:40s} FAILED {type(e).__name__}: {e}", flush=True)
                rows.append({"model": name, "variant": label, "error": f"{type(e).__name__}: {e}"[:300]})
                return
            ref = toks if ref is None else ref
            row = {"model": name, "variant": label, "tok/s": 1 / spt, "ms/token": spt * 1e3,
                   "x mlx-lm": None, "% roofline": 100 / spt / roof, "same tokens": toks == ref}
            base = next((r for r in rows if r["model"] == name and r["variant"] == "mlx-lm generate_step" and "tok/s" in r), None)
            row["x mlx-lm"] = row["tok/s"] / base["tok/s"] if base else 1.0
            rows.append(row)
            print(f"{name:8s} {label:40s} {row['tok/s']:8.1f} tok/s {row['ms/token']:7.2f} ms/tok {row['x mlx-lm']:6.3f}x "
                  f"{row['% roofline']:5.1f}% roof  same={row['same tokens']}", flush=True)

        for label, fn in PLAIN:
            measure(label, fn)
        if not args.skip_transforms:  # most telling first: the run may be cut short
            if gemv.cuda_ready():
                try:
                    gemv_rows += [dict(model=name, **r) for r in gemv_check(bundle.model)]
                except Exception as e:  # noqa: BLE001 (the kernel failing to build must not cost the rest)
                    print(f"gemv check FAILED {type(e).__name__}: {e}", flush=True)
            if gemv.install_gemv(bundle.model, check=False):  # the gemv lines above say whether it is exact
                for label, fn in transformed():
                    measure(f"{label} +gemv", fn)
                gemv.uninstall_gemv(bundle.model)
            if rows_attention.install(bundle.model):
                try:
                    attn_rows += [dict(model=name, **r) for r in rows_attention_check()]
                except Exception as e:  # noqa: BLE001
                    print(f"rows_attention check FAILED {type(e).__name__}: {e}", flush=True)
                for label, fn in [("bank", v_bank), ("engine eager masked", v_engine("off", exact=False)),
                                  ("engine compiled", v_engine("on"))]:
                    measure(f"{label} +rowattn", fn)
                if gemv.install_gemv(bundle.model, check=False):
                    for label, fn in [("bank", v_bank), ("engine compiled", v_engine("on"))]:
                        measure(f"{label} +rowattn+gemv", fn)
                    gemv.uninstall_gemv(bundle.model)
            undo = fuse_projections(bundle.model)
            print(f"   fused {undo.count} projections", flush=True)
            for label, fn in transformed():
                measure(f"{label} +fused", fn)
            if gemv.install_gemv(bundle.model, check=False):
                for label, fn in transformed():
                    measure(f"{label} +fused+gemv", fn)
                if rows_attention.install(bundle.model):
                    for label, fn in [("bank", v_bank), ("engine compiled", v_engine("on"))]:
                        measure(f"{label} +rowattn+fused+gemv", fn)
                gemv.uninstall_gemv(bundle.model)
            undo()
            rows_attention.uninstall()
        del bundle
        mx.clear_cache()
    payload = {"device": device_name(), "versions": versions(), "tokens": args.tokens, "prompt": args.prompt,
               "decode": rows, "gemv": gemv_rows, "rows_attention": attn_rows}
    save_json(out_dir / "decode_anatomy.json", payload)
    md = f"device: {payload['device']}; versions: {payload['versions']}; {args.tokens} tokens after a {args.prompt}-token prompt\n\n"
    md += table([r for r in rows if "tok/s" in r]) + "\n" + (table(gemv_rows) if gemv_rows else "") + "\n" + (table(attn_rows) if attn_rows else "")
    (out_dir / "decode_anatomy.md").write_text(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
