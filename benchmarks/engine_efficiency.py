"""Engine efficiency on random-weight model shapes (Qwen3-0.6B / Qwen3-8B), peers in the same run.

Random weights say nothing about acceptance, so this measures the machinery: single-stream and
batched decode against mlx-lm's own `generate_step` / `batch_generate`, the HBM roofline at
batch 1, and the cost of one verify forward per verify length, eager vs CompiledVerifyBank.

    python -m benchmarks.engine_efficiency --shapes 0.6b,8b --out bench-out
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mtplx.cache import BatchCache
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine, _Runtime
from mtplx.architectures import capture_backend
from mtplx.kernels import layer_kernels
from mtplx.kernels.fusion import unstack
from mtplx.graphbank import CompiledVerifyBank
from mtplx.models.loading import ModelBundle
from mtplx.request import Request, SamplingParams

from . import torch_peer
from .common import device_name, save_json, sync, table, versions

HBM_BYTES_PER_S = 4.8e12
MATMUL_FLOPS = 716e12  # bf16 matmul measured on the H200 with MLX (../shared/GPU.md): the large-batch ceiling

SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
}


class IdTokenizer:
    """Random-weight models have no tokenizer: ids in, ids out, no EOS."""

    eos_token_ids = []
    eos_token_id = None
    vocab_size = 151936

    def decode(self, ids):
        return ""

    def encode(self, text):
        return [1]


def random_qwen3(shape: str, dtype=mx.bfloat16, vocab: int = 151936) -> ModelBundle:
    from mlx_lm.models import qwen3

    cfg = dict(model_type="qwen3", vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, **SHAPES[shape])
    model = qwen3.Model(qwen3.ModelArgs(**cfg))
    # Default inits give huge activations through 28+ layers; scale to a sane range.
    params = tree_map(lambda p: (p * 0.02).astype(dtype) if p.ndim > 1 else p.astype(dtype), model.parameters())
    model.update(params)
    mx.eval(model.parameters())
    return ModelBundle(model=model, tokenizer=IdTokenizer(), config=cfg, path=Path(f"random-qwen3-{shape}"))


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def mlx_single(model, prompt, n):
    from mlx_lm.generate import generate_step

    sync()
    t0 = time.perf_counter()
    first = None
    for i, (tok, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=n)):
        if i == 0:
            first = time.perf_counter()
    t1 = time.perf_counter()
    return (n - 1) / (t1 - first), t1 - t0


def ours(bundle, prompts, n, max_batch, method="none", compiled="off", decode_only=False):
    """Tokens per second over the whole run, or (`decode_only`, one stream) from the first token to
    the last, as `mlx_single` measures mlx-lm."""
    eng = Engine(bundle, SpeculativeConfig(method=method, compiled_verify=compiled, adaptive_depth=False), ScheduleConfig(max_batch=max_batch))
    reqs = [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=n)) for i, p in enumerate(prompts)]
    list(eng.generate(reqs))  # warm-up: the same run, untimed (compiled programs, kernels)
    sync()
    eng.first_token_at = None
    t0 = time.perf_counter()
    res = list(eng.generate(reqs))
    t1 = time.perf_counter()
    toks = sum(len(r.tokens) for r in res)
    unstack(bundle.model)  # the engine stacks projections on CUDA (compiled): the peers run the model as loaded
    layer_kernels.uninstall(bundle.model)  # ... and its layers with layer_kernels
    if decode_only:
        return (toks - len(res)) / (t1 - eng.first_token_at), t1 - t0, eng
    return toks / (t1 - t0), t1 - t0, eng


def mlx_batch(bundle, prompts, n):
    from mlx_lm import batch_generate

    batch_generate(bundle.model, bundle.tokenizer, prompts, max_tokens=n)  # warm-up: the same run, untimed
    sync()
    t0 = time.perf_counter()
    r = batch_generate(bundle.model, bundle.tokenizer, prompts, max_tokens=n)
    dt = time.perf_counter() - t0
    return len(prompts) * n / dt, dt, r.stats.generation_tps


def verify_cost(bundle, width, context, lengths, repeats=20):
    """Seconds per verify forward of L tokens for `width` rows at `context`: eager vs compiled."""
    model = bundle.model
    rng = np.random.default_rng(0)
    cache = BatchCache.for_model(model, width)
    model(mx.array(rng.integers(0, 1000, (width, context)), dtype=mx.int32), cache=cache.layers)
    cache.commit(np.full(width, context))
    cache.eval()
    base = cache.lengths.copy()
    runtime = _Runtime(model, want_hidden=False)
    bank = CompiledVerifyBank(runtime, max_verify_len=max(lengths), request_max_tokens=context + max(lengths),
                              capture_backend=capture_backend(model))
    rows = []
    for L in lengths:
        toks = mx.array(rng.integers(0, 1000, (width, L)), dtype=mx.int32)
        out = {}
        for name, call in (("eager", lambda: bank.eager(toks, cache)[0]), ("compiled", lambda: bank.verify(toks, cache)[0])):
            for _ in range(3):
                mx.eval(call())
                cache.rewind_to(base)
            sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                mx.eval(call())
                cache.rewind_to(base)
            sync()
            out[name] = (time.perf_counter() - t0) / repeats * 1e3
        rows.append({"width": width, "verify_len": L, "context": context, "eager_ms": out["eager"], "compiled_ms": out["compiled"], "compiled/eager": out["compiled"] / out["eager"]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.6b,8b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer (a shorter run)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    decode_rows, verify_rows = [], []
    for shape in args.shapes.split(","):
        bundle = random_qwen3(shape)
        wb = weight_bytes(bundle.model)
        roof = HBM_BYTES_PER_S / wb
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, 1000, 128).tolist() for _ in range(args.batch)]
        n = args.tokens
        mlx_single(bundle.model, prompts[0], 8)
        m1, _ = mlx_single(bundle.model, prompts[0], n)
        o1, _, _ = ours(bundle, prompts[:1], n, 1, decode_only=True)
        o1c, _, eng = ours(bundle, prompts[:1], n, 1, compiled="on", decode_only=True)
        decode_rows.append({"shape": shape, "what": "1 stream decode tok/s", "mlx-lm": m1, "ours eager": o1, "ours compiled": o1c, "ratio (best/mlx)": max(o1, o1c) / m1, "roofline tok/s": roof, "ours % roofline": 100 * max(o1, o1c) / roof, "ours % matmul peak": ""})
        mb, _, mb_tps = mlx_batch(bundle, prompts, n)
        ob, _, _ = ours(bundle, prompts, n, args.batch)
        obc, _, _ = ours(bundle, prompts, n, args.batch, compiled="on")
        flops_per_token = wb  # 2 FLOPs per weight, bf16 weights are 2 bytes each: FLOPs == weight bytes
        decode_rows.append({"shape": shape, "what": f"{args.batch} streams end-to-end tok/s", "mlx-lm": mb, "ours eager": ob, "ours compiled": obc, "ratio (best/mlx)": max(ob, obc) / mb, "roofline tok/s": "", "ours % roofline": "",
                            "ours % matmul peak": 100 * max(ob, obc) * flops_per_token / MATMUL_FLOPS})
        if torch_peer.available() and not args.no_torch:  # same random weights in transformers, greedy generate
            try:
                peer = torch_peer.peer_rows(bundle, [("1", prompts[:1], 1, None), ("batch", prompts, args.batch, None)], n, eos=[])
                for row, p in zip(decode_rows[-2:], peer):
                    row["torch tok/s"] = p["torch tok/s"]
                    row["best / torch"] = max(row["ours eager"], row["ours compiled"]) / p["torch tok/s"]
            except Exception as e:  # noqa: BLE001 (a peer failing must not cost the rest of the run)
                print(f"torch peer failed: {e!r}", flush=True)
        print(table(decode_rows), flush=True)
        if not args.skip_verify:
            for width in (1, args.batch):
                verify_rows += [dict(shape=shape, **r) for r in verify_cost(bundle, width, 1024, [1, 2, 4, 6, 8])]
            print(table(verify_rows), flush=True)
        del bundle
        mx.clear_cache() if hasattr(mx, "clear_cache") else None
    payload = {"device": device_name(), "versions": versions(), "decode": decode_rows, "verify": verify_rows}
    save_json(out_dir / "engine_efficiency.json", payload)
    md = f"device: {payload['device']}; versions: {payload['versions']}\n\n" + table(decode_rows) + "\n" + table(verify_rows)
    (out_dir / "engine_efficiency.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
