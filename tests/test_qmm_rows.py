"""mtplx/qmm_rows.py: a quantized product of many rows over x [W, L, K] runs as one [W * L, K] matrix, and
stacked quantized siblings take their stacked product there too; the values stay bit for bit (here on the
CPU, forced: the engine installs it on CUDA only), and the engine's greedy text is mlx-lm's.
benchmarks/qmm_shapes checks the kernels and their bits on the GPU."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtplx import qmm_rows
from mtplx.fusion import StackedPart, fuse_projections
from mtplx.models.loading import load


def _primitives(y):
    from benchmarks.round_graph import graph_primitives

    return graph_primitives([y])


@pytest.fixture(autouse=True)
def switches_on(monkeypatch):
    monkeypatch.setattr(qmm_rows, "ONE_MATRIX", True)
    monkeypatch.setattr(qmm_rows, "WHOLE", True)


@pytest.mark.parametrize("shape", [(1, 4), (2, 3), (8, 1), (2, 8), (32, 4)])
def test_a_product_of_many_rows_is_one_matrix_with_the_same_values(monkeypatch, shape):
    mx.random.seed(0)
    plain = nn.QuantizedLinear.from_linear(nn.Linear(64, 96, bias=True), 32, 4)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(64, 96, bias=True), 32, 4)
    layer.update(plain.parameters())
    emb = nn.QuantizedEmbedding(96, 64, 32, 4)
    mx.eval(plain.parameters(), layer.parameters(), emb.parameters())
    assert qmm_rows.install(nn.Sequential(layer, emb)) == 2
    assert type(layer) is qmm_rows.MatrixQuantizedLinear and type(emb) is qmm_rows.MatrixQuantizedEmbedding
    x = mx.random.normal(shape + (64,), key=mx.random.key(1))
    mx.eval(x)
    many = shape[0] * shape[1] > qmm_rows.QMV_ROWS
    for y, ref in ((layer(x), plain(x)), (emb.as_linear(x), nn.QuantizedEmbedding.as_linear(emb, x))):
        assert _primitives(y)["Reshape"] == (2 if many else 0)  # rows in, rows out: one [rows, K] product
        assert y.shape == ref.shape and np.array_equal(np.array(y), np.array(ref))
    monkeypatch.setattr(qmm_rows, "ONE_MATRIX", False)  # read at call time: the product as before
    assert _primitives(layer(x))["Reshape"] == 0


@pytest.fixture
def llama(tiny_model):
    bundle = load(tiny_model("llama"))
    nn.quantize(bundle.model, group_size=32, bits=4)
    return bundle


def test_a_model_keeps_its_logits_and_takes_one_product_a_stacked_group(llama, monkeypatch):
    """Tiny llama, q/k/v and gate/up stacked: past QMV_ROWS rows (2 rows x 8 tokens) each group is one
    product, split; the logits stay bit for bit at few rows and many."""
    from tiny_models import greedy_logits

    model = llama.model
    L = len(model.model.layers)
    few, many = mx.array([[5, 9, 13, 21]], dtype=mx.int32), mx.array([list(range(5, 13)), list(range(30, 38))], dtype=mx.int32)
    ref_few, ref_many, ref_steps = model(few), model(many), greedy_logits(model, 4)
    count = _primitives(model(many))["QuantizedMatmul"]
    fuse_projections(model)
    assert qmm_rows.install(model) == 9 * L + 2 and qmm_rows.install(model) == 0  # stacked layers + their views, o, down; embedding, lm_head; once
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, StackedPart) and attn.q_proj._stacked[0].whole
    assert type(attn.o_proj) is qmm_rows.MatrixQuantizedLinear
    for tokens, ref in ((few, ref_few), (many, ref_many)):
        assert np.array_equal(np.array(model(tokens)), np.array(ref))
    assert _primitives(model(many))["QuantizedMatmul"] == count - 3 * L  # q/k/v 3 -> 1, gate/up 2 -> 1
    assert all(np.array_equal(a, b) for a, b in zip(greedy_logits(model, 4), ref_steps))
    monkeypatch.setattr(qmm_rows, "WHOLE", False)
    assert _primitives(model(many))["QuantizedMatmul"] == count


@pytest.mark.parametrize("method", ["none", "ngram", "mtp"])
def test_engine_with_quantized_rows_is_token_identical(llama, tmp_path, monkeypatch, method):
    """Where the engine installs it (CUDA; forced here) its greedy text is mlx-lm's plain decoding: 8 rows a
    plain step and 24 / 32 a verify, past QMV_ROWS, so both take one matrix and the stacked products."""
    import mtplx.fusion as fusion
    import mtplx.generation as generation
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.request import Request, SamplingParams
    from mtplx.training.train_head import TrainConfig, _init_head, save_sidecar

    from tiny_models import reference_tokens

    prompts = [[5, 9, 13, 5, 9, 13, 5], [7, 3, 7, 3, 7, 3, 7, 3], [11, 12], list(range(20, 40)), [4] * 9,
               [30, 31, 30, 31], [8, 6, 8, 6, 8, 6], list(range(60, 45, -1))]
    eos = set(llama.tokenizer.eos_token_ids)
    refs = [reference_tokens(llama.model, p, 10, eos) for p in prompts]
    head = None
    if method == "mtp":
        head = str(save_sidecar(llama, _init_head(llama.model, TrainConfig(seed=3)), tmp_path / "head", {}))
    monkeypatch.setattr(fusion, "stacking_pays", lambda: True)
    monkeypatch.setattr(qmm_rows, "cuda_ready", lambda: True)
    depth = 3 if method == "mtp" else 2
    eng = generation.Engine(llama, SpeculativeConfig(method=method, depth=depth, adaptive_depth=False, compiled_verify="on",
                                                     mtp_head=head), ScheduleConfig(max_batch=8))
    assert eng.decode_paths["quantized_rows"] == 9 * len(llama.model.model.layers) + 2
    out = {r.key: r.tokens for r in eng.generate([Request(i, list(p), SamplingParams(max_tokens=10))
                                                   for i, p in enumerate(prompts)])}
    assert [out[i] for i in range(len(prompts))] == refs


def test_the_drafting_vocabulary_still_reads_the_quantized_rows(llama):
    """mtp_bank.plain_rows dequantizes a quantized head's rows: the layers qmm_rows gave
    its classes (the tied embedding, an lm_head) are still quantized layers there."""
    from mtplx.drafting import mtp_bank
    from mtplx.training.train_head import TrainConfig, _init_head

    head = _init_head(llama.model, TrainConfig(seed=3))
    ids = mx.array([0, 7, 9, 100, 511])
    before = mtp_bank.plain_rows(head, ids)
    qmm_rows.install(llama.model)
    assert type(llama.model.lm_head) is qmm_rows.MatrixQuantizedLinear
    after = mtp_bank.plain_rows(head, ids)
    assert before is not None and after is not None and np.array_equal(np.array(before), np.array(after))
