"""Online vs offline MTP acceptance on the same rows: what the engine accepts against what
train-head's teacher-forced evaluation predicts for the same trunk continuations.

    python -m benchmarks.mtp_audit --head heads/smollm2-135m-instruct --data jobs/eval.yaml --rows 6 --tokens 96
    python -m benchmarks.mtp_audit --head heads/smollm2-135m-instruct,NEW_HEAD --rows 64 --online-only  # heads side by side

Rows are the job's rows outside the head's `sample_rows` (never trained on). The engine runs them
at width 1, fixed depth, greedy; then the trunk runs once over prompt + the engine's output and
the head is evaluated teacher-forced on those same positions (head_eval.acceptance_by_depth), and
its per-position hits are replayed as the engine would walk them (head_eval.replayed_tokens_per_verify).
Several heads (comma-separated) run one after another on the same rows with the model loaded once
(their held-out rows must agree: the same sample), and a table of tokens per verify ends the run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def heldout_prompts(data: str, head: str, tokenizer, rows: int, skip: int = 0):
    """(row indices, prompt token lists) of `data`'s rows that the head's sample did not include."""
    from mtplx.training.train_head import TrainConfig
    from pipelines.io.train_data import read_train_data

    meta = json.loads((Path(head) / "mtp_head.json").read_text())
    # the sample's row numbers are the training job's: another job's rows were never trained on
    trained_on = f"job:" in meta.get("data", "") and f"/{Path(data).name}" in meta["data"].split(" + ")[0]
    seen = set(meta.get("sample_rows") or []) if trained_on else set()
    read = read_train_data(data, tokenizer, TrainConfig())
    pairs = [(i, p) for i, p in zip(read.rows, read.prompts) if i not in seen][skip : skip + rows]
    return [i for i, _ in pairs], [p for _, p in pairs]


def online(bundle, prompts, head, depth, tokens, lookup: int = 0):
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.request import Request, SamplingParams

    spec = SpeculativeConfig(method="mtp", depth=depth, adaptive_depth=False, mtp_head=head, mtp_lookup=lookup)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=1, order="input"))
    reqs = [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=tokens)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    res = sorted(eng.generate(reqs), key=lambda r: r.key)
    dt = time.perf_counter() - t0
    verifies = sum(r.stats.verify_calls for r in res)
    acc = sum(r.stats.accepted_tokens for r in res)
    by = np.zeros(depth)
    for r in res:
        by[: len(r.stats.accepted_by_depth)] += r.stats.accepted_by_depth
    per_verify = by / max(verifies, 1)
    cond = [per_verify[0]] + [per_verify[k] / per_verify[k - 1] if per_verify[k - 1] else 0.0 for k in range(1, depth)]
    rows = [round(r.stats.tokens_per_verify or 1.0, 2) for r in res]
    return {"texts": [r.tokens for r in res], "per_row": rows, "tokens_per_verify": (acc + verifies) / max(verifies, 1),
            "accepted_per_verify": per_verify.round(3).tolist(), "conditional": np.round(cond, 3).tolist(),
            "seconds": round(dt, 1), "tokens": sum(len(r.tokens) for r in res),
            "lookup_rounds": getattr(eng.drafter.lookup, "counts", None)}


def offline(bundle, prompts, texts, head_dir, depth):
    from mtplx.models.mtp import load_head
    from mtplx.training.head_data import trunk_features
    from mtplx.training.head_eval import acceptance_by_depth, depth_hits, replayed_tokens_per_verify, tokens_per_verify

    head = load_head(bundle, head_dir)
    vpath = Path(head_dir) / "mtp_draft_vocab.npy"
    vocab = np.load(vpath).tolist() if vpath.exists() else None
    seqs = [list(p) + list(t) for p, t in zip(prompts, texts)]
    starts = [len(p) - 1 for p in prompts]
    feats = trunk_features(bundle.model, seqs, starts, mx.float32, True)
    by_depth = acceptance_by_depth(head, feats, depth, vocab=vocab)
    hits = depth_hits(head, feats, depth, vocab=vocab)
    # how often the trunk's own teacher-forced argmax differs from the engine's text (ties, dtype)
    mism = sum(int((g[st + 1 : len(s) - 1] != np.asarray(s[st + 2 :])).sum())
               for g, s, st in zip(feats.greedy, seqs, starts))
    return {"acceptance_by_depth": np.round(by_depth, 3).tolist(),
            "product_estimate": round(tokens_per_verify(by_depth, depth), 3),
            "replayed": round(replayed_tokens_per_verify(hits, depth), 3),
            "replayed_per_row": [round(replayed_tokens_per_verify([h], depth), 2) for h in hits],
            "greedy_mismatches": mism, "positions": feats.positions}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct", help="a head directory, or several, comma-separated")
    ap.add_argument("--data", default="jobs/eval.yaml", help="the job whose rows outside the head's sample are used")
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--skip", type=int, default=0, help="held-out rows to skip first")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--lookup", type=int, default=0, help="speculative.mtp_lookup for the online run (0: head only)")
    ap.add_argument("--online-only", action="store_true", help="skip the teacher-forced evaluation")
    args = ap.parse_args()
    from mtplx.models.loading import load

    bundle = load(args.model)
    heads = args.head.split(",")
    table = []
    first = None
    for head in heads:
        idx, prompts = heldout_prompts(args.data, head, bundle.tokenizer, args.rows, args.skip)
        if first is not None and idx != first:
            raise SystemExit(f"{head}'s held-out rows differ from {heads[0]}'s: compare heads trained on the same sample")
        first = idx
        print(f"head {head}: rows {idx}", flush=True)
        on = online(bundle, prompts, head, args.depth, args.tokens, args.lookup)
        print("online:", json.dumps({k: v for k, v in on.items() if k != "texts"}), flush=True)
        row = [head, len(idx), on["tokens"], f"{on['tokens_per_verify']:.3f}", " / ".join(map(str, on["accepted_per_verify"]))]
        if not args.online_only:
            off = offline(bundle, prompts, on["texts"], head, args.depth)
            print("offline:", json.dumps(off), flush=True)
            row.append(f"{off['replayed']:.3f}")
        table.append(row)
    cols = ["head", "rows", "tokens", "tokens/verify", "accepted per verify by depth"] + ([] if args.online_only else ["offline replayed"])
    print(f"\n{args.data}, depth {args.depth}, {args.tokens} tokens a row, greedy, one stream")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in table:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
