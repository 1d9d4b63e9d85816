"""What a draft-model round runs: draft-model forwards and compiled proposals per round, ms per round.

    python -m benchmarks.draft_rounds --model smollm2-135m-instruct --draft smollm2-135m-instruct --depths 2,4

`--compiled measured` is what the engine does: each shape's first proposal times the compiled
chain and the eager steps (the column "chain ms compiled / eager") and drafts through the faster.
Counts (device-independent): eager draft-model forwards per round (prefills included, so a
little above the steps), the draft model's compiled proposal calls, rounds. Times (the device's
own, meaningful on a GPU): wall ms per round and tok/s of the second of two identical runs (the
first builds every program). One stream, greedy, fixed depth.
"""

from __future__ import annotations

import argparse
import time

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from .common import device_name, table

PROMPTS = ["def fib(n):", "# sort a list of pairs by their second item\ndef sort_pairs(xs):"]


class _Counting:
    """The draft model, counting its eager forwards (a compiled program traces it once)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.model(*a, **k)

    def __getattr__(self, name):
        return getattr(self.model, name)


def measure(bundle, draft: str, depth: int, compiled: str, tokens: int) -> dict:
    """`compiled`: "on" (the verify and the draft steps compiled), "verify" (the verify compiled,
    the draft steps eager), "measured" (the verify compiled, the draft steps whichever the drafter
    timed faster at its first proposal: the engine's default), "off" (both eager)."""
    spec = SpeculativeConfig(method="draft", draft_model=draft, depth=depth, adaptive_depth=False,
                             compiled_verify="off" if compiled == "off" else "on")
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=1))
    eng.drafter.measure = compiled == "measured"
    if compiled == "verify":
        eng.drafter.bank = None
    counting = eng.drafter.model = _Counting(eng.drafter.model)
    reqs = lambda: [Request(i, bundle.tokenizer.encode(p), SamplingParams(max_tokens=tokens)) for i, p in enumerate(PROMPTS)]
    list(eng.generate(reqs()))  # builds the programs
    bank = eng.drafter.bank
    calls0, rounds0 = counting.calls, eng.counters["rounds"]
    compiled0 = bank.stats["compiled_calls"] if bank else 0
    t0 = time.perf_counter()
    out = list(eng.generate(reqs()))
    dt = time.perf_counter() - t0
    rounds = eng.counters["rounds"] - rounds0
    n = sum(len(r.tokens) for r in out)
    return {"depth": depth, "compiled": compiled, "rounds": rounds, "tokens": n,
            "eager draft forwards / round": (counting.calls - calls0) / rounds,
            "compiled proposals / round": ((bank.stats["compiled_calls"] if bank else 0) - compiled0) / rounds,
            "ms / round": 1e3 * dt / rounds, "tok/s": n / dt,
            # what the drafter timed at each shape (measured only): ms of a chain compiled / eager
            "chain ms compiled / eager": "; ".join(f"{k}: {c} / {e}" for k, (c, e) in bank.stats["measured_ms"].items())
            if bank else ""}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct")
    ap.add_argument("--depths", default="2,4")
    ap.add_argument("--compiled", default="off,verify,on,measured",
                    help="on: verify and draft steps compiled; verify: only the verify (eager draft steps); measured: "
                         "the verify compiled, the draft steps as the drafter timed them faster (the default); off: neither")
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    bundle = load(args.model)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for compiled in args.compiled.split(","):
            rows.append(measure(bundle, args.draft, depth, compiled, args.tokens))
            print(table(rows), flush=True)
    print(f"device: {device_name()}; model {args.model}; draft {args.draft}; {args.tokens} tokens x {len(PROMPTS)} rows")


if __name__ == "__main__":
    main()
