"""A refilled stream's schedule with the tail kept at its width or moved to tail widths (mtplx/tail_widths.py).

    python -m benchmarks.tail_schedule --model smollm2-135m-instruct --head heads/smollm2-135m-instruct \
        --prompts /tmp/humaneval-heldout.jsonl --width 32 --rows 64 --tokens 96 --narrowest 0,8

One fresh engine per setting (plain and MTP at a fixed depth, each with `tail_narrowest` 0 and N), one run
of the stream, the GPU's rule for the tail (Engine.TAIL_KEEPS_WIDTH 32) on any device: per call of the
rounds its width, rounds, live rows and the programs it built (verify + drafter banks; `twins`: those
built ahead at tail widths), then rounds at each width and the programs built in the calls once the
source was drained (no request waits: what the tail compiled, 0 wanted). Greedy text is compared with the first setting's.
Each run is one fresh engine's first (its programs built in it, as in a job): its seconds and those spent
building the twins say what the tail widths cost a one-shot job; on a CPU a round's cost follows its width, so
there the counts are the point and the GPU measures (`--narrowest 0,8,0,8`: the second pair after the kernels exist).
"""

from __future__ import annotations

import argparse
import time

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from .real_models import load_prompts


def _built(eng):
    banks = [b for b in (eng.bank, getattr(eng.drafter, "bank", None)) if b is not None]
    return sum(b.stats["programs"] for b in banks), sum(b.stats.get("twins", 0) for b in banks)


def schedule(bundle, prompts, spec, width, tokens, narrowest):
    """(calls [(width, rounds, live at its start, programs built, twins built, drained?)], texts, run seconds,
    seconds building the twins)."""
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width))
    eng.TAIL_KEEPS_WIDTH = 32
    eng.tail_narrowest = narrowest
    calls, admitted = [], {"all": False}
    inner_admit = eng._admit

    def admit(batch):
        again = yield from inner_admit(batch)
        admitted["all"] = admitted["all"] or batch.drained
        return again

    eng._admit = admit
    for name in ("_round", "_plain_rounds"):
        def counted(slots, *a, _inner=getattr(eng, name), **k):
            rounds, (built, twins) = eng.counters["rounds"], _built(eng)
            live, tail = sum(s is not None for s in slots), admitted["all"]
            out = yield from _inner(slots, *a, **k)
            now = _built(eng)
            calls.append((len(slots), eng.counters["rounds"] - rounds, live, now[0] - built, now[1] - twins, tail))
            return out
        setattr(eng, name, counted)

    def landed(slots, cache, _inner=eng._land_carried):  # the round carried across the last admission (no call's)
        rounds = eng.counters["rounds"]
        out = _inner(slots, cache)
        if eng.counters["rounds"] > rounds:
            calls.append((len(slots), eng.counters["rounds"] - rounds, sum(s is not None for s in slots), 0, 0, True))
        return out

    eng._land_carried = landed
    spent = [0.0]  # seconds inside the banks' `_twins` (building and running the tail widths' programs)
    for bank in (eng.bank, getattr(eng.drafter, "bank", None)):
        if bank is not None and hasattr(bank, "_twins"):
            def timed(*a, _inner=bank._twins, **k):
                t0 = time.perf_counter()
                _inner(*a, **k)
                spent[0] += time.perf_counter() - t0
            bank._twins = timed
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=tokens)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    texts = {r.key: r.tokens for r in eng.generate(reqs)}
    return calls, texts, time.perf_counter() - t0, spent[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--methods", default="none,mtp")
    ap.add_argument("--narrowest", default="0,8", help="Engine.tail_narrowest values, comma-separated, a fresh engine each (0: the tail keeps its width)")
    args = ap.parse_args()
    bundle = load(args.model)
    prompts = load_prompts(args.prompts, bundle.tokenizer, 256)
    prompts = [prompts[i % len(prompts)] for i in range(args.rows)]
    first = None
    for method in args.methods.split(","):
        spec = SpeculativeConfig(method=method, depth=args.depth, adaptive_depth=False,
                                 mtp_head=args.head if method == "mtp" else None)
        for narrowest in (int(n) for n in args.narrowest.split(",")):
            calls, texts, run_s, twins_s = schedule(bundle, prompts, spec, args.width, args.tokens, narrowest)
            first = first or texts
            by_width = {}
            for w, n, *_ in calls:
                by_width[w] = by_width.get(w, 0) + n
            tail = [c for c in calls if c[5]]
            print(f"{method} tail_narrowest {narrowest}: {sum(c[1] for c in calls)} rounds; by width "
                  + " ".join(f"{w}:{n}" for w, n in sorted(by_width.items(), reverse=True))
                  + f"; once the source was drained {sum(c[1] for c in tail)} rounds in {len(tail)} calls, "
                  f"programs built there {sum(c[3] for c in tail)}; programs {sum(c[3] for c in calls)} "
                  f"(twins {sum(c[4] for c in calls)}); text = the first setting's: "
                  f"{sum(texts[k] == first[k] for k in first)}/{len(first)}; one run {run_s:.3f} s (a fresh engine: its "
                  f"programs built in it), {twins_s:.3f} s of it building the twins", flush=True)
            print("  calls (width rounds live built twins):", " | ".join(
                f"{w} {n} {live} {b} {t}{' T' if tl else ''}" for w, n, live, b, t, tl in calls), flush=True)


if __name__ == "__main__":
    main()
