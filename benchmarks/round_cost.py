"""Is a verify still nearly free? One forward of K tokens a row against one of 1 token, same model.

Speculation pays where checking K drafted tokens costs about what decoding one token does: a
step bound by reading the weights (or by launches) reads them once for all K. For each model
(random-weight Qwen3 shapes `--shapes`, and the real `--model`), each width (1 and `--streams`)
and K in 1, 2, 4, 8: the model's forward over K new tokens a row through mlx-lm's KV cache at
`--context` tokens of context, the cache rewound after each, `--repeats` x 10 timed after 3
untimed. `x one token` is the time against K = 1: near 1 means a verify of K is nearly free,
near K means it costs K decode steps. (The speculative part's `ms/round` is what whole rounds
cost in the engine.)

    python -m benchmarks.run --suite gpu --parts round_cost --model qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mtplx.models.loading import load

from .common import Report, median, sync
from .decode import SHAPES, random_qwen3

LENGTHS = (1, 2, 4, 8)
WARM, TIMED = 3, 10


def forward_ms(model, width: int, context: int, length: int, repeats: int) -> float:
    """Median ms of one forward of `length` tokens for `width` rows after `context` cached tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    rng = np.random.default_rng(0)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(rng.integers(0, 1000, (width, context)), dtype=mx.int32), cache=cache))
    tokens = mx.array(rng.integers(0, 1000, (width, length)), dtype=mx.int32)

    def once():
        mx.eval(model(tokens, cache=cache))
        for c in cache:
            c.trim(length)

    for _ in range(WARM):
        once()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(TIMED):
            once()
        sync()
        times.append((time.perf_counter() - t0) / TIMED * 1e3)
    return median(times)


def run(opts, report: Report):
    models = [s for s in opts.shapes.split(",") if s] + ([opts.model] if opts.model else [])
    for name in models:
        model = random_qwen3(name).model if name in SHAPES else load(name).model
        for width in sorted({1, opts.streams}):
            one = None
            for k in LENGTHS:
                ms = forward_ms(model, width, opts.context, k, opts.repeats)
                one = one or ms
                report.row("verify of K tokens a row against 1", model=name, rows=width, context=opts.context, K=k,
                           ms=ms, **{"x one token": ms / one, "ms per token": ms / (width * k)})
        del model
        mx.clear_cache()
