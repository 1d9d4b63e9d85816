"""Where an MTP round's writes land, and what it hands the device, counted on the CPU (issue 18, session 9).

    python -m benchmarks.kv_writes --width 1          # SmolLM2 + the shipped head, fixed depth 3

Per round of plain decoding and of MTP depth 3 (with mtp_draft.CAST_PICKS / STEP_ROWS_ONCE both off,
then both at their defaults): kernel primitives (round_graph.graph_primitives less views), casts, and each
write (scatter, slice update) by where it lands (round_graph.write_destinations: `copy` = MLX copies the
whole destination first, a copy_v of the whole cache on CUDA; `evaluated` = an array an earlier eval made,
in place once the round before has finished; `in place`). Each twice: as the CPU runs, and with
kernels.device.pads forced on (CUDA pads one row's lengths out of MLX's small-array pool).
"""

from __future__ import annotations

import argparse
from collections import Counter

import mlx.core as mx

from mtplx import mtp_draft
from mtplx.kernels import device
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.request import Request, SamplingParams

from .real_models import load_prompts
from .round_cost import real_setup
from .round_graph import VIEWS, graph_primitives, write_destinations


def count(eng, reqs) -> tuple:
    """(rounds, primitives, writes) of one run of `reqs` after a warm-up run."""
    list(eng.generate(reqs))
    prims, writes = Counter(), Counter()
    real = mx.async_eval

    def counting(*a):
        prims.update(graph_primitives(list(a)))
        writes.update(write_destinations(list(a)))
        return real(*a)

    r0 = eng.counters["rounds"]
    mx.async_eval = counting
    try:
        list(eng.generate(reqs))
    finally:
        mx.async_eval = real
    return eng.counters["rounds"] - r0, prims, writes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct")
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    bundle, head, _ = real_setup(args.model, args.head, None)
    prompts = load_prompts("humaneval", bundle.tokenizer, 256)[: 2 * args.width]
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=args.tokens)) for i, p in enumerate(prompts)]
    print("| width | pads | setting | primitives/round | casts/round | writes/round |\n|---|---|---|---|---|---|")
    real_pads, before = device.pads, (mtp_draft.CAST_PICKS, mtp_draft.STEP_ROWS_ONCE)
    try:
        for force in (False, True):
            device.pads = (lambda: True) if force else real_pads
            for label, on in (("plain", None), ("mtp 3, both off", False), ("mtp 3, defaults", True)):
                if on is not None:
                    mtp_draft.CAST_PICKS, mtp_draft.STEP_ROWS_ONCE = (before if on else (True, False))
                spec = SpeculativeConfig() if on is None else SpeculativeConfig(method="mtp", depth=3, mtp_head=head,
                                                                                 adaptive_depth=False)
                R, prims, writes = count(Engine(bundle, spec, ScheduleConfig(max_batch=args.width)), reqs)
                kernels = sum(v for n, v in prims.items() if n not in VIEWS)
                where = ", ".join(f"{n} {v / R:.2f}" for n, v in sorted(writes.items()))
                print(f"| {args.width} | {'on' if force else 'off'} | {label} | {kernels / R:.2f} | {prims['AsType'] / R:.2f} | {where} |",
                      flush=True)
    finally:
        device.pads = real_pads
        mtp_draft.CAST_PICKS, mtp_draft.STEP_ROWS_ONCE = before


if __name__ == "__main__":
    main()
