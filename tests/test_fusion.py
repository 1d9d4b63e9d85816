"""mtplx/kernels/fusion.py: stacked q/k/v and gate/up give the model's own logits bit for bit (one-row
steps take the stacked product, a prompt takes each original layer), and unstack restores the model.
mtplx/kernels/rows_attention.py is CUDA-only: elsewhere nothing is swapped. The engine with stacked
projections (forced on here) gives mlx-lm's text."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtplx.kernels.fusion import StackedPart, fuse_projections, unstack
from mtplx.models.loading import load


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return load(tiny_model("qwen3", dtype="bfloat16")).model


def _logits(model, n=8):
    from tiny_models import greedy_logits

    return greedy_logits(model, n)


def test_fused_projections_keep_the_logits_and_unstack_restores(qwen3):
    from mlx.utils import tree_flatten

    nbytes = lambda: sum(v.nbytes for _, v in tree_flatten(qwen3.parameters()))
    ref, before = _logits(qwen3), nbytes()
    count = fuse_projections(qwen3)
    assert nbytes() == before  # the stacked weights replace the originals
    layer = qwen3.model.layers[0]
    assert count == 5 * len(qwen3.model.layers) and fuse_projections(qwen3) == 0  # stacked once
    assert isinstance(layer.self_attn.k_proj, StackedPart) and isinstance(layer.mlp.up_proj, StackedPart)
    fused = _logits(qwen3)
    assert unstack(qwen3) == count
    assert type(layer.self_attn.k_proj) is nn.Linear
    assert all(np.array_equal(a, b) for a, b in zip(_logits(qwen3), ref))
    for a, b in zip(fused, ref):
        assert np.array_equal(a, b)


def test_rows_attention_is_mlx_lm_attention_off_cuda(qwen3):
    from mtplx.kernels import rows_attention

    if rows_attention.cuda_ready():
        pytest.skip("on CUDA the kernel runs")
    assert rows_attention.install(qwen3) == 0
    q = mx.ones((1, 2, 1, 64))
    assert not rows_attention.usable(q, q, q)


@pytest.mark.parametrize("family, method", [("qwen3", "none"), ("qwen3", "ngram"), ("llama", "none"), ("qwen3_next", "mtp")])
def test_engine_with_stacked_projections_is_token_identical(tiny_model, monkeypatch, family, method):
    """Where the engine stacks projections (compiled decode on CUDA; forced here on the CPU) its
    greedy text is mlx-lm's plain decoding, through the bank, prefill, MTP drafting and batching."""
    import mtplx.generation as generation
    import mtplx.kernels.fusion as fusion
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.request import Request, SamplingParams

    from tiny_models import reference_tokens

    bundle = load(tiny_model(family))
    tok = bundle.tokenizer
    prompts = [tok.encode(p) for p in ("def add(a, b):\n    return", "the quick brown fox jumps over the lazy dog. the", "import os")]
    refs = [reference_tokens(bundle.model, p, 10, set(tok.eos_token_ids)) for p in prompts]
    monkeypatch.setattr(fusion, "stacking_pays", lambda: True)
    eng = generation.Engine(bundle, SpeculativeConfig(method=method, depth=2, adaptive_depth=False, compiled_verify="on"),
                            ScheduleConfig(max_batch=2))
    assert eng.decode_paths["stacked_projections"] > 0
    out = {r.key: r.tokens for r in eng.generate([Request(i, list(p), SamplingParams(max_tokens=10)) for i, p in enumerate(prompts)])}
    assert [out[i] for i in range(len(prompts))] == refs
    assert unstack(bundle.model) == eng.decode_paths["stacked_projections"]
    assert [reference_tokens(bundle.model, p, 10, set(tok.eos_token_ids)) for p in prompts] == refs


def test_quantized_projections_stack_exactly(tiny_model):
    import mlx.nn as nn

    model = load(tiny_model("qwen3")).model
    nn.quantize(model, group_size=32, bits=4)
    ref = _logits(model)
    assert fuse_projections(model) == 5 * len(model.model.layers)
    for a, b in zip(_logits(model), ref):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("group, per_layer", [("qkv", 3), ("mlp", 2)])
def test_one_group_stacks_alone_and_keeps_the_logits(qwen3, group, per_layer):
    from mtplx.kernels.fusion import GROUPS

    names = GROUPS[0] if group == "qkv" else GROUPS[1]
    ref = _logits(qwen3)
    assert fuse_projections(qwen3, [names]) == per_layer * len(qwen3.model.layers)
    layer = qwen3.model.layers[0]
    stacked = {k for k in ("q_proj", "k_proj", "v_proj") if isinstance(layer.self_attn[k], StackedPart)}
    stacked |= {k for k in ("gate_proj", "up_proj") if isinstance(layer.mlp[k], StackedPart)}
    assert stacked == set(names)
    got = _logits(qwen3)
    assert unstack(qwen3) == per_layer * len(qwen3.model.layers)
    for a, b in zip(got, ref):
        assert np.array_equal(a, b)


def test_the_mtp_heads_blocks_stack_as_the_trunks_and_draft_the_same(tiny_model, tmp_path, monkeypatch):
    """Where the trunk's projections are stacked, the MTP head's block is too (its draft steps are
    one-row products, as a plain step is): the same drafts and acceptance, plain decoding's text."""
    import mtplx.generation as generation
    import mtplx.kernels.fusion as fusion
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.request import Request, SamplingParams
    from mtplx.training.train_head import TrainConfig, _init_head, save_sidecar

    from tiny_models import reference_tokens

    bundle = load(tiny_model("llama"))
    head = save_sidecar(bundle, _init_head(bundle.model, TrainConfig(seed=3)), tmp_path / "head", {})
    prompts = [[5, 9, 13, 5, 9, 13, 5], [7, 3, 7, 3, 7, 3, 7, 3], [11, 12]]
    eos = set(bundle.tokenizer.eos_token_ids)
    refs = [reference_tokens(bundle.model, p, 12, eos) for p in prompts]

    def run(stack):
        monkeypatch.setattr(fusion, "stacking_pays", lambda: stack)
        eng = generation.Engine(bundle, SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, compiled_verify="on",
                                                          mtp_head=str(head)), ScheduleConfig(max_batch=1))
        out = {r.key: r for r in eng.generate([Request(i, list(p), SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)])}
        return eng, [(out[i].tokens, out[i].stats.accepted_tokens, out[i].stats.accepted_by_depth) for i in range(len(prompts))]

    eng, stacked = run(True)
    assert eng.decode_paths["head_stacked_projections"] == 5 * len(eng.drafter.head.layers)
    assert any(isinstance(m, fusion.StackedPart) for _, m in eng.drafter.head.named_modules())
    unstack(bundle.model)
    _, plain = run(False)
    assert [t for t, _, _ in stacked] == refs
    assert stacked == plain


def test_a_few_row_product_of_quantized_layers_stacks_with_the_same_bits(tiny_model):
    """A verify of a few tokens at one stream (4 rows) takes the stacked product where it keeps the
    values: quantized layers under MLX's CUDA vector kernel (fusion.few_rows: up to QMV_ROWS rows; set
    here on the CPU, whose quantized product is row-independent too); elsewhere, and past that, each
    sibling's own product. Logits bit for bit; one product a group instead of three (two)."""
    from graphkit import graph_primitives
    from mtplx.kernels.device import cuda_ready
    from mtplx.kernels.fusion import QMV_ROWS, few_rows

    model = load(tiny_model("llama")).model
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[5, 9, 13, 21]], dtype=mx.int32)
    ref = model(tokens)
    mx.eval(ref)
    plain_count = graph_primitives([model(tokens)])["QuantizedMatmul"]
    assert few_rows(model.model.layers[0].self_attn.q_proj) == (QMV_ROWS if cuda_ready() else 1)
    fuse_projections(model)
    parts = {id(m._stacked[0]): m._stacked[0] for _, m in model.named_modules() if isinstance(m, StackedPart)}
    for st in parts.values():
        assert st.few_rows in (1, QMV_ROWS)
        st.few_rows = QMV_ROWS  # as on CUDA
    out = model(tokens)
    stacked_count = graph_primitives([out])["QuantizedMatmul"]
    assert np.array_equal(np.array(out), np.array(ref))
    assert stacked_count == plain_count - 3 * len(model.model.layers)  # q/k/v 3 -> 1, gate/up 2 -> 1
    long = mx.array([list(range(5, 5 + QMV_ROWS + 1))], dtype=mx.int32)  # past QMV_ROWS: own products
    assert graph_primitives([model(long)])["QuantizedMatmul"] == plain_count


def _head_matmuls(head, bundle, L):
    """Matmul primitives of the head's forward over L tokens of one row (no cache)."""
    from graphkit import graph_primitives

    hidden = mx.random.normal((1, L, head.fc.weight.shape[0]), key=mx.random.key(1)).astype(head.fc.weight.dtype)
    tokens = mx.array([list(range(5, 5 + L))], dtype=mx.int32)
    out = head.hidden(hidden, tokens)
    return graph_primitives([out])["Matmul"], out


def test_the_mtp_heads_float_products_of_a_few_rows_are_vector_products(tiny_model, tmp_path, monkeypatch):
    """Where the engine stacks (compiled CUDA decode; forced here) the float head's blocks and fc are
    RowsLinear (fusion.head_gemv): its commit over a few verified tokens takes MLX's matrix-vector product
    (on CUDA one graph node, not a captured cuBLAS GEMM), a row's values those of its one-row product, so
    the stacked q/k/v and gate/up take a few rows too: 5 products a commit of 4 tokens instead of 8. Past
    GEMV_ROWS each sibling takes its own. The text is plain decoding's at widths 1-4, as where nothing is
    stacked."""
    import mtplx.generation as generation
    import mtplx.kernels.fusion as fusion
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.request import Request, SamplingParams

    from tiny_models import reference_tokens, untrained_head

    bundle = load(tiny_model("llama"))
    head = untrained_head(bundle, tmp_path / "head")
    rng = np.random.default_rng(11)
    rows = [(rng.integers(3, 400, int(n)).tolist(), int(m)) for n, m in zip([6, 21, 9, 30], [10, 7, 12, 8])]
    eos = set(bundle.tokenizer.eos_token_ids)
    refs = [reference_tokens(bundle.model, p, m, eos) for p, m in rows]

    def engine(width, on):
        monkeypatch.setattr(fusion, "stacking_pays", lambda: on)
        return generation.Engine(bundle, SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, compiled_verify="on",
                                                           mtp_head=str(head)), ScheduleConfig(max_batch=width, order="input"))

    eng = engine(1, True)
    h = eng.drafter.head
    assert eng.decode_paths["head_gemv"] == 7 * len(h.layers) + 1
    assert type(h.fc) is fusion.RowsLinear and fusion.few_rows(h.layers[0].mlp.gate_proj.stacked) == fusion.GEMV_ROWS
    assert eng.drafter.vocab is None or eng.drafter.vocab.step_table(h) is not None  # fc still splits in halves
    off = engine(1, False)
    assert "head_gemv" not in off.decode_paths and type(off.drafter.head.fc) is nn.Linear
    many, ref = _head_matmuls(off.drafter.head, bundle, 4)
    few, out = _head_matmuls(h, bundle, 4)
    assert few == many - 3 * len(h.layers)  # q/k/v 3 -> 1, gate/up 2 -> 1 (fc, o, down as they were)
    assert np.allclose(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32)), atol=1e-5)
    wide = fusion.GEMV_ROWS + 1  # past GEMV_ROWS: each sibling's own product, as unstacked
    assert _head_matmuls(h, bundle, wide)[0] == _head_matmuls(off.drafter.head, bundle, wide)[0] == many
    for width in (1, 2, 3, 4):
        for on in (True, False):
            e = engine(width, on)
            got = {r.key: r.tokens for r in e.generate([Request(i, list(p), SamplingParams(max_tokens=m))
                                                         for i, (p, m) in enumerate(rows)])}
            assert [got[i] for i in range(len(rows))] == refs, (width, on)


def test_the_drafting_vocabularys_projection_keeps_its_values_as_a_vector_product(tiny_model, tmp_path):
    """fusion.head_gemv lays the drafting vocabulary's weight_t out as the transpose of an [S, D] array (on
    CUDA a one-row projection is then MLX's gemv, not a cuBLAS GEMM): the same logits."""
    import mtplx.kernels.fusion as fusion
    from mtplx.models.mtp import load_head
    from mtplx.drafting.mtp_bank import DraftVocab

    from tiny_models import untrained_head

    bundle = load(tiny_model("llama"))
    head = load_head(bundle, str(untrained_head(bundle, tmp_path / "head")))
    vocab = DraftVocab(head, list(range(3, 300, 2)), bundle.vocab_size)
    h = mx.random.normal((2, head.fc.weight.shape[0]), key=mx.random.key(3)).astype(head.norm.weight.dtype)
    ref = vocab.logits(h)
    before = vocab.weight_t
    assert fusion.head_gemv(head, vocab) == 7 * len(head.layers) + 1
    assert vocab.weight_t is not before and vocab.weight_t.shape == before.shape
    assert np.allclose(np.array(vocab.logits(h).astype(mx.float32)), np.array(ref.astype(mx.float32)), atol=1e-5)
