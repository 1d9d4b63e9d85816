"""Hybrid (Gated DeltaNet) rollback: after a partial accept the state is exactly the accepted text's.

Drives the cache directly on the tiny qwen3_next, qwen3_5 and qwen3_5_moe models (3 Gated
DeltaNet layers + 1 attention layer each): prefill a prompt into a BatchCache, run a capturing verify forward over
[pending, d1..dK], commit a partial count, feed one more token, and compare its logits with a
fresh forward (no cache at all) of prompt + accepted tokens + that token. The verify forward
runs eagerly or through the CompiledVerifyBank's shadow cache (the engine's default path).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.cache import BatchCache, RowKVCache, RowStateCache
from mtplx.gdn import install_capture
from mtplx.graphbank import CompiledVerifyBank
from mtplx.models.loading import load

ATOL = 1e-4
K = 4


class _Runtime:
    def __init__(self, model):
        self.model = model

    def forward(self, tokens, cache):
        return self.model(tokens, cache=cache.layers), None


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def hybrid(request, tiny_model, tmp_path_factory):
    """Qwen3-Next (tiny_models) and Qwen3.5 / Qwen3.5-MoE (mtp_fixtures: other projections)."""
    if request.param == "qwen3_next":
        path = tiny_model("qwen3_next")
    else:
        from mtp_fixtures import make_mtp_model

        path = make_mtp_model(tmp_path_factory.mktemp(request.param), request.param)
    bundle = load(path)
    model = bundle.model
    assert install_capture(model) == 3
    return model


def _fresh_logits(model, tokens):
    """Last-position logits of one full forward, no cache (mlx-lm's own code path)."""
    return model(mx.array([tokens], dtype=mx.int32))[0, -1]


def _prefilled(model, prompts):
    singles = []
    for p in prompts:
        c = BatchCache.for_model(model, 1)
        model(mx.array([p], dtype=mx.int32), cache=c.layers)
        c.commit([len(p)])
        c.eval()
        singles.append(c)
    return singles[0] if len(singles) == 1 else BatchCache.stack(singles)


def _verify(model, cache, tokens, mode, bank_holder):
    if mode == "eager":
        cache.set_capturing(True)
        logits = model(tokens, cache=cache.layers)
        cache.set_capturing(False)
        return logits
    bank = bank_holder.setdefault("bank", CompiledVerifyBank(_Runtime(model), max_verify_len=K + 1, capture_backend="gdn"))
    logits, _, compiled, _ = bank.verify(tokens, cache)
    assert compiled, bank.stats
    return logits


def _step(model, cache, toks, mode, bank_holder, counts=None):
    """One more verify-shaped forward of one token per row, committed (the engine's K=0 round)."""
    logits = _verify(model, cache, mx.array(np.asarray(toks, np.int32)[:, None]), mode, bank_holder)
    cache.commit(np.ones(len(toks), np.int64) if counts is None else counts)
    cache.eval()
    return logits[:, -1]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("keep", [1, 2, 3, 4, 5])  # keep = accepted drafts + 1 (the pending token)
def test_partial_accept_then_next_token_matches_fresh_forward(hybrid, mode, keep):
    model = hybrid
    rng = np.random.default_rng(keep)
    prompt = rng.integers(3, 512, 13).tolist()
    pending = int(rng.integers(3, 512))
    drafts = rng.integers(3, 512, K).tolist()
    cache = _prefilled(model, [prompt])
    holder = {}
    logits = _verify(model, cache, mx.array([[pending] + drafts], dtype=mx.int32), mode, holder)
    # each verify position already equals the fresh forward of its prefix
    seq = prompt + [pending] + drafts
    for j in range(K + 1):
        np.testing.assert_allclose(np.array(logits[0, j]), np.array(_fresh_logits(model, seq[: len(prompt) + j + 1])), atol=ATOL)
    cache.commit(np.array([keep]))
    cache.eval()
    assert int(cache.lengths[0]) == len(prompt) + keep
    accepted = seq[: len(prompt) + keep]
    nxt = int(rng.integers(3, 512))
    got = _step(model, cache, [nxt], mode, holder)[0]
    np.testing.assert_allclose(np.array(got), np.array(_fresh_logits(model, accepted + [nxt])), atol=ATOL)
    # and once more: the state stays exact over further steps
    nxt2 = int(rng.integers(3, 512))
    got = _step(model, cache, [nxt2], mode, holder)[0]
    np.testing.assert_allclose(np.array(got), np.array(_fresh_logits(model, accepted + [nxt, nxt2])), atol=ATOL)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_rows_of_a_batch_commit_different_counts(hybrid, mode):
    """Three rows of different prompt lengths keep 1, 3 and 5 of the verify tokens; a fourth
    (an idle slot) keeps 0 and must be exactly as before the verify."""
    model = hybrid
    rng = np.random.default_rng(42)
    lens = [5, 17, 9, 11]
    counts = np.array([1, 3, K + 1, 0])
    prompts = [rng.integers(3, 512, n).tolist() for n in lens]
    verify = rng.integers(3, 512, (4, K + 1)).astype(np.int32)
    cache = _prefilled(model, prompts)
    holder = {}
    logits = _verify(model, cache, mx.array(verify), mode, holder)
    for b in range(3):
        for j in range(K + 1):
            want = _fresh_logits(model, prompts[b] + verify[b, : j + 1].tolist())
            np.testing.assert_allclose(np.array(logits[b, j]), np.array(want), atol=ATOL)
    cache.commit(counts)
    cache.eval()
    assert cache.lengths.tolist() == [n + c for n, c in zip(lens, counts)]
    nxt = rng.integers(3, 512, 4).tolist()
    got = _step(model, cache, nxt, mode, holder)
    for b in range(4):
        accepted = prompts[b] + verify[b, : counts[b]].tolist()
        np.testing.assert_allclose(np.array(got[b]), np.array(_fresh_logits(model, accepted + [nxt[b]])), atol=ATOL)
    # the recurrent layers really are the ones being rolled back
    assert sum(isinstance(c, RowStateCache) for c in cache.layers) == 3


def test_hybrid_draft_model_rolls_back_after_a_partial_accept(tiny_model):
    """A hybrid draft model (DraftModelDrafter) must also drop the rejected drafts from its
    recurrent state: after a partial accept its next proposal equals the proposal of a draft
    that only ever saw the accepted text."""
    from mtplx.drafting.draft_model import DraftModelDrafter
    from mtplx.request import SamplingParams
    from mtplx.sampling import SamplerBatch

    draft = load(tiny_model("qwen3_next", seed=1)).model
    V = draft.model.embed_tokens.weight.shape[0]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, V, n).tolist() for n in (9, 14, 6)]
    pending = rng.integers(3, V, 3).astype(np.int32)
    sampler = SamplerBatch.from_params([SamplingParams(temperature=1.0)] * 3)

    def drafter_for(prompts):
        d = DraftModelDrafter(draft, V)
        d.reset()
        d.extend([d.prefill_row(p, None, 0) for p in prompts])
        return d

    d = drafter_for(prompts)
    u = mx.array(rng.random((3, K)).astype(np.float32))
    drafts, _ = d.propose(K, mx.array(pending), sampler, u)
    drafts = np.array(drafts)
    n_accept = np.array([0, 2, K])
    nxt = rng.integers(3, V, 3).astype(np.int32)
    verify_in = mx.array(np.concatenate([pending[:, None], drafts], axis=1))
    d.commit(n_accept, nxt, drafts, np.ones(3, bool), verify_in, None)
    u2 = mx.array(rng.random((3, 2)).astype(np.float32))
    _, q = d.propose(2, mx.array(nxt), sampler, u2)

    accepted = [p + [int(pending[b])] + drafts[b, : n_accept[b]].tolist() for b, p in enumerate(prompts)]
    fresh = drafter_for(accepted)
    _, q_fresh = fresh.propose(2, mx.array(nxt), sampler, u2)
    np.testing.assert_allclose(np.array(q[:, 0]), np.array(q_fresh[:, 0]), atol=1e-5)


@pytest.mark.parametrize("target", ["qwen3_next", "llama"])
def test_hybrid_draft_model_prefix_sharing_snapshots_at_the_edge(tiny_model, target):
    """Rows sharing a stable prefix start the draft model from the first row's state at the prefix
    edge, not after the first row's whole prompt. The draft is the hybrid qwen3_next itself: its
    drafts are the target's own greedy tokens when its state is right, so every draft of every
    row is accepted (with a state from past the edge, followers' drafts would mostly be rejected).
    The recurrent state cannot be cut back to the edge afterwards: asking for it is an error."""
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.request import Request, SamplingParams

    draft_path = tiny_model("qwen3_next")
    target_path = draft_path if target == "qwen3_next" else tiny_model("llama")
    bundle = load(target_path)
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, 500, 40).tolist()
    rows = [prefix + rng.integers(3, 500, int(n)).tolist() for n in (6, 11, 17, 9, 14)]
    spec = SpeculativeConfig(method="draft", draft_model=str(draft_path), depth=3, adaptive_depth=False)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=2))
    reqs = [Request(i, p, SamplingParams(max_tokens=12), stable_prefix_len=len(prefix)) for i, p in enumerate(rows)]
    results = {r.key: r for r in eng.generate(reqs)}
    assert sum(r.stats.cached_prompt_tokens for r in results.values()) == len(prefix) * (len(rows) - 1)
    if target == "qwen3_next":
        for i, r in results.items():
            assert r.stats.drafted_tokens > 0
            assert r.stats.accepted_tokens == r.stats.drafted_tokens, (i, r.stats)
    else:  # a different target: the followers' draft states equal fresh prefills of their prompts
        d = eng.drafter
        for p in rows[1:]:
            leader = d.prefill_row(rows[0], None, 0, edge=len(prefix))
            follower = d.prefill_row(p, None, 0, prefix=d.snapshot(leader, len(prefix)))
            fresh = d.prefill_row(p, None, 0)
            for a, b in zip(follower[0].layers, fresh[0].layers):
                for x, y in zip(a.state_arrays(), b.state_arrays()):
                    if x is not None:
                        n = min(x.shape[2], y.shape[2]) if isinstance(a, RowKVCache) else None
                        xs, ys = (x[:, :, : len(p)], y[:, :, : len(p)]) if n else (x, y)
                        np.testing.assert_allclose(np.array(xs), np.array(ys), atol=1e-4)
    full = BatchCache.for_model(load(draft_path).model, 1)
    full.layers[0].cache = [mx.zeros((1, 2)), mx.zeros((1, 2))]
    full.commit([5])
    with pytest.raises(ValueError, match="cannot|not 3"):
        full.snapshot_row(0, 3)
