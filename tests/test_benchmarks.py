"""The benchmark harness's own machinery: what it hands a peer, and what its profiler changes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from benchmarks import phase_profile
from benchmarks.torch_peer import HF_KEYS, dense_weights
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dense_weights_reproduce_the_quantized_model(tiny_model, family):
    """The PyTorch peer gets dense weights: loaded into an unquantized twin, they give the same logits."""
    quantized = load(tiny_model(family)).model
    nn.quantize(quantized, group_size=32, bits=4)
    dense = dense_weights(quantized)
    assert not any(k.endswith((".scales", ".biases")) for k in dense)

    twin = load(tiny_model(family)).model  # same architecture, unquantized
    names = {k for k, _ in tree_flatten(twin.parameters())}
    assert set(dense) == names
    twin.update(tree_unflatten([(k, mx.array(v)) for k, v in dense.items()]))
    tokens = mx.array([[3, 17, 42, 99, 5, 8]])
    np.testing.assert_allclose(np.array(twin(tokens)), np.array(quantized(tokens)), rtol=1e-4, atol=1e-4)


def test_peer_config_keys_come_from_the_model_config(tiny_model):
    config = load(tiny_model("qwen3")).config
    assert {"model_type", "hidden_size", "num_hidden_layers", "vocab_size"} <= {k for k in HF_KEYS if k in config}


def test_phase_profile_times_phases_without_changing_output(tiny_model):
    bundle = load(tiny_model("llama"))
    prompts = [[1, 5, 9, 12, 7, 5, 9, 12], [4, 4, 8, 15, 16, 23, 42], [2, 3]]

    def run(instrumented: bool):
        eng = Engine(bundle, SpeculativeConfig(method="ngram", depth=3, adaptive_depth=False), ScheduleConfig(max_batch=2))
        if instrumented:
            phase_profile.instrument(eng)
        reqs = [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)]
        return {r.key: r.tokens for r in eng.generate(reqs)}

    phase_profile.TIMES.clear()
    plain = run(False)
    assert run(True) == plain
    phases = set(phase_profile.TIMES)
    assert "verify (incl. compiles)" in phases and any(p.startswith("prefill") for p in phases)
    assert phase_profile.CALLS["verify program compile (first call)"] >= 1
