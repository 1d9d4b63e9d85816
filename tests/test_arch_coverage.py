"""Every architecture mlx-lm runs runs here too: greedy text identical to mlx-lm's own decoding.

For each tiny checkpoint of `arch_fixtures.ARCHITECTURES` (the family's real config and MLX
layout, loaded by `mlx_lm.load`): six prompts of different lengths (5 to 94 tokens; two of
27 and 30 tokens are prefilled together as one padded batch; several are longer than the
sliding windows), `method: none` and `ngram` (depth 3), batch widths 1 and 4 (4 < 6 rows: rows
join as others finish), the compiled verify (the default) and for ngram also eager. The
reference is mlx-lm's single-row `generate_step`, row by row, stopping at eos. A few families
also draft with a different-seed model of their own architecture (`method: draft`).
"""

from __future__ import annotations

import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from arch_fixtures import ARCHITECTURES, make_arch_model
from tiny_models import reference_tokens

PROMPTS = [
    ("import os", 20),
    ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return", 16),
    ("Question: What is the capital of France?\nAnswer: The capital of", 18),
    ("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\ndef sub(a, b):\n    return", 24),
    (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
        "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
        16,
    ),
    ("the quick brown fox jumps over the lazy dog. " * 3 + "the quick", 20),
]

# What does not pass yet, and why (strict: a fix must remove its entry).
XFAIL = {}

CASES = [("none", 1, "on"), ("none", 4, "on"), ("ngram", 1, "on"), ("ngram", 4, "on"), ("ngram", 4, "off")]


class Arch:
    def __init__(self, root, arch):
        self.bundle = load(make_arch_model(root / arch, arch))
        self.draft = lambda: make_arch_model(root / f"{arch}-draft", arch, seed=1)
        tok = self.bundle.tokenizer
        eos = set(tok.eos_token_ids)
        self.prompts = [tok.encode(p) for p, _ in PROMPTS]
        self.refs = [reference_tokens(self.bundle.model, p, m, eos) for p, (_, m) in zip(self.prompts, PROMPTS)]

    def run(self, method, width, compiled, draft_model=None):
        spec = SpeculativeConfig(method=method, depth=3, compiled_verify=compiled, adaptive_depth=False,
                                 draft_model=str(draft_model) if draft_model else None)  # every round drafts
        eng = Engine(self.bundle, spec, ScheduleConfig(max_batch=width))
        reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m))
                for i, (p, (_, m)) in enumerate(zip(self.prompts, PROMPTS))]
        out = {r.key: r for r in eng.generate(reqs)}
        return [out[i] for i in range(len(reqs))]


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    built = {}

    def get(arch):
        if arch not in built:
            built[arch] = Arch(root, arch)
        return built[arch]

    return get


def _params():
    for arch in ARCHITECTURES:
        for method, width, compiled in CASES:
            reason = XFAIL.get(arch)
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            yield pytest.param(arch, method, width, compiled, marks=marks, id=f"{arch}-{method}-w{width}-{compiled}")


@pytest.mark.parametrize("arch,method,width,compiled", list(_params()))
def test_greedy_text_matches_mlx_lm(arch_models, arch, method, width, compiled):
    a = arch_models(arch)
    results = a.run(method, width, compiled)
    for i, (res, ref) in enumerate(zip(results, a.refs)):
        assert res.error is None, f"{arch} row {i}: {res.error}"
        assert res.tokens == ref, f"{arch} {method} width {width} row {i} ({len(a.prompts[i])} prompt tokens)"
    if method == "ngram":
        assert sum(r.stats.drafted_tokens for r in results) > 0  # the drafter really drafted


# The draft model runs batched too (one token per row per feed, rows at their own offsets).
DRAFT_ARCHS = ["gemma2", "internlm3", "lfm2", "nemotron_h", "gemma3_text", "falcon_h1"]


@pytest.mark.parametrize("arch", DRAFT_ARCHS)
def test_draft_model_of_the_same_architecture(arch_models, arch):
    a = arch_models(arch)
    results = a.run("draft", 4, "on", draft_model=a.draft())
    assert [r.tokens for r in results] == a.refs
    assert sum(r.stats.drafted_tokens for r in results) > 0


PREFIX_ARCHS = ["lfm2", "nemotron_h", "falcon_h1", "gemma3_text", "gpt_oss", "gemma2"]


@pytest.mark.parametrize("arch", PREFIX_ARCHS)
def test_rows_sharing_a_prefix(arch_models, arch):
    """Rows whose prompts share a 30-token prefix: the first prefills it and keeps a snapshot at its
    edge (recurrent state included), the others copy it and prefill only their suffix."""
    a = arch_models(arch)
    tok = a.bundle.tokenizer
    shared = tok.encode("the quick brown fox jumps over the lazy dog. " * 3)[:30]
    prompts = [shared + tok.encode(s) for s in (" one", " and then two more", " three, four")]
    refs = [reference_tokens(a.bundle.model, p, 16, set(tok.eos_token_ids)) for p in prompts]
    eng = Engine(a.bundle, SpeculativeConfig(method="ngram", depth=3), ScheduleConfig(max_batch=4))
    reqs = [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=16), stable_prefix_len=len(shared))
            for i, p in enumerate(prompts)]
    out = {r.key: r for r in eng.generate(reqs)}
    assert [out[i].tokens for i in range(3)] == refs
    assert sum(out[i].stats.cached_prompt_tokens for i in range(3)) == 2 * len(shared)
