"""The training loss. Over the drafting vocabulary: with `--draft-vocab N` the head's loss compares
its distribution and the trunk's over those N tokens alone (renormalized), as drafting does; over
the whole vocabulary it is the loss without one. Padding a batch to one fixed length (what a GPU
run does, so every step has one shape) does not change it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.models.loading import load
from mtplx.models.mtp import MTPHead, project_logits
from mtplx.drafting.mtp_bank import DraftVocab
from mtplx.training.head_eval import _causal
from mtplx.training.train_head import _loss


def _setup(tiny_model):
    bundle = load(tiny_model("llama"))
    mx.random.seed(0)
    head = MTPHead(bundle.model)
    _causal(head, 2)
    rng = np.random.default_rng(0)
    B, L, D = 2, 12, head.fc.weight.shape[0]
    hidden = mx.array(rng.standard_normal((B, L, D)).astype(np.float32))
    teacher = mx.array(rng.standard_normal((B, L + 1, D)).astype(np.float32))
    tokens = mx.array(rng.integers(3, 500, (B, L)).astype(np.int32))
    targets = mx.array(rng.integers(3, 500, (B, L)).astype(np.int32))
    mask = mx.ones((B, L))
    return bundle, head, hidden, teacher, tokens, targets, mask


def _index(vocab, V):
    table = np.full(V, -1, dtype=np.int32)
    table[np.array(vocab.ids)] = np.arange(vocab.size, dtype=np.int32)
    return mx.array(table)


@pytest.mark.parametrize("kind", ["kl", "tokens"])
def test_loss_over_the_whole_vocabulary_is_the_plain_loss(tiny_model, kind):
    bundle, head, hidden, teacher, tokens, targets, mask = _setup(tiny_model)
    V = bundle.vocab_size
    vocab = DraftVocab(head, np.arange(V), V)
    plain = _loss(head, hidden, tokens, targets, mask, 2, teacher, kind)
    sub = _loss(head, hidden, tokens, targets, mask, 2, teacher, kind, 0.0, vocab, _index(vocab, V))
    assert abs(plain.item() - sub.item()) < 1e-4 * max(1.0, abs(plain.item()))


def test_kl_over_a_subset_renormalizes_both_distributions(tiny_model):
    bundle, head, hidden, teacher, tokens, targets, mask = _setup(tiny_model)
    V = bundle.vocab_size
    ids = np.sort(np.random.default_rng(1).choice(V, 64, replace=False))
    vocab = DraftVocab(head, ids, V)
    got = _loss(head, hidden, tokens, targets, mask, 1, teacher, "kl", 0.0, vocab, _index(vocab, V)).item()
    # reference: the full logits of head and trunk, cut to the subset, each renormalized there
    _, logits = head(hidden, tokens, mask=_causal(head, tokens.shape[1]))
    s = np.array(logits)[..., ids].astype(np.float64)
    t = np.array(project_logits(bundle.model, teacher[:, : tokens.shape[1]]))[..., ids].astype(np.float64)
    logq = s - np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)) - s.max(-1, keepdims=True)
    p = np.exp(t - t.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = float(-(p * logq).sum(-1).mean())
    assert abs(got - want) < 1e-3 * max(1.0, abs(want))
    full = _loss(head, hidden, tokens, targets, mask, 1, teacher, "kl").item()
    assert abs(full - want) > 0.1  # the subset loss is another quantity than the full one


def test_a_batch_padded_to_a_fixed_length_gives_the_same_loss(tiny_model):
    from mtplx.training.head_data import trunk_features
    from mtplx.training.head_eval import _batch

    bundle, head, *_ = _setup(tiny_model)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 500, n).tolist() for n in (17, 30, 41)]
    feats = trunk_features(bundle.model, seqs, [0, 5, 2], mx.float32, False)
    losses = []
    for length in (None, 128):
        hidden, tok, tgt, m, _, teacher = _batch(feats, [0, 1, 2], mx.float32, length)
        assert tok.shape[1] == (64 if length is None else 128) - 2
        losses.append(_loss(head, hidden, tok, tgt, m, 3, teacher, "kl", 0.1).item())
    assert abs(losses[0] - losses[1]) < 1e-5 * abs(losses[0])


def test_fit_steps_plans_the_schedule_into_the_time_limit_and_a_rerun_keeps_it(tiny_model, tmp_path):
    """--fit-steps: after timing steps 25-125 the cosine schedule is re-planned to the steps the time
    left holds (at most --steps), the learning rate follows that plan from then on, the plan is in
    mtp_head.json and the checkpoint, and rerunning the finished run keeps it (trains nothing)."""
    import json
    from dataclasses import replace

    from mtplx.models.mtp import SIDECAR_META
    from mtplx.training.train_head import FIT_PROBE, TrainConfig, _schedule, train_head

    bundle = load(tiny_model("llama"))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 500, 40).tolist() for _ in range(24)]
    cfg = TrainConfig(steps=100_000, batch_size=2, seq_len=64, heldout=0.1, eval_every=50, checkpoint_every=50,
                      max_seconds=12.0, fit_steps=True)
    lrs = {}
    train_head(bundle, seqs, tmp_path / "h", cfg, callback=lambda s, m: lrs.__setitem__(s, m["lr"]))
    meta = json.loads((tmp_path / "h" / SIDECAR_META).read_text())
    planned = meta["planned_steps"]
    assert FIT_PROBE[1] < planned < 100_000
    want = _schedule(replace(cfg, steps=planned))
    for s in [k for k in lrs if k > FIT_PROBE[1]][:50]:
        assert abs(lrs[s] - want(mx.array(s - 1)).item()) < 1e-9 + 1e-6 * lrs[s]
    if meta["steps"] == planned:  # ended on its schedule (a loaded machine may hit the limit first)
        assert abs(lrs[planned] - cfg.lr * cfg.min_lr_ratio) < 0.05 * cfg.lr * cfg.min_lr_ratio  # the cosine's end
    again = train_head(bundle, seqs, tmp_path / "h", cfg)
    assert json.loads((tmp_path / "h" / SIDECAR_META).read_text())["planned_steps"] == planned
    assert again.resumed_from == again.steps == meta["steps"] or again.steps == planned
