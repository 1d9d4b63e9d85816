"""The tiny fixture models: real checkpoint layouts, loadable by mlx-lm and mtplx.models.loading."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest

import tiny_models as tm

FAMILIES = ["llama", "qwen3", "qwen3_next", "deepseek_v3"]
PROMPT = "def fibonacci(n):\n    "
TEXT = "Hello world!\n  def f(x): return x * 2  # ünïcödé 🙂 <b>"


def _qwen3_next_mtp_keys(cfg):
    p = "mtp.layers.0"
    keys = {
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.fc.weight",
        "mtp.norm.weight",
        f"{p}.input_layernorm.weight",
        f"{p}.post_attention_layernorm.weight",
        f"{p}.mlp.gate.weight",
        f"{p}.mlp.shared_expert_gate.weight",
    }
    keys |= {f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    keys |= {f"{p}.mlp.shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    keys |= {
        f"{p}.mlp.experts.{e}.{n}.weight"
        for e in range(cfg["num_experts"])
        for n in ("gate_proj", "up_proj", "down_proj")
    }
    return keys


def _deepseek_nextn_keys(cfg):
    p = f"model.layers.{cfg['num_hidden_layers']}"
    keys = {
        f"{p}.{n}.weight"
        for n in (
            "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
            "input_layernorm", "post_attention_layernorm",
            "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
            "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
            "self_attn.o_proj", "mlp.gate",
        )
    }
    keys.add(f"{p}.mlp.gate.e_score_correction_bias")
    keys |= {f"{p}.mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    keys |= {
        f"{p}.mlp.experts.{e}.{n}.weight"
        for e in range(cfg["n_routed_experts"])
        for n in ("gate_proj", "up_proj", "down_proj")
    }
    return keys


def _config(path):
    return json.loads((path / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    d = tm.build_tokenizer(tmp_path / "tok")
    assert (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    hf = AutoTokenizer.from_pretrained(str(d))
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 0
    assert hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert len(hf) == 512
    ids = hf.encode(TEXT)
    assert hf.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())  # merges were learned
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected

    tok = load_tokenizer(d)
    assert tok.eos_token_ids == {0}
    assert tok.encode(TEXT) == ids
    assert tok.decode(ids) == TEXT
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.decode(chat_ids) == expected
    assert chat_ids[0] == 1 and chat_ids.count(2) == 2  # special tokens stay single ids
    detok = tok.detokenizer
    detok.reset()
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == TEXT


def test_tokenizer_is_deterministic(tmp_path):
    a = tm.build_tokenizer(tmp_path / "a")
    tm._TOKENIZER_CACHE.clear()  # force a second training run
    b = tm.build_tokenizer(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------------------------------------
# each family


@pytest.mark.parametrize("family", FAMILIES)
def test_family_builds_loads_and_generates(family, tiny_model):
    import mlx_lm
    from mlx_lm.utils import load_model

    path = tiny_model(family)
    cfg = _config(path)
    assert cfg["model_type"] == family
    assert cfg["eos_token_id"] == 0
    assert os.path.getsize(path / "model.safetensors") < 2_000_000

    model, _ = load_model(path, strict=False)
    _, tok = mlx_lm.load(str(tiny_model(family, with_mtp=False)))  # strict load
    prompt_ids = tok.encode(PROMPT)
    logits = model(mx.array([prompt_ids]))
    assert logits.shape == (1, len(prompt_ids), cfg["vocab_size"])
    assert mx.isfinite(logits).all().item()
    top = mx.softmax(logits[0], axis=-1).max(axis=-1)
    assert 0.02 < top.mean().item() < 0.8  # neither near-uniform nor one-hot

    text = mlx_lm.generate(model, tok, PROMPT, max_tokens=20, verbose=False)
    tokens = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=20)]
    assert len(tokens) == 20  # no eos: special tokens have short head rows
    assert isinstance(text, str) and text
    assert len(set(tokens)) >= 5, tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_does_not_depend_on_mtp(family, tiny_model):
    from mlx_lm.utils import load_model

    with_mtp, _ = load_model(tiny_model(family), strict=False)
    without, _ = load_model(tiny_model(family, with_mtp=False))
    x = mx.array([[5, 17, 300, 42, 9, 101]])
    assert mx.array_equal(with_mtp(x), without(x)).item()


def test_qwen3_next_checkpoint_layout(tiny_model):
    path = tiny_model("qwen3_next")
    cfg = _config(path)
    w = mx.load(str(path / "model.safetensors"))
    D, E = cfg["hidden_size"], cfg["num_experts"]
    interval = cfg["full_attention_interval"]
    conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + (
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    )
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        if (i + 1) % interval:
            assert w[f"{p}.linear_attn.conv1d.weight"].shape == (conv_dim, 1, cfg["linear_conv_kernel_dim"])
            for n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
                assert f"{p}.linear_attn.{n}" in w
        else:
            assert w[f"{p}.self_attn.q_proj.weight"].shape == (2 * cfg["num_attention_heads"] * cfg["head_dim"], D)
        for e in range(E):
            assert w[f"{p}.mlp.experts.{e}.up_proj.weight"].shape == (cfg["moe_intermediate_size"], D)
        assert w[f"{p}.mlp.gate.weight"].shape == (E, D)
        assert w[f"{p}.mlp.shared_expert_gate.weight"].shape == (1, D)
        assert f"{p}.mlp.shared_expert.down_proj.weight" in w
        # zero-centred RMSNorm: stored as offsets from 1
        assert abs(w[f"{p}.input_layernorm.weight"].mean().item()) < 0.1
    assert {k for k in w if k.startswith("mtp.")} == _qwen3_next_mtp_keys(cfg)
    assert w["mtp.fc.weight"].shape == (D, 2 * D)
    assert cfg["num_nextn_predict_layers"] == 1
    assert not any(k.startswith("mtp.") for k in mx.load(str(tiny_model("qwen3_next", with_mtp=False) / "model.safetensors")))


def test_qwen3_next_sanitize_applies_norm_offsets(tiny_model):
    from mlx_lm.utils import load_model

    path = tiny_model("qwen3_next")
    raw = mx.load(str(path / "model.safetensors"))
    model, _ = load_model(path, strict=False)
    layer0, layer3 = model.model.layers[0], model.model.layers[3]
    np.testing.assert_allclose(
        np.array(layer0.input_layernorm.weight), np.array(raw["model.layers.0.input_layernorm.weight"]) + 1.0
    )
    np.testing.assert_allclose(
        np.array(layer3.self_attn.q_norm.weight), np.array(raw["model.layers.3.self_attn.q_norm.weight"]) + 1.0
    )
    # the gated norm inside the linear attention is a plain weight
    np.testing.assert_allclose(
        np.array(layer0.linear_attn.norm.weight), np.array(raw["model.layers.0.linear_attn.norm.weight"])
    )
    conv = raw["model.layers.0.linear_attn.conv1d.weight"]
    assert layer0.linear_attn.conv1d.weight.shape == (conv.shape[0], conv.shape[2], 1)


def test_deepseek_v3_checkpoint_layout(tiny_model):
    path = tiny_model("deepseek_v3")
    cfg = _config(path)
    w = mx.load(str(path / "model.safetensors"))
    N, D, H = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] == 4
    assert cfg["num_experts_per_tok"] == 2 and cfg["n_shared_experts"] == 1
    assert "model.layers.0.mlp.gate_proj.weight" in w  # dense
    for i in range(1, N):
        assert f"model.layers.{i}.mlp.experts.3.down_proj.weight" in w
        assert w[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    assert w["model.layers.0.self_attn.kv_b_proj.weight"].shape == (
        H * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
        cfg["kv_lora_rank"],
    )
    assert {k for k in w if k.startswith(f"model.layers.{N}.")} == _deepseek_nextn_keys(cfg)
    assert not any(k.startswith(f"model.layers.{N + 1}.") for k in w)
    assert w[f"model.layers.{N}.eh_proj.weight"].shape == (D, 2 * D)
    assert cfg["num_nextn_predict_layers"] == 1


def test_deepseek_v3_strict_load_rejects_nextn(tiny_model):
    """mlx-lm's DeepSeek-V3 sanitize only drops `model.layers.61.*` (the real model's NextN
    index), so a strict mlx_lm.load of a checkpoint with NextN weights elsewhere fails."""
    import mlx_lm

    with pytest.raises(ValueError, match="parameters not in model"):
        mlx_lm.load(str(tiny_model("deepseek_v3")))


def test_qwen3_next_strict_load_ignores_mtp(tiny_model):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model("qwen3_next")))  # sanitize drops mtp.* itself
    assert not hasattr(model, "mtp")


# ---------------------------------------------------------------------------------------------
# mtplx.models.loading


@pytest.mark.parametrize("family", FAMILIES)
def test_mtplx_loading(family, tiny_model):
    from mlx_lm.utils import load_model

    import mtplx.models.loading

    path = tiny_model(family)
    bundle = mtplx.models.loading.load(path)
    assert bundle.model_type == family
    assert bundle.tokenizer.eos_token_ids == {0}
    cfg = _config(path)
    expected = {"qwen3_next": _qwen3_next_mtp_keys, "deepseek_v3": _deepseek_nextn_keys}.get(family)
    assert set(bundle.mtp_weights) == (expected(cfg) if expected else set())
    assert sorted(bundle.mtp_weights) == tm.mtp_keys(path)
    raw = mx.load(str(path / "model.safetensors"))
    for k, v in bundle.mtp_weights.items():  # raw checkpoint tensors, HF layout
        assert mx.array_equal(v, raw[k]).item()
    reference, _ = load_model(path, strict=False)
    x = mx.array([bundle.tokenizer.encode(PROMPT)])
    assert mx.array_equal(bundle.model(x), reference(x)).item()


# ---------------------------------------------------------------------------------------------
# small-vocab model and fixtures


def test_small_vocab_model(tiny_model):
    import mlx_lm

    path = tiny_model("small_vocab")
    model, tok = mlx_lm.load(str(path))
    cfg = _config(path)
    assert cfg["vocab_size"] == 16 and cfg["eos_token_id"] is None
    assert tok.eos_token_ids == set()
    rng = np.random.default_rng(0)
    x = mx.array(rng.integers(0, 16, size=(4, 32)).tolist())
    probs = mx.softmax(model(x).astype(mx.float32), axis=-1)
    assert probs.shape == (4, 32, 16)
    top = np.array(probs.max(axis=-1))
    assert np.median(top) < 0.4 and (top > 0.6).mean() < 0.05
    assert np.array(probs.min(axis=-1)).min() > 1e-4  # every token reachable

    with_eos = tiny_model("small_vocab", eos_token_id=0)
    _, tok = mlx_lm.load(str(with_eos))
    assert tok.eos_token_ids == {0}


def test_fixtures(tiny_model, tiny_models_dir):
    a = tiny_model("llama")
    assert tiny_model("llama") == a
    assert a.parent == tiny_models_dir
    assert tiny_model("llama", seed=1) != a
    cache = os.environ["MTPLX_CACHE"]
    assert os.path.isdir(cache)
    assert not cache.startswith(os.path.expanduser("~/.cache"))
    import mtplx.models.loading

    assert str(mtplx.models.loading.cache_dir()) == cache
