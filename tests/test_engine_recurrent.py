"""Exact per-row rollback for conv/SSM, sliding-window and composite caches, and refusals.

Drives the batch cache directly, as test_engine_hybrid does for Gated DeltaNet: rows of
different lengths are prefilled, a capturing verify forward runs K+1 tokens, each row commits
its own count (1..K+1: every partial accept), and the next token's logits must equal a fresh
cache-less forward (mlx-lm's own code) of prompt + accepted tokens + that token. The verify
runs eagerly or through the CompiledVerifyBank. Then: a layer or cache kind the engine does not
know is refused before any row runs, naming the architecture and the class.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx import recurrent
from mtplx.architectures import capture_backend, prepare
from mtplx.cache import BatchCache, RowKVCache, UnsupportedArchitecture
from mtplx.config import SpeculativeConfig
from mtplx.generation import Engine
from mtplx.graphbank import CompiledVerifyBank
from mtplx.models.loading import load

from arch_fixtures import make_arch_model

K = 4
ARCHS = ["lfm2", "nemotron_h", "falcon_h1", "gemma3_text", "gpt_oss"]


class _Runtime:
    def __init__(self, model):
        self.model = model

    def forward(self, tokens, cache):
        return self.model(tokens, cache=cache.layers), None


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent")
    return lambda arch: make_arch_model(root / arch, arch)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("arch", ARCHS)
def test_partial_accept_then_next_token_matches_fresh_forward(arch_dir, arch, mode):
    bundle = load(arch_dir(arch))
    model = bundle.model
    prepare(model, arch, 512)  # the start-up probe passes too
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 13, 21)]  # past the sliding windows (8)
    singles = []
    for p in prompts:
        c = BatchCache.for_model(model, 1)
        model(mx.array([p], dtype=mx.int32), cache=c.layers)
        c.commit([len(p)])
        singles.append(c)
    cache = BatchCache.stack(singles)
    verify = rng.integers(3, 500, (3, K + 1)).astype(np.int32)
    counts = np.array([1, 3, K + 1])
    if mode == "eager":
        cache.set_capturing(True)
        model(mx.array(verify), cache=cache.layers)
        cache.set_capturing(False)
    else:
        bank = CompiledVerifyBank(_Runtime(model), max_verify_len=K + 1, capture_backend=capture_backend(model))
        assert bank.verify(mx.array(verify), cache)[2], bank.stats
    cache.commit(counts)
    nxt = rng.integers(3, 500, 3).astype(np.int32)
    got = model(mx.array(nxt[:, None]), cache=cache.layers)[:, -1]
    for b, p in enumerate(prompts):
        ref = model(mx.array([p + verify[b, : counts[b]].tolist() + [int(nxt[b])]], dtype=mx.int32))[0, -1]
        np.testing.assert_allclose(np.array(got[b]), np.array(ref), atol=1e-4, rtol=1e-4, err_msg=f"{arch} row {b}")


@pytest.mark.parametrize("arch, backend", [("lfm2", "recurrent"), ("nemotron_h", "recurrent"), ("gemma3_text", None)])
def test_the_bank_knows_the_capture_backend_the_layers_use(arch_dir, arch, backend):
    """Conv/SSM layers step through recurrent.py, not Gated DeltaNet: the engine's bank says so, and
    a bank told otherwise refuses the model."""
    bundle = load(arch_dir(arch))
    eng = Engine(bundle, SpeculativeConfig(method="ngram", compiled_verify="on"))
    assert eng.bank.stats["capture_backend"] == backend
    with pytest.raises(ValueError, match="capture_backend='gdn' but the model's layers use"):
        CompiledVerifyBank(_Runtime(bundle.model), max_verify_len=K + 1, capture_backend="gdn")


def test_unknown_recurrent_layer_is_refused_naming_it(arch_dir):
    """mlx-lm's mamba: its MambaBlock has no capture backend, so the probe refuses it."""
    bundle = load(arch_dir("mamba"))
    with pytest.raises(UnsupportedArchitecture, match=r"architecture 'mamba'.*no capture backend"):
        Engine(bundle, SpeculativeConfig(method="none"))


def test_two_layers_writing_one_recurrent_cache_are_refused_naming_them(arch_dir):
    bundle = load(arch_dir("rwkv7"))
    with pytest.raises(UnsupportedArchitecture, match=r"architecture 'rwkv7'.*Rwkv7ChannelMixing, Rwkv7TimeMixing"):
        Engine(bundle, SpeculativeConfig(method="none"))


def test_a_layer_without_its_capture_is_refused_naming_it(arch_dir, monkeypatch):
    monkeypatch.setattr(recurrent, "STEPPED_LAYERS", recurrent.STEPPED_LAYERS - {("mlx_lm.models.lfm2", "ShortConv")})
    bundle = load(arch_dir("lfm2"))  # a fresh model: no capture installed on it yet
    with pytest.raises(UnsupportedArchitecture, match=r"architecture 'lfm2'.*ShortConv.*no capture backend"):
        Engine(bundle, SpeculativeConfig(method="none"))


def test_unknown_cache_kind_is_refused_naming_it(arch_dir, monkeypatch):
    from mlx_lm.models.cache import ChunkedKVCache

    bundle = load(arch_dir("llama"))
    monkeypatch.setattr(type(bundle.model), "make_cache", lambda self: [ChunkedKVCache(16) for _ in self.layers],
                        raising=False)
    with pytest.raises(UnsupportedArchitecture, match=r"architecture 'llama'.*ChunkedKVCache"):
        Engine(bundle, SpeculativeConfig(method="ngram"))


def test_wrong_logits_are_refused_before_any_row(arch_dir, monkeypatch):
    """A cache that runs but computes the wrong thing (here: sliding-window mask ignored) is caught
    by the start-up probe against mlx-lm's own forward, not run."""
    original = RowKVCache.make_mask
    monkeypatch.setattr(RowKVCache, "make_mask", lambda self, N, window_size=None, **kw: original(self, N, **kw))
    bundle = load(arch_dir("gemma3_text"))
    with pytest.raises(UnsupportedArchitecture, match=r"architecture 'gemma3_text'.*differ from mlx-lm"):
        Engine(bundle, SpeculativeConfig(method="none"))


def test_dynamic_ntk_rope_per_row_past_the_trained_context():
    """Rows of one batch at offsets below and past max_position_embeddings: each row's rotation
    equals mlx-lm's own single-row call at its offset (which picks its base from it)."""
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    from mtplx.adapters import install_adapters

    plain = DynamicNTKScalingRoPE(16, max_position_embeddings=12, traditional=False, base=10000.0, factor=2.0)
    batched = DynamicNTKScalingRoPE(16, max_position_embeddings=12, traditional=False, base=10000.0, factor=2.0)
    holder = type("Holder", (__import__("mlx.nn", fromlist=["Module"]).Module,), {})()
    holder.rope = batched
    assert install_adapters(holder) == 1
    offsets = [2, 9, 30]
    x = mx.array(np.random.default_rng(0).standard_normal((3, 2, 4, 16)).astype(np.float32))
    got = holder.rope(x, offset=mx.array(offsets, dtype=mx.int32))
    for b, off in enumerate(offsets):
        np.testing.assert_allclose(np.array(got[b]), np.array(plain(x[b : b + 1], offset=off)[0]), atol=1e-4)


def test_cli_run_refuses_an_unknown_layer_before_any_row(arch_dir, tmp_path):
    """`mtplx-batch run` on a model the engine would get wrong: exit 2, the architecture and the
    layer named, no row written."""
    from click.testing import CliRunner

    from jobkit import job_dict, write_job, write_jsonl
    from pipelines.cli import main

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(3)])
    job = write_job(tmp_path / "job.yaml", job_dict(arch_dir("mamba"), data, tmp_path / "run", fmt="jsonl"))
    res = CliRunner().invoke(main, ["run", str(job), "-q"], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "architecture 'mamba'" in res.output and "no capture backend" in res.output
    assert not list((tmp_path / "run").glob("shards/*.parquet"))
