"""train-head's bfloat16 training step (`train_dtype`, auto: bfloat16 on a GPU): the forward and
backward run over a bfloat16 copy of the head's float32 parameters, the optimizer gets float32
gradients, and the head keeps its float32 parameters (evaluated and saved as before).

On a GPU the float32 step is bound by float32 arithmetic (0.066 s for 32 x 448 at 3
depths, about the H200's float32 rate); these tests show the bfloat16 step computes in bfloat16
over a float16 trunk (the GGUF trunk on a GPU), gives the float32 step's gradients to bfloat16
precision, leaves the parameters float32 and trains a head.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mtplx.models.loading import load
from mtplx.models.mtp import SIDECAR_WEIGHTS, MTPHead
from mtplx.training.head_data import trunk_features
from mtplx.training.head_eval import _batch
from mtplx.training.train_head import TrainConfig, _init_head, _loss, _value_and_grad, train_head


def _setup(tiny_model, trunk_dtype="float16"):
    bundle = load(tiny_model("llama", dtype=trunk_dtype))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 500, size=int(rng.integers(24, 40))).tolist() for _ in range(6)]
    feats = trunk_features(bundle.model, seqs, [2] * len(seqs), mx.float32, False)
    head = _init_head(bundle.model, TrainConfig(seed=0))
    return bundle, head, feats


def test_head_computes_in_its_own_dtype_over_a_float16_trunk(tiny_model):
    """With bfloat16 parameters over a float16 trunk (embedding output float16), the head's output is
    bfloat16: the embedding is cast to the head's dtype (float16 x bfloat16 would promote the whole
    head to float32, which is what the step is meant to avoid)."""
    bundle, head, feats = _setup(tiny_model)
    hidden, tok, _, _, _, _ = _batch(feats, [0, 1], mx.bfloat16)
    assert head.embed(tok).dtype == mx.float16
    head.update(tree_map(lambda p: p.astype(mx.bfloat16), head.parameters()))
    assert head.hidden(hidden, tok).dtype == mx.bfloat16


def test_bfloat16_step_gives_float32_gradients_close_to_the_float32_step(tiny_model):
    bundle, head, feats = _setup(tiny_model, "float32")
    before = {k: np.array(v) for k, v in tree_flatten(head.trainable_parameters())}
    args32 = _batch(feats, list(range(6)), mx.float32)
    args16 = _batch(feats, list(range(6)), mx.bfloat16)

    def grads(dtype, args):
        hidden, tok, tgt, m, _, teacher = args
        loss, g = _value_and_grad(head, _loss, dtype)(head, hidden, tok, tgt, m, 3, teacher, "kl", 0.1)
        return loss.item(), dict(tree_flatten(g))

    l32, g32 = grads(mx.float32, args32)
    l16, g16 = grads(mx.bfloat16, args16)
    assert l16 == pytest.approx(l32, rel=0.02)
    assert set(g16) == set(g32)
    for k, g in g16.items():
        assert g.dtype == mx.float32, k
        a, b = np.array(g).ravel(), np.array(g32[k]).ravel()
        cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
        assert cos > 0.98, (k, cos)
    after = dict(tree_flatten(head.trainable_parameters()))
    for k, v in before.items():  # the head keeps its float32 parameters, unchanged by the step
        assert after[k].dtype == mx.float32 and np.array_equal(np.array(after[k]), v), k


def test_training_in_bfloat16_learns_and_keeps_float32_parameters(tiny_model, tmp_path):
    bundle = load(tiny_model("llama"))
    rng = np.random.default_rng(1)
    # repeated fragments: a head can learn them in a few steps
    base = [rng.integers(3, 500, size=8).tolist() for _ in range(4)]
    seqs = [sum((base[int(j)] for j in rng.integers(0, 4, size=5)), []) for _ in range(24)]
    cfg = TrainConfig(steps=40, batch_size=4, seq_len=64, lr=3e-3, eval_every=20, checkpoint_every=20,
                      train_dtype="bfloat16", draft_vocab=0)
    res = train_head(bundle, seqs, tmp_path / "head", cfg)
    assert res.heldout_loss < res.initial_heldout_loss - 0.5
    saved = mx.load(str(tmp_path / "head" / "checkpoint" / "latest" / "head.safetensors"))
    assert all(v.dtype == mx.float32 for v in saved.values())
    assert (tmp_path / "head" / SIDECAR_WEIGHTS).exists()


def test_train_dtype_is_checked():
    from mtplx.training.train_head import TrainHeadError

    with pytest.raises(TrainHeadError, match="train_dtype must be auto, float32 or bfloat16"):
        TrainConfig(train_dtype="float16").check()


def test_a_backend_that_cannot_run_the_bfloat16_step_trains_in_float32(tiny_model, tmp_path, monkeypatch):
    """The first bfloat16 step failing (a backend without some bfloat16 kernel) leaves the head and the
    optimizer as they were and trains in float32 from there; mtp_head.json says which was used."""
    import json

    from mtplx.training import train_head as th

    real = th._value_and_grad

    def failing(head, loss_fn, dtype):
        if dtype == mx.bfloat16:
            def run(*args):
                raise RuntimeError("no bfloat16 kernel here")
            return run
        return real(head, loss_fn, dtype)

    monkeypatch.setattr(th, "_value_and_grad", failing)
    bundle = load(tiny_model("llama"))
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, 500, size=int(rng.integers(20, 40))).tolist() for _ in range(16)]
    cfg = dict(steps=10, batch_size=4, seq_len=64, lr=3e-3, eval_every=10, checkpoint_every=10)
    lines = []
    res = train_head(bundle, seqs, tmp_path / "a", TrainConfig(**cfg, train_dtype="bfloat16"), log=lines.append)
    assert any("training step failed (no bfloat16 kernel here): training in float32" in l for l in lines)
    assert json.loads((tmp_path / "a" / "mtp_head.json").read_text())["train_dtype"] == "float32"
    # the same run as one asked for float32 from the start
    ref = train_head(bundle, seqs, tmp_path / "b", TrainConfig(**cfg, train_dtype="float32"))
    assert res.heldout_loss == pytest.approx(ref.heldout_loss, abs=1e-5)
