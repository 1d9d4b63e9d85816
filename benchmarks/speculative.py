"""Speculative decoding on a real model, warm: our methods at each width against mlx-lm in the same run.

SmolLM2-135M-Instruct with its shipped MTP head (`heads/smollm2-135m-instruct`): methods none,
ngram (prompt lookup) and mtp, each at `--depth` with adaptive depth as a job runs them
(`--adaptive 0`: fixed depth), at widths 1, 8 and 32. The peer at width 1 is mlx-lm's
`generate_step` row after row, at a wider width its `batch_generate` with that many rows in
flight. Width 1 runs `--rows` rows; a width W runs max(`--rows`, `--waves` x W) rows, a stream
refilled as rows finish, as a job runs. Every setting is made and warmed first, then all run
`--repeats` times in rotating order; `x plain` and `x mlx-lm` are medians of the per-repeat
ratios. `= plain` counts the rows whose greedy text equals our plain decoding's (on mlx-lm's
row: its text against ours); `new programs` counts compiled programs built inside timed runs, `first run:`
the programs a setting's first (untimed) run built and their first calls' seconds, as a fresh process
builds them (on a GPU host's first run, kernels too).

Data (`--data`, comma-separated): HumanEval (code, the head's domain: rows in the head's
training sample, `sample_rows` in its mtp_head.json, are left out) and GSM8K (math word
problems, never trained on), or any JSONL file with a `prompt` field.

    python -m benchmarks.run --suite gpu --parts speculative
    python -m benchmarks.run --suite cpu --parts speculative --rows 2 --tokens 16 --widths 1,8
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List

from mtplx.config import SpeculativeConfig
from mtplx.models.loading import load

from .common import (BatchGenerate, Ours, Report, generate_step, interleaved, load_prompts, median, median_ratio,
                     same_rows, spread)


def method_spec(method: str, opts) -> SpeculativeConfig:
    if method == "none":
        return SpeculativeConfig(method="none")
    return SpeculativeConfig(method=method, depth=opts.depth, adaptive_depth=bool(opts.adaptive),
                             mtp_head=opts.head if method == "mtp" else None,
                             draft_model=opts.draft if method == "draft" else None)


def trained_rows(head) -> set:
    """Row indices of the head's training sample (of its job's dataset); none without a head."""
    meta = Path(head or "", "mtp_head.json")
    return set(json.loads(meta.read_text()).get("sample_rows", [])) if head and meta.exists() else set()


def rows_at(width: int, opts) -> int:
    return opts.rows if width == 1 else max(opts.rows, opts.waves * width)


def compare(report: Report, table: str, bundle, peer_model, prompts: List[List[int]], methods: List[str], opts,
            extra_peers: Callable[[int, list], Dict[str, object]] = lambda width, rows: {}) -> Dict[int, dict]:
    """Our `methods` and mlx-lm at every width of `opts.widths`, one table row per setting and width.
    `peer_model` is a copy of the model no engine has run (an engine installs its decode paths into
    its model). Returns {width: {setting: [runs]}}."""
    eos = list(bundle.tokenizer.eos_token_ids)
    out = {}
    for width in (int(w) for w in opts.widths.split(",")):
        rows = [prompts[i % len(prompts)] for i in range(rows_at(width, opts))]  # a short dataset repeats
        peer = "mlx-lm generate_step" if width == 1 else "mlx-lm batch_generate"
        runs = {peer: generate_step(peer_model, rows, opts.tokens, eos) if width == 1
                else BatchGenerate(peer_model, bundle.tokenizer, rows, opts.tokens, width)}
        runs.update(extra_peers(width, rows))
        for m in methods:
            ours = runs[f"ours {m}"] = Ours(bundle, method_spec(m, opts), width, rows, opts.tokens)
            c = ours.warm_counters
            report.say(f"width {width}: ours {m} warmed in {ours.warmup_s:.2f} s ({c['programs_built']} programs built, "
                       f"their first calls {c['first_call_seconds']:.2f} s)")
        done = interleaved(runs, opts.repeats, report.say)
        plain = done.get("ours none")
        for label, rs in done.items():
            cells = {"width": width, "rows": len(rows), "setting": label, "tok/s": median([r["tok/s"] for r in rs]),
                     "spread": spread([r["tok/s"] for r in rs]), "x mlx-lm": median_ratio(rs, done[peer])}
            if plain is not None:
                cells["x plain"] = median_ratio(rs, plain)
            cells["tokens/verify"] = rs[0].get("tokens/verify", "")
            if label.startswith("ours"):
                warm = runs[label].warm_counters  # its first run: what a fresh process builds
                cells.update({"ms/round": median([r["ms/round"] for r in rs]),
                              "new programs": sum(r["new programs"] for r in rs),
                              "first run: programs": warm["programs_built"],
                              "first run: first calls s": warm["first_call_seconds"]})
            if plain is not None:
                cells["= plain"] = same_rows(rs[0]["texts"], plain[0]["texts"])
            report.row(table, **cells)
        out[width] = done
    return out


def run(opts, report: Report):
    bundle, peer_model = load(opts.model), load(opts.model).model
    methods = [m for m in opts.methods.split(",") if m != "mtp" or opts.head]
    skip = trained_rows(opts.head)
    for source in opts.data.split(","):
        held_out = skip if source == "humaneval" else set()
        prompts = load_prompts(source, bundle.tokenizer, max(rows_at(int(w), opts) for w in opts.widths.split(",")),
                               held_out)
        name = f"{Path(source).stem}" + (" (rows outside the head's training sample)" if held_out else "")
        compare(report, name, bundle, peer_model, prompts, methods, opts)
