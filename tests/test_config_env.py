"""The design note's three environment variables, read in mtplx/config.py and nowhere else in the
engine; the job fields beside them (speculative.verify_max_len)."""

import ast
from pathlib import Path

import mlx.core as mx
import pytest

from mtplx.cache import BatchCache
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine, _iter_prefill_chunk_spans
from mtplx.graphbank import CompiledVerifyBank
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams
from pipelines.job.config import build_job

REPO = Path(__file__).resolve().parent.parent
DESIGN_VARS = ("MTPLX_PREFILL_CHUNK_SIZE", "MTPLX_SUSTAINED_PREFILL_LAYOUT", "MTPLX_COMPILED_VERIFY_MAX_LEN")


def test_only_the_config_layer_names_the_design_variables():
    readers = set()
    for path in (REPO / "mtplx").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in DESIGN_VARS:
                readers.add(str(path.relative_to(REPO)))
    assert readers == {"mtplx/config.py"}


def test_sustained_layout_off_is_one_span_for_the_whole_prompt(monkeypatch):
    monkeypatch.delenv("MTPLX_SUSTAINED_PREFILL_LAYOUT", raising=False)
    assert list(_iter_prefill_chunk_spans(3000, 512, (1024,)))[:3] == [(0, 512), (512, 1024), (1024, 1536)]
    for off in ("0", "off", "false"):
        monkeypatch.setenv("MTPLX_SUSTAINED_PREFILL_LAYOUT", off)
        assert list(_iter_prefill_chunk_spans(3000, 512, (1024,))) == [(0, 3000)]
    monkeypatch.setenv("MTPLX_SUSTAINED_PREFILL_LAYOUT", "sometimes")
    with pytest.raises(ValueError, match="MTPLX_SUSTAINED_PREFILL_LAYOUT"):
        list(_iter_prefill_chunk_spans(3000, 512))


def test_engine_without_the_sustained_layout_prefills_each_prompt_at_once(monkeypatch, tiny_model):
    bundle = load(tiny_model("llama"))
    prompts = [list(range(3, 3 + n)) for n in (23, 40, 9)]

    def run():
        eng = Engine(bundle, SpeculativeConfig(method="ngram", depth=2, compiled_verify="off"),
                     ScheduleConfig(max_batch=2, prefill_chunk=8))
        reqs = [Request(i, p, SamplingParams(max_tokens=5), stable_prefix_len=6) for i, p in enumerate(prompts)]
        return {r.key: r for r in eng.generate(reqs)}

    monkeypatch.delenv("MTPLX_SUSTAINED_PREFILL_LAYOUT", raising=False)
    chunked = run()
    assert max(r.stats.prefill_chunks for r in chunked.values()) > 1
    monkeypatch.setenv("MTPLX_SUSTAINED_PREFILL_LAYOUT", "0")
    whole = run()
    assert [whole[i].stats.prefill_chunks for i in range(3)] == [1, 1, 1]
    assert [whole[i].tokens for i in range(3)] == [chunked[i].tokens for i in range(3)]


def test_verify_max_len_is_a_job_field(monkeypatch, tiny_model):
    monkeypatch.delenv("MTPLX_COMPILED_VERIFY_MAX_LEN", raising=False)
    job = build_job({"name": "x", "model": {"path": "m"}, "input": {"path": "in.jsonl"},
                     "speculative": {"method": "ngram", "depth": 1, "verify_max_len": 2}, "output": {"dir": "out"}})
    assert job.speculative.verify_max_len == 2
    bundle = load(tiny_model("qwen3"))
    eng = Engine(bundle, job.speculative, ScheduleConfig(max_batch=1))
    assert eng.bank.growth_limit == 2
    cache = BatchCache.for_model(bundle.model, 1)
    bundle.model(mx.array([[5, 6, 7]]), cache=cache.layers)
    cache.commit([3])
    _, _, compiled, _ = eng.bank.verify(mx.array([[5, 6, 7, 8]], dtype=mx.int32), cache)
    assert not compiled and any("verify_max_len" in r for r in eng.bank.stats["fallback_reasons"])
    assert CompiledVerifyBank(eng.runtime, 4).growth_limit == 8  # neither the field nor the variable
