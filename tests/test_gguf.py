"""GGUF -> mlx-lm conversion (mtplx/models/gguf.py) against the same weights saved the mlx-lm way.

Each test writes a tiny GGUF the way llama.cpp's converter would (llama.cpp tensor names, q/k rows
permuted for llama, tokenizer as `tokenizer.ggml.*` metadata, some tensors Q4_0/Q4_1/Q5_0/Q5_1/
Q8_0) from a
tiny mlx-lm checkpoint, then checks that the converted model generates the same greedy tokens and
that the tokenizer encodes and decodes the same. No network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_models import CHAT_TEMPLATE, greedy_tokens

from mtplx.models.gguf import CONVERTER_VERSION, GGUFConversionError, convert_gguf
from mtplx.models.loading import load, resolve_model_path

Q = gguf.GGMLQuantizationType

# HF name (inside model.layers.N.) -> llama.cpp name (inside blk.N.)
_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GEMMA3_TO_GGUF = dict(
    _TO_GGUF, pre_feedforward_layernorm="ffn_norm", post_attention_layernorm="post_attention_norm",
    post_feedforward_layernorm="post_ffw_norm", **{"self_attn.q_norm": "attn_q_norm",
                                                  "self_attn.k_norm": "attn_k_norm"},
)

# which tensors the GGUF stores quantized (the rest stay F32)
QUANT_PLAN = {
    "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0,
    "ffn_up": Q.Q5_1, "ffn_gate": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.Q4_1,
}

PROMPT = "def greedy(tokens):\n    return [t for t in tokens if t]\n"


def _gguf_name(hf: str, arch: str = "llama") -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    table = _GEMMA3_TO_GGUF if arch == "gemma3" else _TO_GGUF
    return f"blk.{layer}.{table[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (HF rotate-half -> interleaved pairs)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _make_reference(tiny_model, tmp_path: Path, arch: str, tied: bool) -> Path:
    """A private copy of the tiny llama checkpoint; for qwen2 with random q/k/v biases."""
    src = tiny_model("llama", tie_word_embeddings=tied)
    ref = tmp_path / f"ref-{arch}"
    shutil.copytree(src, ref)
    if arch == "qwen2":
        cfg = json.loads((ref / "config.json").read_text())
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
        for k in ("attention_bias", "mlp_bias", "head_dim", "hidden_act"):
            cfg.pop(k, None)
        (ref / "config.json").write_text(json.dumps(cfg, indent=2))
        weights = dict(mx.load(str(ref / "model.safetensors")))
        rng = np.random.default_rng(7)
        for k in list(weights):
            if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                rows = weights[k].shape[0]
                weights[k[:-6] + "bias"] = mx.array(rng.normal(0, 0.5, rows).astype(np.float32))
        mx.save_safetensors(str(ref / "model.safetensors"), weights)
    return ref


def _write_gguf(ref: Path, path: Path, arch: str, quantize: bool) -> None:
    """Write `ref` as llama.cpp would; rewrite `ref`'s weights to the values the GGUF holds."""
    cfg = json.loads((ref / "config.json").read_text())
    tok = json.loads((ref / "tokenizer.json").read_text())
    tok_cfg = json.loads((ref / "tokenizer_config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(ref / "model.safetensors")).items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    if arch == "gemma3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_sliding_window(cfg["sliding_window"])

    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == cfg["vocab_size"]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])

    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for hf, value in weights.items():
        name = _gguf_name(hf, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w.add_tensor(name, value.astype(np.float32) + 1.0)  # llama.cpp stores 1 + w
            continue
        if arch == "llama" and ".attn_q." in name:
            value = _llama_cpp_permute(value, H)
        elif arch == "llama" and ".attn_k." in name:
            value = _llama_cpp_permute(value, KV)
        qtype = QUANT_PLAN.get(name.split(".")[-2]) if quantize and value.ndim == 2 else None
        if qtype is None:
            w.add_tensor(name, value.astype(np.float32))
            continue
        raw = gguf.quants.quantize(value.astype(np.float32), qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
        # the reference holds exactly what the GGUF holds (un-permuted back to the HF order)
        deq = gguf.quants.dequantize(raw, qtype).reshape(value.shape)
        if arch == "llama" and ".attn_q." in name:
            deq = _unpermute(deq, H)
        elif arch == "llama" and ".attn_k." in name:
            deq = _unpermute(deq, KV)
        weights[hf] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mx.save_safetensors(str(ref / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})


def _unpermute(w, n_heads):
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _make_gemma3_reference(tiny_model, tmp_path: Path) -> Path:
    """A tiny random gemma3_text checkpoint (mlx-lm's own module), with the llama tokenizer."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    ref = tmp_path / "ref-gemma3"
    shutil.copytree(tiny_model("llama"), ref)
    cfg = {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 6, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6, "vocab_size": 512, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 4096,
        "eos_token_id": 0,
    }
    (ref / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.random.seed(3)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    weights = {k: (mx.random.normal(v.shape) * (0.3 if k.endswith("norm.weight") else 0.08))
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(ref / "model.safetensors"), weights)
    return ref


@pytest.fixture
def gguf_case(tiny_model, tmp_path, monkeypatch):
    def make(arch="llama", tied=False, quantize=True):
        if arch == "gemma3":
            ref = _make_gemma3_reference(tiny_model, tmp_path)
        else:
            ref = _make_reference(tiny_model, tmp_path, arch, tied)
        path = tmp_path / f"tiny-{arch}.gguf"
        _write_gguf(ref, path, arch, quantize)
        return ref, path

    return make


def _logits(model, ids):
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False),
                                       ("gemma3", True)])
@pytest.mark.parametrize("mode", ["dequantize", "quantized"])
def test_converted_model_matches_safetensors(gguf_case, arch, tied, mode):
    ref_dir, path = gguf_case(arch, tied)
    ref = load(ref_dir)
    conv = load(path, gguf_mode=mode)  # converted once into the cache by mtplx.models.loading
    assert conv.path != path and (conv.path / "config.json").exists()
    assert conv.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)

    ids = ref.tokenizer.encode(PROMPT)
    assert conv.tokenizer.encode(PROMPT) == ids
    want = greedy_tokens(ref.model, ids, max_tokens=16)
    got = greedy_tokens(conv.model, ids, max_tokens=16)
    assert got == want
    a, b = _logits(ref.model, ids), _logits(conv.model, ids)
    if mode == "dequantize":
        np.testing.assert_array_equal(a, b)  # the very same fp32 weights
    else:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_quantized_tensors_stay_packed(gguf_case, tmp_path):
    _, path = gguf_case("llama", tied=False)
    out = convert_gguf(path, tmp_path / "q", dequantize=False)
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    assert quant["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert quant["model.layers.0.self_attn.k_proj"]["bits"] == 4
    assert quant["model.layers.1.self_attn.v_proj"]["bits"] == 4  # Q4_1
    assert quant["model.embed_tokens"]["bits"] == 8
    assert quant["lm_head"]["bits"] == 4
    assert quant["model.layers.0.self_attn.o_proj"]["bits"] == 5  # Q5_0
    assert quant["model.layers.1.mlp.up_proj"]["bits"] == 5  # Q5_1
    assert quant["model.layers.0.mlp.down_proj"] is False  # F32 in the GGUF

    bundle = load(out)
    layer = bundle.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(bundle.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(layer.mlp.down_proj) is nn.Linear

    flat = json.loads((out / "mtplx_gguf.json").read_text())
    assert flat["dequantize"] is False and flat["tensor_types"]["Q8_0"] > 0

    deq = convert_gguf(path, tmp_path / "f", dequantize=True)
    config = json.loads((deq / "config.json").read_text())
    assert "quantization" not in config
    assert all(v.dtype == mx.float32 for v in mx.load(str(deq / "model.safetensors")).values())


def test_tokenizer_matches(gguf_case):
    ref_dir, path = gguf_case("llama", quantize=False)
    ref, conv = load(ref_dir).tokenizer, load(path).tokenizer
    texts = [
        PROMPT,
        "Hello,   world!\n\n\tTabs\u00e9 and unicode \u2603 \U0001F600 2024-11-29",
        "<|im_start|>user\nhi<|im_end|>\n",
        "   leading and trailing spaces   ",
    ]
    for text in texts:
        ids = ref.encode(text)
        assert conv.encode(text) == ids, text
        assert conv.decode(ids) == ref.decode(ids) == text
    assert conv.eos_token_ids == ref.eos_token_ids
    assert conv.convert_tokens_to_ids("<|im_end|>") == ref.convert_tokens_to_ids("<|im_end|>")
    assert conv.encode("<|im_start|>")[-1] == 1  # special tokens stay whole
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert conv.chat_template == CHAT_TEMPLATE
    assert conv.apply_chat_template(msgs, add_generation_prompt=True) == ref.apply_chat_template(
        msgs, add_generation_prompt=True
    )


def test_permutation_is_llama_cpps_rope_layout(gguf_case, tmp_path):
    """Independent of our un-permute: the GGUF's q/k rows, used as they are with interleaved
    (traditional) rope, give the logits of the HF layout with rotate-half rope."""
    ref_dir, path = gguf_case("llama", quantize=False)
    ref = load(ref_dir)
    raw = tmp_path / "as-stored"
    shutil.copytree(ref_dir, raw)
    cfg = json.loads((raw / "config.json").read_text())
    cfg["rope_traditional"] = True
    (raw / "config.json").write_text(json.dumps(cfg))
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    weights = {k: mx.array(stored[_gguf_name(k)].reshape(v.shape))
               for k, v in mx.load(str(raw / "model.safetensors")).items()}
    mx.save_safetensors(str(raw / "model.safetensors"), weights)
    ids = ref.tokenizer.encode(PROMPT)
    np.testing.assert_allclose(_logits(load(raw).model, ids), _logits(ref.model, ids),
                               rtol=1e-4, atol=1e-4)


def test_loader_converts_once_per_mode(gguf_case):
    _, path = gguf_case("llama")
    first = resolve_model_path(path, "dequantize")
    stamp = (first / "config.json").stat().st_mtime_ns
    assert resolve_model_path(path, "dequantize") == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    other = resolve_model_path(path, "quantized")
    assert other != first
    assert "quantization" in json.loads((other / "config.json").read_text())
    # a directory holding a .gguf (and no config.json) works too
    assert resolve_model_path(path.parent, "quantized") == other


def test_a_copy_from_an_older_converter_is_converted_again(gguf_case):
    """A cached conversion keeps no tokenizer (or weights) an older converter wrote."""
    _, path = gguf_case("llama")
    out = resolve_model_path(path, "dequantize")
    record = json.loads((out / "mtplx_gguf.json").read_text())
    assert record.pop("converter") == CONVERTER_VERSION
    (out / "mtplx_gguf.json").write_text(json.dumps(record))  # as the first converter wrote it
    (out / "tokenizer.json").write_text("{}")
    assert resolve_model_path(path, "dequantize") == out
    assert json.loads((out / "mtplx_gguf.json").read_text())["converter"] == CONVERTER_VERSION
    assert load(out).tokenizer.encode(PROMPT)


def test_gguf_mode_is_a_job_field_the_engine_is_handed(gguf_case, monkeypatch, tmp_path):
    """The job's model.gguf_mode picks the converted copy (no environment variable is read), and a
    wrong value is refused when the job is read, naming the key and the choices."""
    from pipelines.errors import JobError
    from pipelines.execution.opening import load_engine, resolve_model_dir
    from pipelines.job.config import build_job

    _, path = gguf_case("llama")
    monkeypatch.setenv("MTPLX_GGUF_MODE", "quantized")  # the old variable: ignored now
    raw = {"name": "g", "model": {"path": str(path), "gguf_mode": "dequantize"}, "input": {"path": "in.jsonl"},
           "speculative": {"method": "none"}, "output": {"dir": str(tmp_path / "out")}}
    job = build_job(raw)
    assert job.model.gguf_mode == "dequantize"
    assert resolve_model_dir(job) == str(resolve_model_path(path, "dequantize"))
    engine = load_engine(job)
    assert engine.bundle.path == resolve_model_path(path, "dequantize") and engine.bundle.gguf_mode == "dequantize"
    assert "quantization" not in engine.bundle.config
    with pytest.raises(JobError, match=r"model\.gguf_mode.*auto \| dequantize \| quantized"):
        build_job(dict(raw, model={"path": str(path), "gguf_mode": "q4"}))
    with pytest.raises(ValueError, match="model.gguf_mode must be one of auto, dequantize, quantized"):
        resolve_model_path(path, "q4")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFConversionError, match="mamba"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sentencepiece_vocab_matches_sentencepiece():
    """`tokenizer.ggml.model == "llama"` (Llama 2 / TinyLlama / Gemma style): a sentencepiece BPE
    vocabulary with scores and byte fallback and no merges list. Checked against sentencepiece."""
    import io
    import sysconfig

    import sentencepiece as spm

    from mtplx.models.gguf import build_tokenizer

    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text(encoding="utf-8")
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text.splitlines() if line.strip()]),
        model_writer=proto, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.vocab_size()

    def kind(i):
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1

    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    tok = build_tokenizer(meta)
    samples = [
        "Hello world, textwrap wraps text!",
        "def fill(text, width=70, **kwargs):\n    return '\\n'.join(wrap(text))",
        "  Two  spaces, a\ttab and \u00fcn\u00efc\u00f6d\u00e9 \u2603",
    ]
    for s in samples:
        ids = tok.encode(s).ids
        assert ids[0] == 1  # add_bos_token defaults to true for sentencepiece vocabularies
        assert ids[1:] == sp.encode(s), s
        assert tok.decode(ids) == s
