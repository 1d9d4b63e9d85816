"""What adaptive depth does differently inside a measured run: programs built, and rounds timed over them.

    python -m benchmarks.depth_programs --model smollm2-135m-instruct --head heads/smollm2-135m-instruct \
        --widths 1,8 --rows 4,2x --tokens 24 --depths 3,a

As round_cost does: per setting, one run of the rows untimed (the warm-up), then the same run measured.
Prints per setting and run: programs built in the verify bank and the head's bank (new keys, and
the rounds they were built in), rounds, depths chosen, how many of the rounds that built a program
fed their time to the depth controller, and the seconds spent in first calls (trace + compile +
first run, synchronized at their edges; on a GPU also the kernel builds).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.request import Request, SamplingParams

from .common import sync, table
from .real_models import load_prompts
from .round_cost import real_setup, row_counts


class ProgramWatch:
    """Records each new program of the engine's verify bank and the drafter's bank (with the round
    it came in), the time of its first call, and what each round fed the depth controller."""

    def __init__(self, eng: Engine):
        self.eng, self.new, self.fed, self.first_s = eng, [], [], 0.0
        self._wrap(eng.bank, "_program", "verify")
        bank = getattr(eng.drafter, "bank", None)
        if bank is not None and hasattr(bank, "_get"):
            self._wrap(bank, "_get", "head")
        record = eng.depth_control.record

        def recorded(width, depth, seconds, *a, **k):
            self.fed.append((eng.counters["rounds"], depth, seconds))
            return record(width, depth, seconds, *a, **k)

        eng.depth_control.record = recorded

    def _wrap(self, bank, name: str, kind: str):
        inner, watch = getattr(bank, name), self

        def get(key, *a):
            fresh = key not in bank._programs
            fn = inner(key, *a)
            if not fresh:
                return fn

            def first_call(*args):
                sync()
                t0 = time.perf_counter()
                out = fn(*args)
                sync()
                watch.first_s += time.perf_counter() - t0
                bank._programs[key] = fn
                return out

            watch.new.append((kind, key, watch.eng.counters["rounds"]))
            bank._programs[key] = first_call
            return first_call

        setattr(bank, name, get)

    def summary(self, rounds0: int, new0: int, fed0: int):
        new = self.new[new0:]
        built_in = {r for _, _, r in new}  # rounds landed when the program was made
        fed = self.fed[fed0:]
        # a round fed as the r-th landed: its interval (queueing the next round) ran while r - 1 were
        # landed, its own queueing while r - 2 were
        polluted = sum(1 for r, _, s in fed if s is not None and (r - 1 in built_in or r - 2 in built_in))
        return {"verify programs": sum(k == "verify" for k, _, _ in new), "head programs": sum(k == "head" for k, _, _ in new),
                "rounds": self.eng.counters["rounds"] - rounds0,
                "depths": " ".join(f"{d}:{n}" for d, n in sorted(Counter(d for _, d, _ in fed).items())),
                "timed rounds": sum(s is not None for _, _, s in fed), "timed rounds over a build": polluted,
                "new keys": "; ".join(f"{k} {key} @{r - rounds0}" for k, key, r in new)}


def run(bundle, prompts, spec: SpeculativeConfig, width: int, rows: int, tokens: int):
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width))
    watch = ProgramWatch(eng)
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=tokens)) for i, p in enumerate(prompts[:rows])]
    out = []
    for label in ("warm-up", "measured"):
        rounds0, new0, fed0, first0 = eng.counters["rounds"], len(watch.new), len(watch.fed), watch.first_s
        sync()
        t0 = time.perf_counter()
        res = list(eng.generate(reqs))
        sync()
        s = watch.summary(rounds0, new0, fed0)
        out.append({"run": label, "s": time.perf_counter() - t0, "first calls s": watch.first_s - first0, **s,
                    "texts": {r.key: list(r.tokens) for r in res}})
    return out, eng


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--rows", default="4,2x", help="as round_cost --rows")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--depths", default="3,a", help="MTP depths ('a': adaptive from 3)")
    ap.add_argument("--tail-keeps-width", type=int, default=None,
                    help="Engine.TAIL_KEEPS_WIDTH (32: a drained batch keeps its width, as on a GPU)")
    args = ap.parse_args()
    if args.tail_keeps_width is not None:
        Engine.TAIL_KEEPS_WIDTH = args.tail_keeps_width
    bundle, head, _ = real_setup(args.model, args.head, None)
    prompts = load_prompts(args.prompts, bundle.tokenizer, 256)
    table_rows = []
    for width in (int(w) for w in args.widths.split(",")):
        for rows in row_counts(args.rows, width):
            plain = None
            for d in ["none"] + args.depths.split(","):
                adaptive = d == "a"
                spec = (SpeculativeConfig(method="none") if d == "none" else
                        SpeculativeConfig(method="mtp", depth=3 if adaptive else int(d), adaptive_depth=adaptive, mtp_head=head))
                runs, _ = run(bundle, prompts, spec, width, min(rows, len(prompts)), args.tokens)
                for r in runs:
                    texts = r.pop("texts")
                    plain = plain or texts
                    table_rows.append({"width": width, "rows": rows, "depth": d, **r,
                                       "rows = plain": f"{sum(texts[k] == plain[k] for k in plain)}/{len(plain)}"})
                print(table(table_rows), flush=True)


if __name__ == "__main__":
    main()
