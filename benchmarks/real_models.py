"""Speculative decoding on a real model, peers in the same run (mlx-lm `generate_step` /
`batch_generate`, speculative off), and the lossless check in the device's own dtype.

    python -m benchmarks.real_models --model smollm2-135m-instruct --prompts humaneval \
        --head heads/smollm2 --rows 16 --tokens 128 --out bench-out

Reports single-stream tokens/s per method and depth (tokens per verify, acceptance by depth),
batched tokens/s at several widths, and the share of rows whose greedy speculative text equals
plain decoding; every divergence is checked to start at a near-tie of the plain model's logits.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams, tokens_per_verify

from . import torch_peer
from .common import Measure, device_name, peak_gb, reset_peak, save_json, sync, table, versions

NEAR_TIE = 0.5  # top-2 logit gap under which bf16 rounding may flip the argmax


def load_prompts(source: str, tokenizer, rows: int, offset: int = 0):
    from mtplx.models.assets import resolve_asset

    path = resolve_asset(source, "dataset")
    prompts = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            messages = [{"role": "user", "content": row["prompt"]}]
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            else:
                ids = tokenizer.encode(row["prompt"])
            prompts.append(list(ids))
    return prompts[offset : offset + rows]


def run_engine(bundle, prompts, tokens, spec: SpeculativeConfig, width: int, warm: bool = True):
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width))
    reqs = [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=tokens)) for i, p in enumerate(prompts)]
    if warm:  # the same run once, untimed: every compiled program and kernel this run needs exists
        list(eng.generate(reqs))
    chosen = _count_depths(eng.depth_control)
    reset_peak()
    t0 = time.perf_counter()
    res = sorted(eng.generate(reqs), key=lambda r: r.key)
    dt = time.perf_counter() - t0
    n = sum(len(r.tokens) for r in res)
    verifies = sum(r.stats.verify_calls for r in res)
    depth = spec.depth if spec.method != "none" else 0
    by_depth = np.zeros(max(depth, 1))
    for r in res:
        if r.stats.accepted_by_depth:
            by_depth[: len(r.stats.accepted_by_depth)] += r.stats.accepted_by_depth
    return {
        "tok_s": n / dt,
        "seconds": dt,
        "tokens": n,
        "tokens_per_verify": tokens_per_verify(sum(r.stats.accepted_tokens for r in res), verifies) or 1.0,
        "acceptance": (sum(r.stats.accepted_tokens for r in res) / max(1, sum(r.stats.drafted_tokens for r in res))),
        "accept_by_depth": (by_depth / max(verifies, 1)).round(3).tolist() if verifies else [],
        "compiled_calls": eng.bank.stats["compiled_calls"] if eng.bank else 0,
        # the draft model's proposals: compiled program calls / eager ones (both runs counted)
        "draft_calls": _draft_calls(eng.drafter),
        "mean_depth": round(float(np.mean([r.stats.draft_depth for r in res])), 2),
        "depth_mix": _mix(chosen),  # the depths chosen for the timed run's rounds
        "peak_gb": peak_gb(),
        "texts": [r.tokens for r in res],
        # mtp_lookup: the share of row-rounds that drafted from the context (both runs counted alike)
        "lookup_share": _lookup_share(eng.drafter),
    }


def _count_depths(control) -> Counter:
    """The depths `control` (the engine's DepthController) chooses from now on, counted."""
    chosen, choose = Counter(), control.choose

    def counted(width):
        k = choose(width)
        chosen[k] += 1
        return k

    control.choose = counted
    return chosen


def _mix(chosen: Counter) -> str:
    """Share of rounds at each depth, e.g. "0: 88%, 1: 12%"."""
    n = sum(chosen.values()) or 1
    return ", ".join(f"{k}: {100 * v / n:.0f}%" for k, v in sorted(chosen.items()))


def _draft_calls(drafter):
    bank = getattr(drafter, "bank", None) if getattr(drafter, "name", "") == "draft" else None
    return f"{bank.stats['compiled_calls']}/{bank.stats['eager_calls']}" if bank is not None else ""


def _lookups(args):
    return [int(n) for n in args.mtp_lookup.split(",") if n and int(n) > 0]


def _lookup_share(drafter):
    counts = getattr(getattr(drafter, "lookup", None), "counts", None)
    return round(counts["lookup"] / max(1, sum(counts.values())), 3) if counts else ""


def _rows_one_at_a_time(steps, prompts, tokens, eos):
    """Time mlx-lm's per-row generator `steps(prompt, max_tokens)` (yielding (token, from_draft))
    over `prompts`, after the same whole run untimed: the warm-up our engine gets (run_engine),
    so every prompt length and cache size has been seen once on both sides."""

    def run():
        from_draft, outs = 0, []
        for p in prompts:
            out = []
            for tok, drafted in steps(mx.array(p), tokens):
                tok = int(tok)
                if tok in eos:
                    break
                out.append(tok)
                from_draft += bool(drafted)
            outs.append(out)
        return from_draft, outs

    run()
    reset_peak()
    t0 = time.perf_counter()
    from_draft, outs = run()
    dt = time.perf_counter() - t0
    n = sum(map(len, outs))
    return {"tok_s": n / dt, "tokens": n, "seconds": dt, "from_draft": from_draft, "texts": outs, "peak_gb": peak_gb()}


def mlx_single(model, prompts, tokens, eos):
    """mlx-lm's `generate_step`, one row at a time."""
    from mlx_lm.generate import generate_step

    steps = lambda prompt, n: ((tok, False) for tok, _ in generate_step(prompt, model, max_tokens=n))
    return _rows_one_at_a_time(steps, prompts, tokens, eos)


def mlx_speculative(model, draft_model, prompts, tokens, eos, depth: int):
    """mlx-lm's own speculative decoding with a draft model, one row at a time."""
    from mlx_lm.generate import speculative_generate_step

    steps = lambda prompt, n: ((tok, drafted) for tok, _, drafted in speculative_generate_step(
        prompt, model, draft_model, num_draft_tokens=depth, max_tokens=n))
    return _rows_one_at_a_time(steps, prompts, tokens, eos)


def mlx_batch(bundle, prompts, tokens, width: int = 32, warmed=None, **kwargs):
    """`batch_generate` keeping up to `width` rows in flight (its completion batch size);
    `warmed(seconds)` is called after the untimed warm-up run."""
    from mlx_lm import batch_generate

    run = lambda: batch_generate(bundle.model, bundle.tokenizer, prompts, max_tokens=tokens, return_token_ids=True,
                                 completion_batch_size=width, prefill_batch_size=min(8, width), **kwargs)
    t0 = time.perf_counter()
    run()  # warm-up: the same run, untimed, as for our engine
    warm = time.perf_counter() - t0
    if warmed is not None:
        warmed(warm)
    reset_peak()
    t0 = time.perf_counter()
    r = run()
    dt = time.perf_counter() - t0
    n = sum(len(t) for t in r.token_ids)
    return {"tok_s": n / dt, "tokens": n, "seconds": dt, "peak_gb": peak_gb(), "warm_seconds": warm}


def identity(bundle, prompts, plain, spec_texts):
    """Share of rows equal to plain decoding; for the others, the top-2 gap where they part."""
    same, gaps = 0, []
    for p, a, b in zip(prompts, plain, spec_texts):
        if a == b:
            same += 1
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        logits = bundle.model(mx.array([p + a[:i]], dtype=mx.int32))[0, -1].astype(mx.float32)
        top = mx.sort(logits)[-2:]
        gaps.append(float(top[1] - top[0]))
    return same / len(prompts), gaps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="humaneval",
                    help="a dataset name or JSONL file; several, comma-separated, run one after another in one process")
    ap.add_argument("--head", default=None, help="MTP sidecar head dir (method mtp)")
    ap.add_argument("--draft", default=None, help="draft model (method draft)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--widths", default="8,32")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--compiled", default="on")
    ap.add_argument("--ngram-depths", default="2,4", help="single-stream prompt-lookup depths ('' for none)")
    ap.add_argument("--batch-methods", default="none,ngram,mtp,draft", help="methods run at the batched widths (mtp+lookup: every --mtp-lookup N)")
    ap.add_argument("--torch", action="store_true", help="also PyTorch + transformers generate on the same weights (CUDA)")
    ap.add_argument("--repeats", type=int, default=1, help="single-stream runs per setting; tok/s is their median")
    ap.add_argument("--mtp-lookup", default="",
                    help="also run method mtp with speculative.mtp_lookup N (shown as mtp+lookupN), single stream and "
                         "batched; several N comma-separated")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    bundle = load(args.model)
    sources = [s for s in args.prompts.split(",") if s]
    for source in sources:
        out = Path(args.out) / (Path(source).stem if len(sources) > 1 else "")
        out.mkdir(parents=True, exist_ok=True)
        print(f"== {source}", flush=True)
        run_source(args, bundle, source, out)


def run_source(args, bundle, source: str, out: Path):
    """Every setting on one prompt source: single stream, then the batched widths."""
    tok = bundle.tokenizer
    eos = set(tok.eos_token_ids)
    single_rows = max(4, args.rows // 4)
    prompts = load_prompts(source, tok, max(args.rows, 32))
    single_prompts = prompts[:single_rows]

    methods = [("none", 1)] + [("ngram", int(d)) for d in args.ngram_depths.split(",") if d]
    if args.head:
        methods += [("mtp", int(d)) for d in args.depths.split(",")]
        methods += [(f"mtp+lookup{n}", int(d)) for n in _lookups(args) for d in args.depths.split(",")]
    if args.draft:
        methods += [("draft", int(d)) for d in args.depths.split(",")]

    def spec(method, depth, adaptive=False):
        lookup = int(method[len("mtp+lookup"):]) if method.startswith("mtp+lookup") else 0
        method = "mtp" if lookup else method
        return SpeculativeConfig(method=method, depth=depth, compiled_verify=args.compiled, adaptive_depth=adaptive,
                                 mtp_head=args.head if method == "mtp" else None, mtp_lookup=lookup,
                                 draft_model=args.draft if method == "draft" else None)

    rows, ident = [], []
    def median_run(fn):
        runs = [fn() for _ in range(args.repeats)]
        rates = Measure([r["tok_s"] for r in runs])
        return dict(runs[0], tok_s=rates.median, spread=rates.spread)

    peer = median_run(lambda: mlx_single(bundle.model, single_prompts, args.tokens, eos))
    rows.append({"setting": "1 stream", "method": "mlx-lm generate_step", "depth": "", "tok/s": peer["tok_s"], "spread": peer["spread"], "peak GB": peer["peak_gb"], "x mlx-lm": 1.0, "tokens/verify": "", "acceptance": "", "accept by depth": ""})
    if args.draft:  # the peer for method draft: mlx-lm's speculative_generate_step, same draft model
        draft_model = load(args.draft).model
        for depth in (int(d) for d in args.depths.split(",")):
            r = median_run(lambda: mlx_speculative(bundle.model, draft_model, single_prompts, args.tokens, eos, depth))
            rows.append({"setting": "1 stream", "method": "mlx-lm speculative (draft model)", "depth": depth, "tok/s": r["tok_s"],
                         "spread": r["spread"], "peak GB": r["peak_gb"], "x mlx-lm": r["tok_s"] / peer["tok_s"],
                         # each verify emits one token of its own plus the drafts it accepted
                         "tokens/verify": r["tokens"] / max(r["tokens"] - r["from_draft"], 1),
                         "acceptance": "", "accept by depth": ""})
        del draft_model
    plain = None
    for method, depth in methods:
        r = median_run(lambda: run_engine(bundle, single_prompts, args.tokens, spec(method, depth), 1))
        if method == "none":
            plain = r
        rows.append({"setting": "1 stream", "method": f"ours {method}", "depth": depth if method != "none" else "", "tok/s": r["tok_s"], "spread": r["spread"], "peak GB": r["peak_gb"], "x mlx-lm": r["tok_s"] / peer["tok_s"], "tokens/verify": r["tokens_per_verify"], "acceptance": r["acceptance"], "accept by depth": r["accept_by_depth"], "lookup share": r["lookup_share"], "draft compiled/eager": r["draft_calls"]})
        if method != "none":
            share, gaps = identity(bundle, single_prompts, plain["texts"], r["texts"])
            ident.append({"method": method, "depth": depth, "rows identical": share, "divergences": len(gaps), "max top-2 gap at divergence": max(gaps) if gaps else 0.0, "all at near-ties": all(g < NEAR_TIE for g in gaps)})
        print(table(rows), flush=True)
    same_as_peer = sum(a == b for a, b in zip(plain["texts"], peer["texts"])) / len(single_prompts)
    best_mtp = max((r for r in rows if r["method"] == "ours mtp"), key=lambda r: r["tok/s"], default=None)
    batch_rows, runs = [], []
    if args.torch and torch_peer.available():
        runs.append(("1 stream", single_prompts, 1, plain["texts"]))
    for width in (int(w) for w in args.widths.split(",")):
        batch_prompts = prompts[: max(width, args.rows)]
        # one row in flight: mlx-lm's peer is generate_step, row after row
        pb = mlx_single(bundle.model, batch_prompts, args.tokens, eos) if width == 1 else mlx_batch(bundle, batch_prompts, args.tokens, width)
        entry = {"width": width, "rows": len(batch_prompts), "mlx-lm tok/s": pb["tok_s"],
                 "mlx-lm": "generate_step" if width == 1 else "batch_generate", "mlx-lm peak GB": pb["peak_gb"]}
        extra = ([("mtp", best_mtp["depth"])] if best_mtp else []) + ([("draft", 2)] if args.draft else [])
        if best_mtp:
            extra[1:1] = [(f"mtp+lookup{n}", best_mtp["depth"]) for n in _lookups(args)]
        wanted = args.batch_methods.split(",")
        for method, depth in [m for m in [("none", 1), ("ngram", 3)] + extra if m[0].rstrip("0123456789") in wanted or m[0] == "none"]:
            r = run_engine(bundle, batch_prompts, args.tokens, spec(method, depth, adaptive=method != "none"), width)
            entry[f"ours {method} tok/s"] = r["tok_s"]
            entry[f"ours {method} x peer"] = r["tok_s"] / pb["tok_s"]
            entry[f"ours {method} peak GB"] = r["peak_gb"]
            if method.startswith("mtp"):
                entry[f"ours {method} tokens/verify"] = r["tokens_per_verify"]
            if method == "draft":  # adaptive: the depth it settled on (0: drafting did not pay)
                entry["ours draft mean depth"] = r["mean_depth"]
                entry["ours draft depth mix"] = r["depth_mix"]  # share of rounds by depth
                entry["ours draft tokens/verify"] = r["tokens_per_verify"]
            if method == "none":
                batch_plain = r["texts"]
        if args.torch and torch_peer.available() and width > 1:  # width 1: the single-stream run above
            runs.append((f"width {width}", batch_prompts, width, batch_plain))
        batch_rows.append(entry)
        print(table(batch_rows), flush=True)
    torch_rows = []
    try:  # a peer failing must not cost the rest of the run
        torch_rows = torch_peer.peer_rows(bundle, runs, args.tokens, sorted(eos)) if runs else []
        for row in torch_rows:
            match = next((r for r in rows if r["method"] == "ours none"), None) if row["setting"] == "1 stream" else \
                next((b for b in batch_rows if f"width {b['width']}" == row["setting"]), None)
            row["ours plain / torch"] = (match.get("tok/s") or match.get("ours none tok/s")) / row["torch tok/s"]
    except Exception as e:  # noqa: BLE001
        torch_rows = [{"setting": "torch peer failed", "error": repr(e)[:300]}]
    print(table(torch_rows), flush=True)
    payload = {"device": device_name(), "versions": versions(), "model": args.model, "prompts": source,
               "rows_single": single_rows, "tokens": args.tokens, "plain_equals_mlx_lm_share": same_as_peer,
               "single": rows, "identity": ident, "batched": batch_rows, "torch": torch_rows}
    save_json(out / "real_models.json", payload)
    md = (f"device: {payload['device']}; model {args.model}; prompts {source}; {args.tokens} new tokens\n\n"
          + table(rows, ["setting", "method", "depth", "tok/s", "spread", "peak GB", "x mlx-lm", "tokens/verify", "acceptance", "accept by depth", "lookup share", "draft compiled/eager"])
          + f"\nplain greedy == mlx-lm greedy on {same_as_peer:.0%} of rows\n\n" + table(ident) + "\n" + table(batch_rows)
          + ("\nPyTorch + transformers generate (greedy, transformers' default attention: see the attention column), same weights in bf16:\n\n" + table(torch_rows) if torch_rows else ""))
    (out / "real_models.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
