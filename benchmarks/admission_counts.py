"""How often a refilled speculative stream empties its one-ahead pipeline, and how it admits rows (CPU counts).

    python -m benchmarks.admission_counts --width 32 --rows 128
    python -m benchmarks.admission_counts --width 8 --rows 40 --max-tokens 4,26

A tiny 30-layer llama with a random MTP head (drafts are rejected, so a row's rounds are its
max_tokens) and rows of staggered max_tokens, so rows end at different rounds as MTP rows do. For
each path, rounds carried across admissions (the default) and every admission emptying the
pipeline first (`Engine.carry_admissions = False`, the path before session 7): reads with no round
queued behind them (pipeline drains), admissions, rounds, mx.eval calls; the text is checked equal
between the two. Counts, not times: on a CPU a round is compute, not launches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.request import Request, SamplingParams

from .common import table
from .round_cost import tiny_setup


def counts(eng: Engine, reqs, carry: bool):
    eng.carry_admissions = carry
    events, admissions, evals = [], [0], [0]
    launch, read, admit, real = eng._launch, eng._read, eng._admit, mx.eval
    eng._launch = lambda *a, **k: (events.append(1), launch(*a, **k))[1]  # a round queued (its read: -1)
    eng._read = lambda f: (events.append(-1), read(f))[1]

    def counted(batch):
        before = sum(s is not None for s in batch.slots)
        again = yield from admit(batch)
        admissions[0] += sum(s is not None for s in batch.slots) > before
        return again

    eng._admit = counted
    mx.eval = lambda *a, **k: (evals.__setitem__(0, evals[0] + 1), real(*a, **k))[1]
    rounds = eng.counters["rounds"]
    try:
        out = {r.key: r.tokens for r in eng.generate(reqs)}
    finally:
        mx.eval = real
        for name in ("_launch", "_read", "_admit"):
            eng.__dict__.pop(name, None)
    queued, drains = 0, 0
    for e in events:
        queued += e
        drains += e < 0 and queued == 0
    return out, {"path": "carried across admissions" if carry else "each admission empties the pipeline",
                 "drains": drains, "admissions": admissions[0], "rounds": eng.counters["rounds"] - rounds, "mx.eval": evals[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", default="8,48", help="LO,HI: each row's max_tokens, staggered over this range")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        bundle, head, _ = tiny_setup(Path(tmp))
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, 400, int(n)).tolist() for n in rng.integers(2, 41, 9)]
        reqs = [Request(key=i, prompt_tokens=prompts[i % len(prompts)], params=SamplingParams(max_tokens=lo + (i * 7) % (hi - lo + 1)))
                for i in range(args.rows)]
        spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, mtp_head=head)
        eng = Engine(bundle, spec, ScheduleConfig(max_batch=args.width, order="input"))
        rows = []
        texts = None
        for carry in (False, True):
            out, row = counts(eng, reqs, carry)
            if texts is not None and out != texts:
                sys.exit("the two paths gave different text")
            texts = out
            rows.append({"width": args.width, "rows": args.rows, **row})
        print(table(rows))


if __name__ == "__main__":
    main()
