"""Where one-stream decoding loses time against mlx-lm: the same decode, piece by piece, one process.

One stream, a short prompt, N greedy tokens, on the random-weight shapes of engine_efficiency
(or a real model with --model). Every variant is warmed up once, then all variants run in turn
--repeats times (interleaved, so a slow spell of the host hits them alike); each run is timed
from its first token to its last (prefill excluded), the median is reported, and its tokens are
compared with the bare loop's, or the first variant's when the bare loop does not run (argmax of the
logits; mlx-lm's generate_step takes the argmax of log-probabilities, which can break bf16 ties differently):

  mlx-lm generate_step          the peer
  bare+KVCache                  model + mlx-lm KVCache in generate_step's pipelined loop
  bare+BatchCache masked        the same loop over our BatchCache: per-row writes, masked capacity
  bare+BatchCache exact         ... with the shared-length path (slice write, exact keys, no mask)
  engine eager masked           Engine plain decoding, compiled_verify off, as in session 3
  engine eager                  ... with the shared-length path (what width 1 runs now)
  engine compiled plain         compiled_verify on, without the CUDA paths below (session 3)
  engine compiled +rowattn      ... with mtplx/rows_attention.py for the masked attention
  engine compiled +rowattn+stacked  ... and stacked q/k/v, gate/up (mtplx/fusion.py): what ships
  engine compiled +rowattn+stacked qkv / mlp   ... only q/k/v, only gate/up stacked
  engine eager +stacked         the eager engine with both stacked
  bare+KVCache +stacked         stacking in an eager loop
  engine compiled +rowattn+stacked+skinny   what ships, with mtplx/skinny_matmul.py's kernel (CUDA)
  bare+KVCache +skinny          the bare loop with the kernel
  engine compiled +rowattn+stacked+layerk   what ships, and mtplx/layer_kernels.py (residual add + RMSNorm,
                                q/k norm + RoPE, one kernel each; benchmarks/step_kernels.py counts)
  engine compiled +rowattn+stacked+layerk2  ... with layer_kernels' version 2 sources (loads first, vector)
  engine eager +layerk          the eager engine with layer_kernels
  engine compiled +rowattn+stacked+layerk+mlp  ... and mtplx/mlp_kernel.py (gate/up product + SwiGLU in one kernel)
  engine compiled +rowattn+stacked+layerk+mlp+onorm  ... and mtplx/o_norm_kernel.py (o_proj + add + RMSNorm in one)
  engine compiled +rowattn+stacked+layerk+onorm  layer_kernels with o_norm_kernel, without mlp_kernel
  engine compiled +rowattn+stacked+layerk nopad  the shipped path with the kernels' small arrays left in MLX's
                                managed pool (rows_attention.PAD_SMALL off: as session 6 ran)

`--variants matrix` runs only issue 20's one-stream matrix (MATRIX: eager vs compiled, with and
without stacking, against generate_step and the bare loop); a comma-separated list of labels
picks others. After every round of runs the medians so far are printed, so a run cut short still
says what it measured.

On CUDA it also checks rows_attention's kernel against MLX's over exact keys (bit-identical?), and
when a `+layerk` variant runs, layer_kernels' kernels against the unfused ops (step_kernels.check), and
when a `+mlp` / `+onorm` variant runs, mlp_kernel.check / o_norm_kernel.check.
Prints a line per run as it goes; writes decode_anatomy.{json,md} to --out.

    python -m benchmarks.decode_anatomy --shapes 8b,0.6b --tokens 128 --out bench-out
    python -m benchmarks.decode_anatomy --shapes 8b --tokens 256 --repeats 5 --variants matrix
    python -m benchmarks.decode_anatomy --shapes tiny --tokens 16 --repeats 1      # CPU dry run
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mtplx import layer_kernels, mlp_kernel, o_norm_kernel, rows_attention, skinny_matmul
from mtplx.architectures import capture_backend
from mtplx.cache import BatchCache, RowKVCache
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.fusion import NAMED, fuse_projections, unstack
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


def rows_attention_check(dtype=mx.bfloat16):
    """mtplx/rows_attention.py against MLX's own kernel over each row's exact keys (contiguous copies
    of 37 / 300 / 1000 keys: MLX's one-pass vector kernel). Returns rows for the table."""
    out = []
    for L in (1, 3, 4, 8):  # 4, 8: speculative verifies of depth 3 and 7
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


# (label, variant, rows_attention installed, projections stacked: False, True (all), or a NAMED group
# [, skinny_matmul installed [, layer_kernels VERSION installed, 0 for none]])
VARIANTS = [
    ("mlx-lm generate_step", v_generate_step, False, False),
    ("bare+KVCache", v_bare_kv, False, False),
    ("bare+BatchCache masked", v_bare_batch(False), False, False),
    ("bare+BatchCache exact", v_bare_batch(True), False, False),
    ("engine eager masked", v_engine("off", exact=False), False, False),
    ("engine eager", v_engine("off"), True, False),
    ("engine eager +stacked", v_engine("off"), True, True),
    ("engine compiled plain", v_engine("on"), False, False),
    ("engine compiled +rowattn", v_engine("on"), True, False),
    ("engine compiled +rowattn+stacked", v_engine("on"), True, True),
    ("engine compiled +rowattn+stacked qkv", v_engine("on"), True, "qkv"),
    ("engine compiled +rowattn+stacked mlp", v_engine("on"), True, "mlp"),
    ("bare+KVCache +stacked", v_bare_kv, False, True),
    # a fifth field True: mtplx/skinny_matmul.py's few-row kernel for the bf16 matmuls (CUDA only)
    ("engine compiled +rowattn+stacked+skinny", v_engine("on"), True, True, True),
    ("bare+KVCache +skinny", v_bare_kv, False, False, True),
    # a sixth field: mtplx/layer_kernels.py's VERSION to install (residual add + RMSNorm, q/k norm + RoPE; CUDA only)
    ("engine compiled +rowattn+stacked+layerk", v_engine("on"), True, True, False, 1),
    ("engine compiled +rowattn+stacked+layerk2", v_engine("on"), True, True, False, 2),  # VERSION 2
    ("engine compiled +rowattn+stacked+skinny+layerk", v_engine("on"), True, True, True, 1),
    ("engine eager +layerk", v_engine("off"), True, False, False, 1),
    # a seventh field True: mtplx/mlp_kernel.py (stacked gate/up product + SwiGLU, one kernel at one row; CUDA only)
    ("engine compiled +rowattn+stacked+layerk+mlp", v_engine("on"), True, True, False, 1, True),
    # an eighth field True: mtplx/o_norm_kernel.py (o_proj + residual add + RMSNorm, one kernel at one row; CUDA only)
    ("engine compiled +rowattn+stacked+layerk+mlp+onorm", v_engine("on"), True, True, False, 1, True, True),
    ("engine compiled +rowattn+stacked+layerk+onorm", v_engine("on"), True, True, False, 1, False, True),
    # a ninth field False: small arrays left in MLX's managed pool (rows_attention.PAD_SMALL off: session 6's path)
    ("engine compiled +rowattn+stacked+layerk nopad", v_engine("on"), True, True, False, 1, False, False, False),
]
REFERENCE = "bare+KVCache"
layerk_version = layer_kernels.VERSION  # the shipped sources (a +layerk2 run sets 2 for its own runs)
# issue 20's one-stream question: which engine path is fastest, and does stacking pay, eager or compiled
MATRIX = ["mlx-lm generate_step", "bare+KVCache", "engine eager", "engine eager +stacked", "engine compiled +rowattn",
          "engine compiled +rowattn+stacked", "engine compiled +rowattn+stacked qkv", "engine compiled +rowattn+stacked mlp",
          "engine compiled +rowattn+stacked+layerk", "engine compiled +rowattn+stacked+layerk2",
          "engine compiled +rowattn+stacked+layerk+mlp", "engine compiled +rowattn+stacked+layerk+mlp+onorm"]
# (the +skinny variants are not in it: at one row MLX's gemv is as fast as skinny_matmul's kernel, H200
# session 6 window 2; they stay available by name)


def pick_variants(spec: str):
    """`all`, `matrix`, or comma-separated labels; an unknown label is an error naming the known ones."""
    if spec == "all":
        return VARIANTS
    labels = MATRIX if spec == "matrix" else [s.strip() for s in spec.split(",") if s.strip()]
    known = {v[0]: v for v in VARIANTS}
    bad = [lab for lab in labels if lab not in known]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; known: all, matrix, " + ", ".join(known))
    return [known[lab] for lab in labels]


def set_paths(model, rowattn: bool, stacked, skinny: bool = False, layerk: int = 0, mlp: bool = False,
              onorm: bool = False, pad: bool = True):
    """Put the model in the state a variant runs in (the engine's own installs are off here).
    `layerk`: 0, or the layer_kernels.VERSION to install; `mlp`: mlp_kernel on the stacked MLPs;
    `onorm`: layer_kernels with o_norm_kernel; `pad`: rows_attention.PAD_SMALL (small arrays out of
    MLX's managed pool)."""
    rows_attention.PAD_SMALL = pad
    mlp_kernel.uninstall(model)
    skinny_matmul.uninstall(model)
    layer_kernels.uninstall(model)
    layer_kernels.VERSION = layerk or layerk_version
    if layerk:
        layer_kernels.install(model, o_norm=onorm)
    if skinny:
        skinny_matmul.install(model)
    if rowattn:
        rows_attention.install(model)
    else:
        rows_attention.uninstall()
    unstack(model)
    if stacked:
        fuse_projections(model, [NAMED[stacked]] if isinstance(stacked, str) else NAMED.values())
    if mlp or onorm:  # o_norm alone: mlp_kernel's MLP with MLX's ops, which hands o_norm its down_proj's input
        mlp_kernel.install(model, reference=not mlp)


def summary(name, variants, runs, toks_of, roof):
    """One row per variant: the median time per token of its runs, against generate_step's."""
    ref = REFERENCE if REFERENCE in toks_of else variants[0][0]  # without the bare loop: the first variant's
    base = runs.get("mlx-lm generate_step")
    base = 1 / float(np.median(base)) if base else None
    rows = []
    for label, *_ in variants:
        if not runs[label]:
            rows.append({"model": name, "variant": label, "error": "failed"})
            continue
        spt = float(np.median(runs[label]))
        rows.append({"model": name, "variant": label, "tok/s": 1 / spt, "ms/token": spt * 1e3,
                     "x mlx-lm": (1 / spt) / base if base else None, "% roofline": 100 / spt / roof,
                     "runs tok/s": " ".join(f"{1 / t:.0f}" for t in runs[label]),
                     "same tokens": toks_of[label] == toks_of.get(ref, toks_of[label])})
    return rows


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
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of every variant (interleaved)")
    ap.add_argument("--variants", default="all", help="all, matrix (issue 20's one-stream matrix), or comma-separated labels")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    chosen = pick_variants(args.variants)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.shapes.split(",") if s] + ([args.model] if args.model else [])
    rows, attn_rows = [], []
    skinny_default = Engine.use_skinny_matmul
    layerk_default = Engine.use_layer_kernels
    mlp_default, o_norm_default = Engine.use_mlp_kernel, Engine.use_o_norm_kernel
    for name in names:
        t0 = time.perf_counter()
        bundle = load_model(name)
        wb = weight_bytes(bundle.model)
        roof = HBM_BYTES_PER_S / wb
        print(f"== {name}: {wb / 1e9:.2f} GB of weights, roofline {roof:.0f} tok/s, loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        prompt = np.random.default_rng(1).integers(0, 1000, args.prompt).tolist()
        Engine.stack_projections = Engine.use_rows_attention = Engine.use_skinny_matmul = Engine.use_layer_kernels = False  # set_paths decides
        Engine.use_mlp_kernel = Engine.use_o_norm_kernel = False
        if rows_attention.cuda_ready():
            try:
                attn_rows += [dict(model=name, **r) for r in rows_attention_check()]
            except Exception as e:  # noqa: BLE001 (the kernel failing to build must not cost the rest)
                print(f"rows_attention check FAILED {type(e).__name__}: {e}", flush=True)
            for version in sorted({v[5] for v in chosen if len(v) > 5 and v[5]}):  # layer_kernels versions run
                try:
                    from .step_kernels import check, kernel_times

                    attn_rows += [dict(model=name, **r) for r in check(("bfloat16", "float16"), version=version)]
                    kernel_times(version=version)
                except Exception as e:  # noqa: BLE001
                    print(f"layer_kernels check FAILED {type(e).__name__}: {e}", flush=True)
            for i, mod in ((6, mlp_kernel), (7, o_norm_kernel)):  # the new kernels against MLX's ops
                if any(len(v) > i and v[i] for v in chosen):
                    try:
                        attn_rows += [dict(model=name, **r) for r in mod.check()]
                    except Exception as e:  # noqa: BLE001
                        print(f"{mod.__name__} check FAILED {type(e).__name__}: {e}", flush=True)
        variants = chosen  # off CUDA rows_attention installs nothing: +rowattn runs without it
        runs = {label: [] for label, *_ in variants}
        toks_of = {}
        for rep in range(-1, args.repeats):  # -1: the warm-up round (kernels, compiled programs)
            for label, fn, rowattn, stacked, *extra in variants:  # extra: skinny, layer_kernels
                set_paths(bundle.model, rowattn, stacked, *extra)
                target = bundle if getattr(fn, "wants_bundle", False) else bundle.model
                try:
                    toks, dt = fn(target, prompt, min(args.tokens, 16) if rep < 0 else args.tokens)
                except Exception as e:  # noqa: BLE001 (one variant failing must not cost the others)
                    print(f"{name:6s} {label:38s} FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                if rep < 0:
                    continue
                spt = dt / max(1, len(toks) - 1)
                runs[label].append(spt)
                toks_of[label] = toks
                print(f"{name:6s} {label:38s} run {rep}: {1 / spt:8.1f} tok/s {spt * 1e3:7.2f} ms/tok", flush=True)
            if 0 <= rep < args.repeats - 1:  # the medians so far: a run cut short still reports
                print(f"-- {name}: medians after {rep + 1} round(s)", flush=True)
                print(table([r for r in summary(name, variants, runs, toks_of, roof) if "tok/s" in r],
                            ["variant", "tok/s", "x mlx-lm", "% roofline", "runs tok/s", "same tokens"]), flush=True)
        set_paths(bundle.model, False, False)
        rows += summary(name, variants, runs, toks_of, roof)
        print(table([r for r in rows if r["model"] == name and "tok/s" in r]), flush=True)
        del bundle
        mx.clear_cache()
    Engine.stack_projections = Engine.use_rows_attention = True
    Engine.use_skinny_matmul = skinny_default
    Engine.use_layer_kernels = layerk_default
    Engine.use_mlp_kernel, Engine.use_o_norm_kernel = mlp_default, o_norm_default
    layer_kernels.VERSION = layerk_version
    payload = {"device": device_name(), "versions": versions(), "tokens": args.tokens, "prompt": args.prompt,
               "decode": rows, "rows_attention": attn_rows}
    save_json(out_dir / "decode_anatomy.json", payload)
    md = f"device: {payload['device']}; versions: {payload['versions']}; {args.tokens} tokens after a {args.prompt}-token prompt\n\n"
    md += table([r for r in rows if "tok/s" in r]) + "\n" + (table(attn_rows) if attn_rows else "")
    (out_dir / "decode_anatomy.md").write_text(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
