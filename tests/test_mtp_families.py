"""Native MTP heads of the families people run, from tiny checkpoints in each one's real HF layout.

For qwen3_5, qwen3_5_moe, mimo, glm4_moe and deepseek_v32 (tests/mtp_fixtures.py), `method: mtp` greedy output
is token-identical to plain decoding (mlx-lm's own `generate_step`) at widths 1 and 7 (8 rows, two
sharing a prefix) and depths 1-4, with the native head drafting; the head's weights mean what the checkpoint means (zero-
centred norms shifted, MiMo's [hidden, embedding] order, the lm_head under `language_model`);
heads of several MTP layers draft depth i with layer i (and recurse on the last); sharded
checkpoints and heads in a file of their own load the same head; and a checkpoint
without MTP weights is refused with the ways forward.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtplx.cache import BatchCache
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.drafting.mtp import MtpDrafter
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.models.mtp import MTPHeadStack, load_head, project_logits, trunk_hidden
from mtplx.request import Request, SamplingParams
from mtplx.sampling import SamplerBatch

from mtp_fixtures import make_mtp_model
from tiny_models import reference_tokens

FAMILIES = ["qwen3_5", "qwen3_5_moe", "mimo", "glm4_moe", "deepseek_v32"]
PROMPTS = [
    ("def fibonacci(n):\n    if n < 2:", 7),
    ("import os", 6),
    ("the quick brown fox jumps over the lazy dog. the quick", 8),
    ("class Stack:\n    def push(self, x):\n", 5),
    ("Question: What is the capital of France?\nAnswer:", 7),
    ("You are a helpful assistant.", 6),
    ("json", 8),
    ("def fibonacci(n):\n    if n < 2:\n        return n", 6),  # shares row 0's prefix (prefilled once)
]


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp_families")


@pytest.fixture(scope="module")
def family_model(fixture_dir):
    built = {}

    def get(family, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in built:
            tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            path = make_mtp_model(fixture_dir / f"{family}-{tag}", family, **kw)
            bundle = load(path)
            tok = bundle.tokenizer
            eos = set(tok.eos_token_ids)
            prompts = [tok.encode(p) for p, _ in PROMPTS]
            refs = [reference_tokens(bundle.model, p, m, eos) for p, (_, m) in zip(prompts, PROMPTS)]
            built[key] = (path, bundle, prompts, refs)
        return built[key]

    return get


def _shared_prefix(prompts, i):
    """Tokens row i shares with another row (the pipeline's `stable_prefix_len`), 0 if none."""
    best = 0
    for j, q in enumerate(prompts):
        if j != i:
            n = next((k for k, (a, b) in enumerate(zip(prompts[i], q)) if a != b), min(len(q), len(prompts[i])))
            best = max(best, min(n, len(q) - 1, len(prompts[i]) - 1))  # both rows keep a token to prefill
    return best


def run(bundle, prompts, method, depth, width, compiled="off"):
    spec = SpeculativeConfig(method=method, depth=depth, adaptive_depth=False, compiled_verify=compiled)
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width))
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=m),
                    stable_prefix_len=_shared_prefix(prompts, i))
            for i, (p, (_, m)) in enumerate(zip(prompts, PROMPTS))]
    out = {r.key: r for r in eng.generate(reqs)}
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_greedy_identity(family_model, family, depth, monkeypatch):
    import mtplx.prefill

    _, bundle, prompts, refs = family_model(family)
    assert _shared_prefix(prompts, len(prompts) - 1) >= mtplx.prefill.MIN_PREFIX_TOKENS
    hits = []
    real_get = mtplx.prefill.PrefixStore.get
    monkeypatch.setattr(mtplx.prefill.PrefixStore, "get", lambda self, key: hits.append(real_get(self, key)) or hits[-1])
    for width in (1, 7):
        compiled = "on" if (depth + width) % 2 else "off"
        results = run(bundle, prompts, "mtp", depth, width, compiled)
        for i, (res, ref) in enumerate(zip(results, refs)):
            assert res.error is None, res.error
            assert res.tokens == ref, f"{family} depth {depth} width {width}: row {i}\n ref {ref}\n got {res.tokens}"
        assert sum(r.stats.drafted_tokens for r in results) > 0
    assert any(h is not None for h in hits)  # the shared prefix was prefilled once and copied


@pytest.mark.parametrize("family", ["qwen3_5", "mimo"])
def test_tied_embeddings(family_model, family):
    _, bundle, prompts, refs = family_model(family, tie=True)
    results = run(bundle, prompts, "mtp", 3, 7, "on")
    assert [r.tokens for r in results] == refs
    assert sum(r.stats.drafted_tokens for r in results) > 0


def _raw(path, key):
    from mtplx.models.loading import tensor_index

    name, _ = tensor_index(path)[key]
    return mx.load(str(path / name))[key]


def test_qwen3_5_head_means_what_the_checkpoint_means(family_model):
    """Zero-centred norms come back as 1 + w (head and block), the untied lm_head under
    `language_model` is the one the head projects with, and its block is a full-attention layer."""
    path, bundle, _, _ = family_model("qwen3_5")
    head = load_head(bundle)
    for ours, theirs in [("norm_embedding", "mtp.pre_fc_norm_embedding"), ("norm_hidden", "mtp.pre_fc_norm_hidden"),
                         ("norm", "mtp.norm"), ("layers.0.input_layernorm", "mtp.layers.0.input_layernorm"),
                         ("layers.0.self_attn.q_norm", "mtp.layers.0.self_attn.q_norm")]:
        got = dict(tree_flatten(head.parameters()))[f"{ours}.weight"]
        np.testing.assert_allclose(np.array(got), np.array(_raw(path, f"{theirs}.weight")) + 1.0, atol=1e-6)
    assert not getattr(head.layers[0], "is_linear", True)
    h = mx.random.normal((1, 2, 64))
    want = h @ _raw(path, "lm_head.weight").T
    np.testing.assert_allclose(np.array(project_logits(bundle.model, h)), np.array(want), atol=1e-4)
    np.testing.assert_allclose(np.array(head.logits(h)), np.array(want), atol=1e-4)


def test_mimo_head_reads_hidden_then_embedding(family_model):
    path, bundle, _, _ = family_model("mimo")
    head = load_head(bundle)
    assert head.hidden_first
    np.testing.assert_array_equal(np.array(head.fc.weight), np.array(_raw(path, "model.mtp_layers.0.input_proj.weight")))
    np.testing.assert_array_equal(np.array(head.norm_embedding.weight),
                                  np.array(_raw(path, "model.mtp_layers.0.token_layernorm.weight")))
    # fc over [hidden, embedding]: the hidden half of the weight multiplies the hidden state
    tok = mx.array([[5]])
    h0 = mx.zeros((1, 1, 64))
    h1 = mx.random.normal((1, 1, 64))
    out0, _ = head(h0, tok)
    out1, _ = head(h1, tok)
    assert not np.allclose(np.array(out0), np.array(out1))


@pytest.mark.parametrize("layout", [{"shards": 3}, {"head_file": "mtp.safetensors"}, {"shards": 2, "head_file": "model-mtp.safetensors"}])
def test_sharded_checkpoints_and_heads_in_their_own_file(family_model, fixture_dir, layout):
    import mlx_lm

    path, bundle, prompts, refs = family_model("qwen3_5")
    other = make_mtp_model(fixture_dir / ("split-" + "-".join(f"{k}{v}" for k, v in sorted(layout.items()))), "qwen3_5", **layout)
    assert (other / "model.safetensors.index.json").exists()
    mlx_lm.load(str(other))  # plain mlx-lm still loads it
    split = load(other)
    assert sorted(split.mtp_weights) == sorted(bundle.mtp_weights)
    a = dict(tree_flatten(load_head(bundle).parameters()))
    b = dict(tree_flatten(load_head(split).parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    results = run(split, prompts, "mtp", 2, 7, "on")
    assert [r.tokens for r in results] == refs


@pytest.mark.parametrize("family", ["qwen3_5", "mimo", "glm4_moe"])
def test_no_mtp_weights_names_the_ways_forward(fixture_dir, family):
    path = make_mtp_model(fixture_dir / f"{family}-trunk-only", family, with_mtp=False)
    bundle = load(path)
    assert not bundle.mtp_weights
    with pytest.raises(ValueError, match="train-head") as err:
        load_head(bundle)
    assert "ngram" in str(err.value)


@pytest.mark.parametrize("depth", [2, 4])
@pytest.mark.parametrize("family", ["qwen3_5", "mimo", "glm4_moe", "deepseek_v32"])
def test_multi_layer_heads_greedy_identity(family_model, family, depth):
    _, bundle, prompts, refs = family_model(family, mtp_layers=3)
    assert isinstance(load_head(bundle), MTPHeadStack)
    for width in (1, 7):
        results = run(bundle, prompts, "mtp", depth, width, "on" if width == 7 else "off")
        assert [r.tokens for r in results] == refs, (family, depth, width)
        assert sum(r.stats.drafted_tokens for r in results) > 0


def _drafts(head, bundle, rows, K, compiled):
    d = MtpDrafter(head, compiled=compiled)
    d.reset()
    firsts, states = [], []
    for p in rows:
        H = trunk_hidden(bundle.model, mx.array([p]), None)
        firsts.append(int(mx.argmax(project_logits(bundle.model, H[:, -1]), axis=-1).item()))
        states.append(d.prefill_row(p, H, firsts[-1]))
    d.extend(states)
    sampler = SamplerBatch.from_params([SamplingParams()] * len(rows))
    drafts, _ = d.propose(K, mx.array(firsts), sampler, mx.zeros((len(rows), K)))
    return np.array(drafts), firsts


def _reference_drafts(stack, bundle, p, first, K):
    """Module k alone, on a cache of its own: depth j is drafted by module min(j, n - 1)."""
    H = trunk_hidden(bundle.model, mx.array([p]), None)
    nxt = mx.array([p[1:] + [first]])
    caches, outs = [], []
    for m in stack.depths:
        c = BatchCache(m.cache_kinds, [0])
        outs.append(m.hidden(H, nxt, c.layers))
        c.commit([len(p)])
        caches.append(c)
    h = outs[0][:, -1:]
    tok = int(mx.argmax(stack.depths[0].logits(h)[0, -1]).item())
    drafts = [tok]
    for j in range(1, K):
        k = min(j, len(stack.depths) - 1)
        h = stack.depths[k].hidden(h, mx.array([[tok]]), caches[k].layers)
        caches[k].commit([1])
        tok = int(mx.argmax(stack.depths[k].logits(h)[0, -1]).item())
        drafts.append(tok)
    return drafts


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("family", ["qwen3_5", "mimo", "glm4_moe", "deepseek_v32"])
def test_each_mtp_layer_drafts_its_own_depth(family_model, family, compiled):
    """A 3-layer head drafts depth 0 with layer 0, depth 1 with layer 1, depths 2.. with layer 2,
    each attending to its own entries: exactly what each layer gives on a cache of its own."""
    _, bundle, prompts, _ = family_model(family, mtp_layers=3)
    stack = load_head(bundle)
    rows, K = prompts[:4], 5
    got, firsts = _drafts(stack, bundle, rows, K, compiled)
    want = np.array([_reference_drafts(stack, bundle, p, f, K) for p, f in zip(rows, firsts)])
    np.testing.assert_array_equal(got, want)
    alone, _ = _drafts(stack.depths[0], bundle, rows, K, compiled)  # layer 0 recursing: other drafts
    assert (alone[:, 1:] != got[:, 1:]).any()


@pytest.fixture(scope="module")
def small_vocab_qwen3_5(fixture_dir):
    """A 16-token qwen3_5 (hybrid) with a 2-layer native head, for exact distribution tests."""
    from test_engine_sampling import SETTINGS, V, exact_joint

    bundle = load(make_mtp_model(fixture_dir / "q35-v16", "qwen3_5", vocab_size=V, small_vocab=True, mtp_layers=2))
    assert isinstance(load_head(bundle), MTPHeadStack) and not bundle.tokenizer.eos_token_ids
    return bundle, {name: exact_joint(bundle.model, params) for name, params in SETTINGS.items()}


def test_sampled_native_mtp_follows_the_target_distribution(small_vocab_qwen3_5, compiled="on"):
    """Sampled rows through the native (2-layer) head of a hybrid model: the first three tokens
    (the second and third from the first speculative round: layer 0's and layer 1's drafts,
    residual resamples, bonus tokens) follow the exact target distribution (chi-square)."""
    from test_engine_sampling import P_OK, PROMPT, SETTINGS, distribution_tests

    bundle, exact = small_vocab_qwen3_5
    rows = 600
    eng = Engine(bundle, SpeculativeConfig(method="mtp", depth=2, adaptive_depth=False, compiled_verify=compiled),
                 ScheduleConfig(max_batch=128))
    reqs = [Request(key=(name, i), prompt_tokens=list(PROMPT), params=replace(params, max_tokens=4),
                    seed=7 * 10**6 + 10**5 * (compiled == "on") + n)
            for n, (name, params, i) in enumerate((nm, p, i) for nm, p in SETTINGS.items() for i in range(rows))]
    samples = {name: [] for name in SETTINGS}
    drafted = accepted = 0
    for r in eng.generate(reqs):
        assert r.error is None and len(r.tokens) == 4, (r.key, r.error)
        samples[r.key[0]].append(r.tokens[:3])
        drafted += r.stats.drafted_tokens
        accepted += r.stats.accepted_tokens
    assert drafted >= 2 * len(reqs) and 0.05 < accepted / drafted < 0.9, (drafted, accepted)
    failures = [f"{name} {test}: chi2 {stat:.1f} on {dof} dof, p={p:.2g}"
                for name in SETTINGS for test, stat, dof, p in distribution_tests(samples[name], exact[name]) if p < P_OK]
    assert not failures, failures


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_job_asking_mtp_of_a_model_without_head_is_refused_before_weights_load(fixture_dir, tmp_path, monkeypatch,
                                                                                   command):
    from click.testing import CliRunner

    import mtplx.models.loading
    from jobkit import job_dict, sample_rows, write_job, write_parquet
    from pipelines.cli.commands import main

    trunk = make_mtp_model(fixture_dir / "qwen3_5-trunk-only", "qwen3_5", with_mtp=False)
    data = write_parquet(tmp_path / "in.parquet", sample_rows(3))

    def no_weights(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(mtplx.models.loading, "load", no_weights)
    job = write_job(tmp_path / "job.yaml", job_dict(trunk, data, tmp_path / "run", speculative={"method": "mtp"}))
    res = CliRunner().invoke(main, [command, str(job)])
    assert res.exit_code == 2, res.output
    assert "speculative.method: mtp" in res.output and "train-head" in res.output and "ngram" in res.output
    # the same model with a head passes the check
    with_head = write_job(tmp_path / "ok.yaml", job_dict(make_mtp_model(tmp_path / "h", "qwen3_5"), data,
                                                         tmp_path / "run2", speculative={"method": "mtp"}))
    res = CliRunner().invoke(main, ["validate", str(with_head)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("family,zeroed", [("mimo", True), ("glm4_moe", True), ("deepseek_v32", True), ("qwen3_5", False)])
def test_position_zero_embedding(family_model, family, zeroed):
    """NextN and MiMo heads were trained with the embedding at position 0 zeroed (the loaders of
    vLLM / SGLang do so); Qwen's were not. Position 0's output then ignores its token."""
    _, bundle, _, _ = family_model(family)
    head = load_head(bundle)
    h = mx.random.normal((1, 2, 64), key=mx.random.key(0))
    a, _ = head(h[:, :1], mx.array([[5]]))
    b, _ = head(h[:, :1], mx.array([[77]]))
    assert np.allclose(np.array(a), np.array(b), atol=1e-5) == zeroed
    c = BatchCache(head.cache_kinds, [1])  # position 1 sees its token
    d = BatchCache(head.cache_kinds, [1])
    a, _ = head(h[:, 1:], mx.array([[5]]), c.layers)
    b, _ = head(h[:, 1:], mx.array([[77]]), d.layers)
    assert not np.allclose(np.array(a), np.array(b), atol=1e-5)


def test_qwen3_5_moe_head_with_experts_stored_one_by_one(family_model):
    """The MTP layer's experts per expert (`experts.{e}.gate_proj`) or fused give the same head."""
    _, fused, prompts, refs = family_model("qwen3_5_moe")
    _, split, _, _ = family_model("qwen3_5_moe", mtp_experts_one_by_one=True)
    assert any(".experts.0.gate_proj" in k for k in split.mtp_weights)
    a = dict(tree_flatten(load_head(fused).parameters()))
    b = dict(tree_flatten(load_head(split).parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert [r.tokens for r in run(split, prompts, "mtp", 3, 7, "on")] == refs
