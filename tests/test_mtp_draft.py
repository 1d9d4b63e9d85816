"""Cheap MTP drafting (mtplx/drafting/mtp_bank.py, vocab.py): compiled draft programs and a reduced drafting vocabulary.

- Compiled drafting gives the drafts (and draft distributions q) the eager head gives, round by
  round, over growing caches, changing batch widths, greedy and sampled rows; and the bank really
  ran compiled programs.
- A reduced drafting vocabulary keeps greedy output identical to plain decoding (every draft
  inside the set), and keeps sampled output on the target distribution: test_engine_sampling's
  checks (the first tokens' joint, each position, the bonus tokens) on a 16-token model whose head
  drafts among 6 tokens only; a q wrong about the set (mass outside it, or left in the set's index
  space) fails them on the same rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.drafting.mtp import MtpDrafter
from mtplx.drafting.mtp import load as load_mtp
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.drafting.mtp_bank import DraftVocab, frequent_tokens, save_draft_vocab
from mtplx.request import Request, SamplingParams
from mtplx.training.train_head import TrainConfig, _init_head, save_sidecar
from test_engine_sampling import DEPTH, P_REJECT, exactness_tests, failed, least, sample_rows
from tiny_models import reference_tokens


def _chain_inputs(tiny_model, rows: int):
    """The tiny llama and a random head over it with a drafting vocabulary (every third id) and its step table,
    its cache holding 5 tokens for each of `rows` rows, and a hidden state with its first logits: what
    draft_chain takes."""
    from mtplx.cache import BatchCache

    bundle = load(tiny_model("llama"))
    head = _init_head(bundle.model, TrainConfig(seed=3))
    vocab = DraftVocab(head, list(range(3, 512, 3)), 512)
    vocab.step_table(head)
    cache = BatchCache(list(head.cache_kinds), [0] * rows)
    D = head.fc.weight.shape[0]
    head.hidden(mx.random.normal((rows, 5, D)), mx.array([[5, 6, 7, 8, 9]] * rows, dtype=mx.int32), cache.layers)
    cache.commit([5] * rows)
    arrays = [a for c in cache.layers for a in c.state_arrays()]
    h = mx.random.normal((rows, D))
    return bundle, head, vocab, cache, arrays, h, vocab.logits(h)


def _sidecar(bundle, out, vocab_ids=None, seed=0):
    """A random (untrained) sidecar head for `bundle`, with an optional drafting vocabulary."""
    head = _init_head(bundle.model, TrainConfig(seed=seed))
    save_sidecar(bundle, head, out, {})
    if vocab_ids is not None:
        save_draft_vocab(out, np.asarray(vocab_ids))
    return str(out)


class _Checked(MtpDrafter):
    """Runs every proposal and commit both compiled and eagerly, and records the differences
    (a commit that also drafts the next round, `following`, is checked against an eager commit
    followed by an eager proposal)."""

    def __init__(self, other: MtpDrafter):
        super().__init__(other.head, other.chunk, other.vocab, compiled=True, lookup=other.lookup)
        self.checks = {"propose": 0, "commit": 0, "commit+propose": 0, "drafted ahead": 0}
        self.draft_diffs, self.q_diff, self.commit_diff = 0, 0.0, 0.0

    def _compare(self, drafts, q, ref_d, ref_q):
        self.draft_diffs += int((np.array(drafts) != np.array(ref_d)).sum())
        assert (q is None) == (ref_q is None)
        if q is not None:
            self.q_diff = max(self.q_diff, float(mx.abs(q - ref_q).max()))

    def propose(self, K, pending, sampler, u):
        ahead = self.ready is not None and self.ready[0] == K and self.ready[2] is u
        before = self.bank.stats["compiled_calls"]
        drafts, q = super().propose(K, pending, sampler, u)
        if ahead:  # drafted (and checked) in the commit before
            self.checks["drafted ahead"] += 1
            assert self.bank.stats["compiled_calls"] == before
            return drafts, q
        assert self.bank.stats["compiled_calls"] == before + 1
        bank, self.bank = self.bank, None
        ref_d, ref_q = super().propose(K, pending, sampler, u)
        self.bank = bank
        self._compare(drafts, q, ref_d, ref_q)
        self.checks["propose"] += 1
        return drafts, q

    def advance(self, n, nxt, counts, most, verify_in, hidden, following=None):
        saved = [(c.keys, c.values) for c in self.cache.layers], self.cache.rows.mark(), self.history
        before = self.bank.stats["compiled_calls"]
        super().advance(n, nxt, counts, most, verify_in, hidden, following)
        assert self.bank.stats["compiled_calls"] == before + 1  # one program, drafting or not
        got, ready, history = [np.array(a) for a in self.extra], self.ready, self.history
        for c, (k, v) in zip(self.cache.layers, saved[0]):
            c.keys, c.values = k, v
        self.cache.rows.restore(saved[1])
        self.history = saved[2]
        bank, self.bank = self.bank, None
        super().advance(n, nxt, counts, most, verify_in, hidden, following)
        self.bank = bank
        for a, b in zip(got, self.extra):
            self.commit_diff = max(self.commit_diff, float(np.abs(a - np.array(b)).max()))
        if history is not None:
            h, ref = np.array(history), np.array(self.history)
            self.draft_diffs += int((h[:, : ref.shape[1]] != ref).sum())  # columns past the eager one's: padding
        if following is not None:
            self._compare(ready[3], ready[4], self.ready[3], self.ready[4])
            self.ready = ready
            self.checks["commit+propose"] += 1
        self.checks["commit"] += 1


def _run(bundle, spec, prompts, params, max_batch=3, check=False):
    drafter = _Checked(load_mtp(spec, bundle)) if check else None
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=max_batch, order="input"), drafter=drafter)
    reqs = [Request(key=i, prompt_tokens=p, params=params[i % len(params)], seed=i) for i, p in enumerate(prompts)]
    out = {r.key: r for r in eng.generate(reqs)}
    return [out[i] for i in range(len(reqs))], eng


@pytest.mark.parametrize("family,lookup", [("llama", 0), ("qwen3_next", 0), ("llama", 2), ("llama-vocab", 0)])
def test_compiled_drafts_equal_eager_drafts(tiny_model, tmp_path, family, lookup):
    """(With `lookup`, the prompt-lookup fallback on the device: drafts, q and the rows' histories;
    `-vocab`: with a drafting vocabulary, whose draft steps read their embedding's part of fc off
    DraftVocab.step_table.)"""
    vocab = family.endswith("-vocab")
    family = family.split("-")[0]
    bundle = load(tiny_model(family))
    head = (_sidecar(bundle, tmp_path / "head", vocab_ids=list(range(0, 512, 2)) if vocab else None)
            if family == "llama" else None)  # qwen3_next ships mtp.*
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 200, int(n)).tolist() for n in (5, 40, 17, 9, 250, 3)]
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=24, temperature=0.9, top_k=20)]
    if lookup:
        prompts = [(p[: len(p) // 3 + 1] * 3)[: len(p)] for p in prompts]  # repeats: lookup rows happen
    spec = SpeculativeConfig(method="mtp", mtp_head=head, depth=3, adaptive_depth=False, mtp_lookup=lookup)
    results, eng = _run(bundle, spec, prompts, params, check=True)
    if lookup:
        counts = eng.drafter.lookup.counts
        assert counts["lookup"] >= 3 and counts["head"] >= 10, counts
    d = eng.drafter
    if vocab:
        assert d.vocab is not None and d.vocab.step_table(d.head) is not None
    print(f"\n{family}: {d.checks} checked, programs {len(d.bank.programs.built)}, max |q diff| {d.q_diff:.2g}, "
          f"max commit diff {d.commit_diff:.2g}")
    assert d.checks["propose"] >= 3 and d.checks["commit"] >= 10
    assert d.checks["commit+propose"] >= 10 and d.checks["drafted ahead"] >= 10
    assert d.draft_diffs == 0
    assert d.q_diff < 1e-5 and d.commit_diff < 1e-4
    assert len(d.bank.programs.built) >= 2 and d.bank.stats["eager_calls"] == 0
    greedy = [r for i, r in enumerate(results) if i % 2 == 0]
    for i, r in zip(range(0, len(prompts), 2), greedy):
        assert r.tokens == reference_tokens(bundle.model, prompts[i], 30, eng.eos)


def test_draft_vocab_keeps_greedy_output_identical(tiny_model, tmp_path):
    bundle = load(tiny_model("llama"))
    V = bundle.model.model.embed_tokens.weight.shape[0]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, 200, int(n)).tolist() for n in (6, 30, 12, 50)]
    plain = [reference_tokens(bundle.model, p, 32, set()) for p in prompts]
    # the set: the most frequent tokens of the greedy continuations (what training would pick)
    ids = frequent_tokens(plain, [0] * len(plain), 48, V)
    head = _sidecar(bundle, tmp_path / "head", ids)
    seen = []
    for compiled in ("on", "off"):
        spec = SpeculativeConfig(method="mtp", mtp_head=head, depth=3, adaptive_depth=False, compiled_verify=compiled)
        results, eng = _run(bundle, spec, prompts, [SamplingParams(max_tokens=32)])
        assert isinstance(eng.drafter.vocab, DraftVocab) and eng.drafter.vocab.size == len(ids)
        for r, ref in zip(results, plain):
            assert r.tokens == ref[: len(r.tokens)] and len(r.tokens) == min(32, len(ref))
        seen.append(sum(r.stats.accepted_tokens for r in results))
    print(f"\naccepted drafts with a {len(ids)}-token drafting vocabulary: compiled {seen[0]}, eager {seen[1]}")
    assert seen[0] == seen[1]  # the same drafts either way


def test_draft_vocab_projection_matches_the_full_head(tiny_model, tmp_path):
    bundle = load(tiny_model("qwen3"))  # tied embeddings
    head = _init_head(bundle.model, TrainConfig(seed=3))
    ids = [0, 7, 9, 100, 511]
    vocab = DraftVocab(head, ids, 512)
    h = mx.random.normal((4, head.fc.weight.shape[0]))
    full = head.logits(h)
    assert mx.allclose(vocab.logits(h), full[:, mx.array(ids)], atol=1e-4).item()
    q = mx.softmax(vocab.logits(h), axis=-1)
    qf = vocab.expand(q)
    assert qf.shape == (4, 512) and mx.allclose(qf.sum(-1), mx.ones(4)).item()
    assert float(mx.abs(qf[:, mx.array([1, 2, 510])]).max()) == 0.0


# the sampled tests' drafting vocabulary: the 16-token model's six most frequent sampled tokens (what
# training picks, frequent_tokens), so that rounds often keep all their drafts
DRAFTING = [0, 1, 4, 6, 8, 12]
_EXPAND = DraftVocab.expand


def _expand_spread_outside(vocab, q):
    """q with half its mass spread over the whole vocabulary, tokens the head never drafts included."""
    return 0.5 * _EXPAND(vocab, q) + 0.5 / vocab.vocab_size


def _expand_by_index(vocab, q):
    """q left in the drafting vocabulary's index space: the i-th drafting token's probability read as token i's."""
    return mx.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, vocab.vocab_size - q.shape[-1])])


WRONG_EXPANSIONS = {"q spread outside the vocabulary": _expand_spread_outside,
                    "q by drafting index": _expand_by_index}


@pytest.mark.parametrize("compiled", ["on", "off"])
@pytest.mark.parametrize("control", [None] + list(WRONG_EXPANSIONS))
def test_sampled_output_with_a_draft_vocab_follows_the_target(tiny_model, tmp_path, monkeypatch, compiled, control):
    """The head drafts among 6 of 16 tokens (q zero outside them): the output passes every check of
    test_engine_sampling (the first tokens' joint, each position, the bonus tokens and the tokens after
    them), and a q that is wrong about the vocabulary (eager and compiled drafting alike map it to the
    whole vocabulary with DraftVocab.expand) fails them on the same rows."""
    bundle = load(tiny_model("small_vocab"))
    head = _sidecar(bundle, tmp_path / "head", DRAFTING, seed=1)
    if control is not None:
        monkeypatch.setattr(DraftVocab, "expand", WRONG_EXPANSIONS[control])
    spec = SpeculativeConfig(method="mtp", mtp_head=head, depth=DEPTH, adaptive_depth=False, compiled_verify=compiled)
    samples = sample_rows(bundle, spec, 5 * 10**6)
    stats = samples.stats
    assert 0.05 < stats["accepted"] / stats["drafted"] < 0.9 and stats["bonus"] >= 100, stats
    assert compiled == "off" or (stats["folded_programs"] > 0 and stats["compiled_proposals"] > 0)
    tokens = np.concatenate(list(samples.tokens.values()))
    assert np.isin(tokens, DRAFTING, invert=True).any()  # tokens outside the set still come out (residual, bonus)
    tests = exactness_tests(bundle.model, samples)
    worst = least(tests, f"{control or 'the drafting vocabulary'} (compiled {compiled})")
    if control is None:
        assert not failed(tests), failed(tests)
    else:
        assert worst[3] < P_REJECT, f"{control} went unnoticed: least p {worst[3]:.2g} ({worst[0]})"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_draft_vocab_reads_plain_rows_bit_for_bit(tiny_model, monkeypatch, kind):
    """Where the head's projection is a plain weight (the tied embedding, an lm_head) the drafting
    vocabulary reads its rows instead of projecting basis vectors, with the same bits."""
    from mtplx.drafting import mtp_bank

    bundle = load(tiny_model(kind))
    head = _init_head(bundle.model, TrainConfig(seed=3))
    ids = [0, 7, 9, 100, 511]
    assert mtp_bank.plain_rows(head, mx.array(ids)) is not None
    direct = DraftVocab(head, ids, 512)
    monkeypatch.setattr(mtp_bank, "plain_rows", lambda head, ids: None)
    basis = DraftVocab(head, ids, 512)
    assert mx.array_equal(direct.weight_t, basis.weight_t).item()
    h = mx.random.normal((4, head.fc.weight.shape[0])).astype(head.norm.weight.dtype)
    assert mx.array_equal(direct.logits(h), basis.logits(h)).item()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_quantized_heads_draft_vocab_dequantizes_its_rows_with_the_basis_projections_bits(tiny_model, monkeypatch, kind):
    """A quantized trunk (the GGUF trunk on a GPU): the drafting vocabulary dequantizes the quantized
    projection's rows for its ids (not quantized matmuls of basis vectors), and gets the bits the basis
    projections give (on this CPU)."""
    import mlx.nn as nn

    from mtplx.drafting import mtp_bank

    bundle = load(tiny_model(kind))
    nn.quantize(bundle.model, group_size=32, bits=4)
    head = _init_head(bundle.model, TrainConfig(seed=3))
    ids = [0, 7, 9, 100, 511]
    assert mtp_bank.plain_rows(head, mx.array(ids)) is not None
    direct = DraftVocab(head, ids, 512)
    monkeypatch.setattr(mtp_bank, "plain_rows", lambda head, ids: None)  # the basis projections
    basis = DraftVocab(head, ids, 512)
    assert mx.array_equal(direct.weight_t, basis.weight_t).item()
    assert not direct.has_bias and not basis.has_bias
    h = mx.random.normal((4, head.fc.weight.shape[0])).astype(head.norm.weight.dtype)
    assert mx.array_equal(direct.logits(h), basis.logits(h)).item()


def test_a_quantized_heads_draft_projection_has_no_bias_add(tiny_model, tmp_path, monkeypatch):
    """A quantized tied head's projection read off by projecting basis vectors (where its rows are not
    read directly): the projection of zeros (the bias) is exactly zero, so each draft step's logits are
    one product, no add kernel, with the values the product plus that zero bias give."""
    import mlx.nn as nn

    from graphkit import graph_primitives
    from mtplx.drafting import mtp_bank

    monkeypatch.setattr(mtp_bank, "plain_rows", lambda head, ids: None)

    bundle = load(tiny_model("qwen3"))
    nn.quantize(bundle.model, group_size=32, bits=4)
    head = _init_head(bundle.model, TrainConfig(seed=3))
    vocab = DraftVocab(head, [0, 7, 9, 100, 511], 512)
    assert not vocab.has_bias and float(mx.abs(vocab.bias).max()) == 0.0
    h = mx.random.normal((3, head.fc.weight.shape[0])).astype(head.norm.weight.dtype)
    mx.eval(h)
    out = vocab.logits(h)
    assert "Add" not in graph_primitives([out])
    assert mx.array_equal(out, h @ vocab.weight_t + vocab.bias).item()


def test_a_draft_step_off_the_vocabularys_table_is_the_heads_own_step(tiny_model, tmp_path):
    """The table row (the token's normed embedding through its half of fc) plus the hidden state's half
    is the head's step over the token: the same hidden state (float32, to rounding), and the step's
    graph has no embedding, norm of it or concatenation left."""
    from graphkit import graph_primitives
    from mtplx.cache import BatchCache
    from mtplx.drafting.mtp_bank import draft_step

    bundle = load(tiny_model("llama"))
    head = _init_head(bundle.model, TrainConfig(seed=3))
    ids = list(range(3, 512, 3))
    vocab = DraftVocab(head, ids, 512)
    table = vocab.step_table(head)
    assert table is not None and table[0].shape == (len(ids), head.fc.weight.shape[0])
    idx = mx.array([0, 5, 40, len(ids) - 1], dtype=mx.int32)
    tok = vocab.ids[idx]
    h = mx.random.normal((4, head.fc.weight.shape[0]))
    mx.eval(h, tok)

    def step(use_table):
        cache = BatchCache(list(head.cache_kinds), [0, 0, 0, 0])
        ctx = mx.random.normal((4, 6, h.shape[1]))
        head.hidden(ctx, mx.array(np.arange(24).reshape(4, 6) % 500, dtype=mx.int32), cache.layers)  # some context
        cache.commit([6, 6, 6, 6])
        mx.eval([a for c in cache.layers for a in c.state_arrays()])
        return draft_step(head, vocab if use_table else None, h, idx, cache.layers, 1) if use_table else \
            draft_step(head, None, h, tok, cache.layers, 1)

    mx.random.seed(0)
    got = step(True)
    prims = graph_primitives([got])
    mx.random.seed(0)
    ref = step(False)
    ref_prims = graph_primitives([ref])
    assert mx.allclose(got, ref, atol=1e-5, rtol=1e-5).item(), float(mx.abs(got - ref).max())
    # the table's row: no concatenation of the embedding with the hidden state, one norm fewer
    assert prims["Concatenate"] == ref_prims["Concatenate"] - 1, (prims, ref_prims)
    assert sum(prims.values()) < sum(ref_prims.values())


def test_a_rounds_drafts_map_to_token_ids_and_the_whole_vocabulary_once(tiny_model):
    """The draft chain picks in the drafting vocabulary's index space; the round's K picks become
    token ids with one gather and (sampled) their q over the whole vocabulary with one scatter,
    not one of each per step."""
    from graphkit import graph_primitives
    from mtplx.drafting.mtp_bank import draft_chain
    from mtplx.sampling import SamplerBatch

    bundle, head, vocab, cache, arrays, h, first = _chain_inputs(tiny_model, rows=2)
    sampler = SamplerBatch.from_params([SamplingParams(temperature=0.8), SamplingParams(temperature=1.0)])
    u = mx.random.uniform(shape=(2, 3))
    mx.eval(arrays, h, first, u)
    drafts, q = draft_chain(head, vocab, list(cache.kinds), first, h, sampler, u, cache.rows.device, arrays, 3)
    prims = graph_primitives([drafts, q])
    assert drafts.shape == (2, 3) and q.shape == (2, 3, 512)
    assert prims["Scatter"] == 1, prims
    assert set(np.array(drafts).ravel().tolist()) <= set(range(3, 512, 3))


def test_greedy_picks_are_not_cast_before_their_gathers(tiny_model, monkeypatch):
    """A greedy draft chain's picks stay argmax's index into the step table and the drafting vocabulary:
    no cast a draft step (a kernel of its own each on CUDA): a chain of 1 draft has no cast at all, and
    the drafts are int32 token ids."""
    from graphkit import graph_primitives
    from mtplx.drafting import mtp_bank
    from mtplx.sampling import SamplerBatch

    bundle, head, vocab, cache, arrays, h, first = _chain_inputs(tiny_model, rows=2)
    sampler = SamplerBatch.from_params([SamplingParams(), SamplingParams()])
    u = mx.zeros((2, 3))
    mx.eval(arrays, h, first)
    got = {}
    for K in (1, 3):
        drafts, q = mtp_bank.draft_chain(head, vocab, list(cache.kinds), first, h, sampler, u, cache.rows.device, arrays, K)
        got[K] = (graph_primitives([drafts]).get("AsType", 0), drafts.dtype)
    assert got[1][0] == 0, got
    assert got[1][1] == got[3][1] == mx.int32


def test_draft_steps_take_their_lengths_from_one_padded_copy(tiny_model, monkeypatch, tmp_path):
    """Where one row's lengths are padded out of MLX's small-array pool (CUDA, kernels.device.padded), the
    draft chain pads them once, not once a step: the same drafts as unpadded lengths, with at most one
    kernel more for a chain of 4 (three steps); the compiled draft programs build over it (no eager
    fallback) and greedy text stays plain's."""
    from graphkit import VIEWS, graph_primitives
    from mtplx.kernels import device
    from mtplx.drafting import mtp_bank
    from mtplx.sampling import SamplerBatch

    bundle, head, vocab, cache, arrays, h, first = _chain_inputs(tiny_model, rows=1)
    mx.eval(arrays, h, first)
    got = {}
    for pads in (False, True):
        monkeypatch.setattr(device, "pads", lambda p=pads: p)
        drafts, _ = mtp_bank.draft_chain(head, vocab, list(cache.kinds), first, h, SamplerBatch.from_params([SamplingParams()]),
                                          mx.zeros((1, 4)), cache.rows.device, arrays, 4)
        kernels = sum(n for name, n in graph_primitives([drafts]).items() if name not in VIEWS)
        got[pads] = (kernels, np.array(drafts).tolist())
    assert got[True][1] == got[False][1]
    assert got[True][0] <= got[False][0] + 1, got  # one pad, not one a step

    prompt = [5, 17, 230, 41, 9, 77]
    ref = reference_tokens(bundle.model, prompt, 12, set())
    spec = SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, mtp_head=_sidecar(bundle, tmp_path))
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=1))
    out = list(eng.generate([Request(key=0, prompt_tokens=prompt, params=SamplingParams(max_tokens=12))]))
    assert out[0].tokens == ref
    assert eng.drafter.bank.stats["compiled_calls"] > 0 and eng.drafter.bank.stats["eager_calls"] == 0, eng.drafter.bank.stats
