"""`mtplx-batch train-head`: a NextN-style MTP sidecar head trained on a frozen trunk.

Shown on the tiny fixture models (qwen3: tied embeddings; llama: untied lm_head):
- training lowers held-out loss and raises held-out acceptance over the untrained head;
- the sidecar round-trips through `mtplx.models.mtp.load_head` bit for bit (one and two blocks);
- the engine with `speculative: {method: mtp, mtp_head: DIR}` gives greedy output identical to plain
  decoding, with more accepted drafts than an untrained head;
- a head for another trunk is refused, by shape and by weights;
- an interrupted run resumes from its checkpoint and ends exactly where an uninterrupted one does.
"""

from __future__ import annotations

import json
import random
import time

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from mtplx.config import SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.models.mtp import SIDECAR_META, SIDECAR_WEIGHTS, load_head
from mtplx.request import Request, SamplingParams
from mtplx.training.train_head import TrainConfig, TrainData, TrainHeadError, checkpoint_step, train_head
from pipelines.cli.train_head import train_head as train_head_cmd
from pipelines.io.train_data import read_train_data

WORDS = ("def class return import for while if else self value list dict print json "
         "the quick brown fox answer question").split()
TIMINGS = {}


def _prompts(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(n)]


def _write_prompts(path, n, seed):
    with open(path, "w") as f:
        for i, p in enumerate(_prompts(n, seed)):
            f.write(json.dumps({"id": f"r{i}", "prompt": p}) + "\n")
    return path


# Settings that train a visibly better head in a few seconds on the tiny models.
FAST = dict(steps=100, batch_size=4, seq_len=96, lr=3e-3, heldout=0.12, eval_every=50, checkpoint_every=50)


@pytest.fixture(scope="module")
def qwen3_head(tiny_model, tmp_path_factory):
    """A qwen3 head trained through the CLI on a job's prompts + the model's own continuations."""
    tmp = tmp_path_factory.mktemp("th_qwen3")
    model = tiny_model("qwen3")
    prompts = _write_prompts(tmp / "prompts.jsonl", 128, seed=0)
    job = tmp / "job.yaml"
    job.write_text(
        f"name: th\nmodel: {{path: {model}}}\n"
        f"input: {{format: jsonl, path: {prompts}, id_column: id, prompt_column: prompt}}\n"
        f"generation: {{max_tokens: 40}}\noutput: {{dir: {tmp / 'runs'}}}\n"
    )
    out = tmp / "head"
    t0 = time.perf_counter()
    args = [str(model), "--data", str(job), "--out", str(out), "--quiet"]
    for k, v in FAST.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    res = CliRunner().invoke(train_head_cmd, args, catch_exceptions=False)
    TIMINGS["qwen3 train (cli, self-distill)"] = time.perf_counter() - t0
    assert res.exit_code == 0, res.output
    return model, out, args


def _untrained(bundle, trained_dir, out):
    """An untrained head (step 0) on the very same sequences and held-out split."""
    data = TrainData.load(trained_dir / "checkpoint" / "data.npz")
    cfg = TrainConfig(**dict(FAST, steps=0))
    train_head(bundle, data.sequences, out, cfg)
    return out


def _chat(bundle, text):
    """The prompt as `run` renders it for these models (chat template, as in training)."""
    return list(bundle.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def _generate(bundle, spec, prompts, max_tokens=32):
    eng = Engine(bundle, spec)
    reqs = [Request(key=i, prompt_tokens=_chat(bundle, p), params=SamplingParams(max_tokens=max_tokens))
            for i, p in enumerate(prompts)]
    out = {r.key: r for r in eng.generate(reqs)}
    return [out[i] for i in range(len(reqs))]


def test_training_improves_heldout_and_writes_nextn_sidecar(qwen3_head):
    model, out, _ = qwen3_head
    meta = json.loads((out / SIDECAR_META).read_text())
    print(f"\nqwen3: held-out loss {meta['initial_heldout_loss']:.3f} -> {meta['heldout_loss']:.3f}, "
          f"acceptance {meta['initial_heldout_acceptance']:.3f} -> {meta['heldout_acceptance']:.3f}, "
          f"train loss {meta['train_loss']:.3f}, {meta['train_positions']} train / {meta['heldout_positions']} "
          f"held-out positions, {TIMINGS['qwen3 train (cli, self-distill)']:.1f}s")
    assert meta["layout"] == "nextn" and meta["num_hidden_layers"] == 2 and meta["depth_layers"] == 1
    assert meta["steps"] == FAST["steps"]
    assert meta["trunk"] == {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512}
    assert meta["data"].startswith("job:")
    assert meta["heldout_loss"] < meta["initial_heldout_loss"] - 0.3
    assert meta["heldout_acceptance"] > meta["initial_heldout_acceptance"] + 0.05
    keys = set(mx.load(str(out / SIDECAR_WEIGHTS)))
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "self_attn.q_proj.weight", "self_attn.k_norm.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
        assert f"model.layers.2.{k}" in keys
    assert all(k.startswith("model.layers.2.") for k in keys)
    assert not any("shared_head.head" in k or "embed_tokens" in k or "lm_head" in k for k in keys)
    assert checkpoint_step(out) == FAST["steps"]


def test_engine_with_trained_head_is_exact_and_accepts_more(qwen3_head, tmp_path):
    model, out, _ = qwen3_head
    bundle = load(model)
    untrained = _untrained(bundle, out, tmp_path / "untrained")
    prompts = _prompts(8, seed=123)  # prompts the head never saw
    plain = _generate(bundle, SpeculativeConfig(method="none"), prompts)
    trained = _generate(bundle, SpeculativeConfig(method="mtp", mtp_head=str(out), depth=3, adaptive_depth=False), prompts)
    fresh = _generate(bundle, SpeculativeConfig(method="mtp", mtp_head=str(untrained), depth=3, adaptive_depth=False), prompts)
    for p, t, f in zip(plain, trained, fresh):
        assert t.tokens == p.tokens and f.tokens == p.tokens
    acc_t = sum(r.stats.accepted_tokens for r in trained)
    acc_f = sum(r.stats.accepted_tokens for r in fresh)
    drafted_t = sum(r.stats.drafted_tokens for r in trained)
    drafted_f = sum(r.stats.drafted_tokens for r in fresh)
    print(f"\nqwen3 engine: accepted {acc_t}/{drafted_t} drafts with the trained head, "
          f"{acc_f}/{drafted_f} untrained")
    assert acc_t > 0 and acc_t > acc_f


def test_engine_accepts_what_the_teacher_forced_replay_predicts(qwen3_head):
    """Online vs offline at depth 1 on the same positions: the engine's drafts are the head's argmax
    over (trunk hidden h_i, token x_{i+1}) with its own KV cache, exactly what head_eval scores, so
    walking the teacher-forced hits as rounds gives the engine's tokens per verify (up to a row's
    last round, where the engine drafts no further than its max_tokens)."""
    from mtplx.training.head_data import trunk_features
    from mtplx.training.head_eval import depth_hits, replayed_tokens_per_verify

    model, out, _ = qwen3_head
    bundle = load(model)
    texts = _prompts(8, seed=321)
    prompts = [_chat(bundle, p) for p in texts]
    res = _generate(bundle, SpeculativeConfig(method="mtp", mtp_head=str(out), depth=1, adaptive_depth=False),
                    texts, max_tokens=40)
    online = sum(r.stats.accepted_tokens + r.stats.verify_calls for r in res) / sum(r.stats.verify_calls for r in res)
    seqs = [list(p) + list(r.tokens) for p, r in zip(prompts, res)]
    feats = trunk_features(bundle.model, seqs, [len(p) - 1 for p in prompts], mx.float32, True)
    replay = replayed_tokens_per_verify(depth_hits(load_head(bundle, str(out)), feats, 1), 1)
    print(f"\ndepth 1: online {online:.3f} tokens/verify, replayed {replay:.3f}")
    assert online > 1.05 and abs(online - replay) < 0.02


def test_replay_walks_rounds_as_the_engine_does():
    from mtplx.training.head_eval import replayed_tokens_per_verify

    # one sequence, depths 2, bases 0..5 scored: hit runs from base 0: 2 (-> base 3), 0 (-> 4), 1 (-> 6)
    grid = np.array([[1, 0, 0, 0, 1, 0],
                     [1, 0, 0, 1, 0, 0]], dtype=np.int8)
    assert replayed_tokens_per_verify([grid], 2) == (3 + 1 + 2) / 3
    assert replayed_tokens_per_verify([grid], 1) == (2 + 1 + 1 + 2) / 4  # bases 0, 2, 3, 4
    unscored = np.array([[-1, 1, 1, 0]], dtype=np.int8)  # scoring starts at base 1
    assert replayed_tokens_per_verify([unscored], 1) == (2 + 1) / 2


def test_sidecar_round_trips_through_load_head(qwen3_head):
    model, out, _ = qwen3_head
    bundle = load(model)
    head = load_head(bundle, str(out))
    trained = mx.load(str(out / "checkpoint" / "latest" / "head.safetensors"))
    got = dict(tree_flatten(head.parameters()))
    assert set(got) == set(trained)
    for k, v in trained.items():
        assert mx.array_equal(got[k], v).item(), k


def test_llama_table_prompts_two_blocks(tiny_model, tmp_path):
    """llama (untied lm_head), prompts from a JSONL file, a two-block head: learns, round-trips, is exact."""
    model = tiny_model("llama")
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 96, seed=1)
    bundle = load(model)
    out = tmp_path / "head"
    t0 = time.perf_counter()
    cfg = TrainConfig(**dict(FAST, steps=60, depth_layers=2), max_new_tokens=32)
    res = train_head(bundle, str(prompts), out, cfg, read=read_train_data)
    TIMINGS["llama train (2 blocks)"] = time.perf_counter() - t0
    print(f"\nllama (2 blocks): held-out loss {res.initial_heldout_loss:.3f} -> {res.heldout_loss:.3f}, "
          f"acceptance {res.initial_heldout_acceptance:.3f} -> {res.heldout_acceptance:.3f}, "
          f"{TIMINGS['llama train (2 blocks)']:.1f}s")
    assert res.heldout_loss < res.initial_heldout_loss - 0.2
    assert res.heldout_acceptance > res.initial_heldout_acceptance
    keys = set(mx.load(str(out / SIDECAR_WEIGHTS)))
    assert "model.layers.2.eh_proj.weight" in keys and "model.layers.3.self_attn.q_proj.weight" in keys
    head = load_head(bundle, str(out))
    assert len(head.layers) == 2
    trained = mx.load(str(out / "checkpoint" / "latest" / "head.safetensors"))
    got = dict(tree_flatten(head.parameters()))
    assert set(got) == set(trained) and all(mx.array_equal(got[k], v).item() for k, v in trained.items())
    prompts = _prompts(6, seed=7)
    plain = _generate(bundle, SpeculativeConfig(method="none"), prompts, 24)
    spec = _generate(bundle, SpeculativeConfig(method="mtp", mtp_head=str(out), depth=2, adaptive_depth=False), prompts, 24)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert sum(r.stats.accepted_tokens for r in spec) > 0


def test_plain_text_data(tiny_model, tmp_path):
    model = tiny_model("llama")
    import textwrap

    text = tmp_path / "corpus.txt"
    text.write_text(open(textwrap.__file__).read())
    res = train_head(load(model), str(text), tmp_path / "head", TrainConfig(steps=20, batch_size=4, seq_len=64,
                                                                            lr=3e-3, heldout=0.1, eval_every=20))
    meta = json.loads((tmp_path / "head" / SIDECAR_META).read_text())
    assert meta["data"].startswith("text:") and meta["sequences"] > 10
    assert res.heldout_loss < res.initial_heldout_loss


def test_head_for_another_trunk_is_refused(qwen3_head, tiny_model):
    _, out, _ = qwen3_head
    other_shape = load(tiny_model("llama"))
    with pytest.raises(ValueError, match="different trunk.*model_type: head 'qwen3' vs model 'llama'"):
        load_head(other_shape, str(out))
    with pytest.raises(ValueError, match="different trunk"):
        Engine(other_shape, SpeculativeConfig(method="mtp", mtp_head=str(out)))
    same_shape = load(tiny_model("qwen3", seed=1))  # same config, other weights
    with pytest.raises(ValueError, match="same shape, other weights"):
        load_head(same_shape, str(out))


def test_interrupt_and_resume_continues_the_schedule(tiny_model, tmp_path):
    bundle = load(tiny_model("llama"))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 500, size=int(rng.integers(20, 40))).tolist() for _ in range(24)]
    cfg = dict(steps=30, batch_size=4, seq_len=64, lr=3e-3, eval_every=10, checkpoint_every=10)
    straight = train_head(bundle, seqs, tmp_path / "a", TrainConfig(**cfg))

    def stop_at_15(step, metrics):
        if step == 15:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_head(bundle, seqs, tmp_path / "b", TrainConfig(**cfg), callback=stop_at_15)
    assert checkpoint_step(tmp_path / "b") == 15
    assert not (tmp_path / "b" / SIDECAR_WEIGHTS).exists()
    with pytest.raises(TrainHeadError, match="steps: checkpoint 30 vs now 40.*--restart"):
        train_head(bundle, seqs, tmp_path / "b", TrainConfig(**dict(cfg, steps=40)))
    resumed = train_head(bundle, seqs, tmp_path / "b", TrainConfig(**cfg))
    assert resumed.resumed_from == 15 and resumed.steps == 30
    a = mx.load(str(tmp_path / "a" / SIDECAR_WEIGHTS))
    b = mx.load(str(tmp_path / "b" / SIDECAR_WEIGHTS))
    assert set(a) == set(b)
    for k in a:
        assert mx.allclose(a[k], b[k], atol=1e-6).item(), k
    assert resumed.heldout_loss == pytest.approx(straight.heldout_loss, abs=1e-5)
    assert resumed.initial_heldout_loss == pytest.approx(straight.initial_heldout_loss)


def test_cli_errors(tmp_path, tiny_model):
    r = CliRunner().invoke(train_head_cmd, [str(tiny_model("llama")), "--data", str(tmp_path / "nope.yaml"),
                                            "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = CliRunner().invoke(train_head_cmd, [str(tmp_path / "no-model"), "--data", "x", "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_cli_rerun_resumes_and_changed_data_is_refused(qwen3_head, tmp_path):
    model, out, args = qwen3_head
    args = list(args)
    before = json.loads((out / SIDECAR_META).read_text())
    r = CliRunner().invoke(train_head_cmd, args, catch_exceptions=False)  # done already: nothing to train
    assert r.exit_code == 0, r.output
    after = json.loads((out / SIDECAR_META).read_text())
    assert after["steps"] == before["steps"] and after["heldout_loss"] == pytest.approx(before["heldout_loss"])
    other = tmp_path / "other.yaml"
    job = open(args[args.index("--data") + 1]).read()
    other.write_text(job.replace("max_tokens: 40", "max_tokens: 30"))
    args[args.index("--data") + 1] = str(other)
    r = CliRunner().invoke(train_head_cmd, args)
    assert r.exit_code == 2 and "data: checkpoint" in r.output and "--restart" in r.output


def test_training_the_draft_recursion_keeps_acceptance_at_depth(tiny_model, tmp_path):
    """Depth 2+ feeds the head its own output. Trained on depth 1 alone, acceptance falls with
    depth; trained through the recursion (`draft_depths`), it holds up at depths 2 and 3."""
    from tiny_models import reference_tokens

    bundle = load(tiny_model("qwen3", seed=1))
    rng = np.random.default_rng(0)
    sequences = []
    for _ in range(96):  # self-distilled: short random prompts and the model's greedy continuations
        prompt = rng.integers(5, 512, 6).tolist()
        sequences.append(prompt + reference_tokens(bundle.model, prompt, 58, set()))
    by_depth = {}
    for depths in (1, 2):
        cfg = TrainConfig(steps=200, batch_size=8, seq_len=96, lr=3e-3, heldout=0.12, eval_every=1000,
                          checkpoint_every=1000, draft_depths=depths)
        train_head(bundle, sequences, tmp_path / f"d{depths}", cfg)
        by_depth[depths] = json.loads((tmp_path / f"d{depths}" / SIDECAR_META).read_text())["heldout_acceptance_by_depth"]
    print(f"\nheld-out acceptance at draft depths 1-3: trained on depth 1 {np.round(by_depth[1], 3).tolist()}, "
          f"through depth 2 {np.round(by_depth[2], 3).tolist()}")
    one, two = by_depth[1], by_depth[2]
    assert len(two) == 4
    assert two[1] > one[1] + 0.03 and two[2] > one[2] + 0.03
    assert two[2] / two[0] > one[2] / one[0]  # acceptance falls less with depth


def test_recipe_sample_sampled_continuations_text_and_other_heldout(tiny_model, tmp_path):
    """The recipe's pieces end to end through the CLI: a seeded sample of the job's rows, greedy +
    sampled continuations (a prompt's continuations are held out together), general text for
    training only, a second dataset evaluated only, a drafting vocabulary, the report printed."""
    model = tiny_model("llama")
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 40, seed=5)
    other_rows = _write_prompts(tmp_path / "other.jsonl", 12, seed=9)
    other = tmp_path / "other.yaml"  # a second job: 8 of its 12 rows are sampled
    other.write_text(
        f"name: other\nmodel: {{path: {model}}}\n"
        f"input: {{format: jsonl, path: {other_rows}, id_column: id, prompt_column: prompt}}\n"
        f"generation: {{max_tokens: 12}}\noutput: {{dir: {tmp_path / 'runs2'}}}\n"
    )
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.py").write_text("def f(x):\n    return x + 1\n" * 40)
    (tmp_path / "text" / "b.md").write_text("the quick brown fox answer question " * 60)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: th\nmodel: {{path: {model}}}\n"
        f"input: {{format: jsonl, path: {prompts}, id_column: id, prompt_column: prompt}}\n"
        f"generation: {{max_tokens: 24}}\noutput: {{dir: {tmp_path / 'runs'}}}\n"
    )
    out = tmp_path / "head"
    args = [str(model), "--data", str(job), "--out", str(out), "--sample", "24", "--samples-per-prompt", "1",
            "--text", str(tmp_path / "text"), "--text-tokens", "600", "--heldout-data", str(other),
            "--heldout-rows", "8", "--draft-vocab", "64", "--hidden-weight", "0.1", "--steps", "20",
            "--batch-size", "4", "--seq-len", "64", "--heldout", "0.2", "--eval-every", "10"]
    res = CliRunner().invoke(train_head_cmd, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    meta = json.loads((out / SIDECAR_META).read_text())
    rows = meta["sample_rows"]
    assert len(rows) == 24 and rows == sorted(set(rows)) and rows != list(range(24)) and max(rows) < 40
    assert "text:" in meta["data"] and meta["draft_vocab"] == 64
    assert len(meta["heldout_acceptance_by_depth"]) == 4
    walked = meta["heldout_replayed_tokens_per_verify"]
    assert sorted(walked) == ["1", "2", "3", "4"] and all(1.0 <= walked[k] <= int(k) + 1 for k in walked)
    assert "walked as the engine's rounds" in res.output
    (held_other,) = meta["heldout_other"]
    assert held_other["data"].startswith("job:") and held_other["sequences"] == 8
    assert len(held_other["acceptance_by_depth"]) == 4
    assert f"| {held_other['data']} |" in res.output and "tokens per verify" in res.output
    ids = np.load(out / "mtp_draft_vocab.npy")
    assert len(ids) == 64
    data = TrainData.load(out / "checkpoint" / "data.npz")
    held = set(data.heldout)
    for i, g in enumerate(data.groups):  # a prompt's greedy and sampled continuations stay together
        assert (i in held) == any(j in held for j, h in enumerate(data.groups) if h == g)
    assert 2 * 24 <= len(data.sequences) and all(data.starts[i] == 0 for i in range(48, len(data.sequences)))
    assert not held & set(range(48, len(data.sequences)))  # general text is never held out
    # the head drafts among those ids in the engine, and output stays exact
    bundle = load(model)
    prompts = _prompts(4, seed=77)
    plain = _generate(bundle, SpeculativeConfig(method="none"), prompts, 16)
    spec = _generate(bundle, SpeculativeConfig(method="mtp", mtp_head=str(out), depth=3), prompts, 16)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
