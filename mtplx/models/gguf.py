"""Turn a GGUF file (llama.cpp's format) of a llama, qwen2 or gemma3 model into an mlx-lm directory,
with its tokenizer files and `mtplx_gguf.json` (what was converted and how).

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are exactly MLX affine quantization, so they may stay packed (the
default on a GPU; on a CPU fp32 matmuls are faster); other types are dequantized with `gguf`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

_EXACT_QUANT = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}  # exactly MLX affine: bits (group 32)
_GROUP = 32
_SHARD_BYTES = 2 << 30

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}

# llama.cpp block tensor names -> HF names, per architecture (suffix .weight / .bias is kept).
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_GEMMA3_BLOCK_NAMES = dict(_BLOCK_NAMES, ffn_norm="pre_feedforward_layernorm",
                           post_attention_norm="post_attention_layernorm", post_ffw_norm="post_feedforward_layernorm",
                           attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


CONVERTER_VERSION = 2  # raised when the output changes: older copies are converted again


class GGUFConversionError(ValueError):
    pass


def default_dequantize() -> bool:
    """True where float weights generate faster than quantized ones: on the CPU."""
    import mlx.core as mx
    return mx.default_device() == mx.cpu


def default_dtype() -> str:
    return "float32" if default_dequantize() else "float16"


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dequantize: Optional[bool] = None,
                 dtype: Optional[str] = None) -> Path:
    """Write an mlx-lm directory for `gguf_path` into `out_dir` (defaults: the faster here)."""
    import gguf
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    dequantize = default_dequantize() if dequantize is None else dequantize
    dtype = dtype or default_dtype()
    if dtype not in ("float32", "float16", "bfloat16"):
        raise GGUFConversionError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")

    reader = gguf.GGUFReader(str(gguf_path))
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _MODEL_TYPES:
        raise GGUFConversionError(f"{gguf_path}: architecture {arch!r} is not supported "
                                  f"(supported: {', '.join(sorted(_MODEL_TYPES))})")
    config = _config(meta, arch, reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # a plain mkdir's permissions, not mkdtemp's 0700
    try:
        quant, types = _write_weights(reader, arch, config, tmp, dequantize, dtype)
        if quant:
            config.update(quantization=quant, quantization_config=quant)
        _write_tokenizer(meta, config, tmp)
        record = {"source": str(gguf_path.resolve()), "source_bytes": gguf_path.stat().st_size, "architecture": arch,
                  "name": meta.get("general.name"), "dequantize": dequantize, "dtype": dtype, "tensor_types": types,
                  "converter": CONVERTER_VERSION}
        (tmp / "mtplx_gguf.json").write_text(json.dumps(record, indent=1))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_current(out_dir: Path) -> bool:
    try:
        return json.loads((out_dir / "mtplx_gguf.json").read_text()).get("converter") == CONVERTER_VERSION
    except (OSError, ValueError):
        return False


def _read_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            with contextlib.suppress(Exception):  # an odd field, unused
                meta[key] = field.contents()
    return meta


def _config(meta: dict, arch: str, reader) -> dict:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    n_heads = int(get("attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embd.shape[1])  # GGUF shapes are innermost-first: [hidden, vocab]
    config = {"model_type": _MODEL_TYPES[arch],
              "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "gemma3": "Gemma3ForCausalLM"}[arch]],
              "hidden_size": int(get("embedding_length")), "num_hidden_layers": int(get("block_count")),
              "intermediate_size": int(get("feed_forward_length")), "num_attention_heads": n_heads,
              "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
              "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
              "rope_theta": float(get("rope.freq_base", 10000.0)), "vocab_size": vocab_size,
              "max_position_embeddings": int(get("context_length", 2048)),
              "tie_word_embeddings": "output.weight" not in names}
    head_dim = get("attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn") and get("rope.scaling.factor"):
        config["rope_scaling"] = {"type": scaling, "rope_type": scaling, "factor": float(get("rope.scaling.factor"))}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length", config["max_position_embeddings"]))
    if arch == "llama":
        config.update(attention_bias="blk.0.attn_q.bias" in names, mlp_bias="blk.0.ffn_up.bias" in names)
    if arch == "gemma3":
        config.update(head_dim=int(head_dim or 256), query_pre_attn_scalar=int(head_dim or 256),
                      sliding_window=int(get("attention.sliding_window", 512)), sliding_window_pattern=6,
                      rope_local_base_freq=10000.0, rope_theta=float(get("rope.freq_base", 1000000.0)))
    for key, token_key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{token_key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{token_key}"])
    eos = list(dict.fromkeys(int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
                             if f"tokenizer.ggml.{k}_token_id" in meta))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _hf_name(name: str, arch: str) -> Optional[str]:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: drop it)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        table = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
        if parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{suffix}"
    if stem == "rope_freqs":  # precomputed llama3 rope factors
        warnings.warn("GGUF has rope_freqs (Llama 3.1-style rope scaling), which this converter "
                      "drops: output will differ from llama.cpp's", stacklevel=3)
        return None
    raise GGUFConversionError(f"unknown GGUF tensor {name!r} for architecture {arch}")


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved q/k rows per head (HF keeps the rope halves apart); any row data."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _pack_exact(raw: np.ndarray, qtype: str, rows: int, cols: int):
    """Exact GGUF blocks (w = d * q + m over 32 values) -> MLX affine (weight, scales, biases)."""
    nblocks = cols // _GROUP
    blocks = np.ascontiguousarray(raw).reshape(rows, nblocks, -1)

    def f16(lo):
        return blocks[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    def nibbles(lo):  # byte j holds value j (low nibble) and value j + 16 (high nibble)
        packed = blocks[..., lo:lo + 16]
        return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.uint32)

    def fifth_bits(lo):  # a little-endian uint32 whose bit j is bit 4 of value j
        qh = blocks[..., lo:lo + 4].copy().view("<u4")
        return ((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4

    d = f16(0)
    if qtype == "Q8_0":  # d, int8[32]: w = d * q  ->  q + 128, bias = -128 d
        q = blocks[..., 2:34].copy().view(np.int8).astype(np.int32) + 128
        bias = -128.0 * d
    elif qtype == "Q4_0":  # d, nibbles: w = d * (q - 8)
        q, bias = nibbles(2), -8.0 * d
    elif qtype == "Q4_1":  # d, m, nibbles: w = d * q + m
        q, bias = nibbles(4), f16(2)
    elif qtype == "Q5_0":  # d, high bits, nibbles: w = d * (q - 16)
        q, bias = nibbles(6) | fifth_bits(2), -16.0 * d
    elif qtype == "Q5_1":  # d, m, high bits, nibbles: w = d * q + m
        q, bias = nibbles(8) | fifth_bits(4), f16(2)
    else:
        raise GGUFConversionError(f"{qtype} has no exact MLX representation")
    bits = _EXACT_QUANT[qtype]
    return _pack_bits(q.astype(np.uint64), bits, rows, cols), d.astype(np.float16), bias.astype(np.float16)


def _pack_bits(q: np.ndarray, bits: int, rows: int, cols: int) -> np.ndarray:
    """(rows, blocks, 32) integers < 2**bits -> MLX's packing, a little-endian bit stream in uint32s."""
    words = np.zeros(q.shape[:-1] + (bits,), dtype=np.uint64)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        v = q[..., i] << np.uint64(shift)
        words[..., word] |= v & np.uint64(0xFFFFFFFF)
        if shift + bits > 32:
            words[..., word + 1] |= v >> np.uint64(32)
    return words.astype(np.uint32).reshape(rows, cols * bits // 32)


def _is_quantizable(hf: str, shape: Tuple[int, ...]) -> bool:
    linear = hf.rsplit(".", 2)[-2].endswith("_proj") or hf.startswith(("lm_head.", "model.embed_tokens."))
    return hf.endswith(".weight") and linear and len(shape) == 2 and shape[1] % _GROUP == 0


def _write_weights(reader, arch, config, out: Path, dequantize: bool, dtype: str):
    import gguf
    import mlx.core as mx
    mx_dtype = getattr(mx, dtype)
    permuted = {".self_attn.q_proj.": config["num_attention_heads"],
                ".self_attn.k_proj.": config["num_key_value_heads"]}
    quant: Dict[str, object] = {}
    types = Counter(t.tensor_type.name for t in reader.tensors)
    shard: Dict[str, mx.array] = {}
    shard_keys: List[List[str]] = []  # the keys of each shard written so far
    size = 0

    def flush():
        nonlocal shard, size
        if shard:
            mx.save_safetensors(str(out / f"shard-{len(shard_keys)}.safetensors"), shard, metadata={"format": "mlx"})
            shard_keys.append(list(shard))
        shard, size = {}, 0

    def add(name, array: np.ndarray, as_float: bool):
        nonlocal size
        a = mx.array(array).astype(mx_dtype) if as_float else mx.array(array)
        if size and size + a.nbytes > _SHARD_BYTES:
            flush()
        shard[name] = a
        size += a.nbytes

    for t in reader.tensors:
        hf = _hf_name(t.name, arch)
        qtype = t.tensor_type.name
        if hf is None:
            continue
        shape = tuple(int(s) for s in reversed(t.shape))  # numpy order: (out, in)
        permute_heads = next((n for part, n in permuted.items() if part in hf), None) if arch == "llama" else None
        module = hf.rsplit(".", 1)[0]
        if not dequantize and qtype in _EXACT_QUANT and _is_quantizable(hf, shape):
            w, s, b = _pack_exact(t.data, qtype, *shape)
            if permute_heads:
                w, s, b = (_unpermute_rows(x, permute_heads) for x in (w, s, b))
            add(f"{module}.weight", w, False)
            add(f"{module}.scales", s, True)
            add(f"{module}.biases", b, True)
            quant[module] = {"group_size": _GROUP, "bits": _EXACT_QUANT[qtype], "mode": "affine"}
            continue
        w = np.asarray(t.data) if qtype in ("F32", "F16") else gguf.quants.dequantize(t.data, t.tensor_type)
        w = w.reshape(shape).astype(np.float32)
        if permute_heads:
            w = _unpermute_rows(w, permute_heads)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scale; mlx-lm adds the 1 itself
        add(hf, w, True)
        if not dequantize and _is_quantizable(hf, shape):
            quant[module] = False
    flush()
    n = len(shard_keys)
    index = {"metadata": {}, "weight_map": {}}
    for i, keys in enumerate(shard_keys):
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / f"shard-{i}.safetensors", out / name)
        index["weight_map"].update(dict.fromkeys(keys, name))
    if n > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    bits = Counter(q["bits"] for q in quant.values() if q)
    if not bits:
        return None, types
    return {"group_size": _GROUP, "bits": bits.most_common(1)[0][0], "mode": "affine", **quant}, types


# How text is split before BPE, by `tokenizer.ggml.pre`
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}DIGITS"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT, _QWEN2_SPLIT = _SPLIT.replace("DIGITS", "{1,3}"), _SPLIT.replace("DIGITS", "")  # digits by 3, by 1
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_SPACE = "\u2581"  # sentencepiece's visible space


def build_tokenizer(meta: dict):
    """The `tokenizers.Tokenizer` transformers' tokenizer class for the model builds from GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors
    kind = meta.get("tokenizer.ggml.model")
    spelled: List[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(spelled))
    gemma = kind == "llama" and meta.get("general.architecture") in _GEMMA_ARCHS
    # Gemma files spell runs of spaces as spaces, its tokenizer (as normalized text) with "\u2581"
    tokens = [_SPACE * len(t) if gemma and " " in t and not t.strip() else t for t in spelled]
    vocab: Dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # the first id of a repeated token wins
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]

    if kind == "gpt2":  # byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM
        pre = meta.get("tokenizer.ggml.pre", "default")
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3")))
        if pre in _SPLITS:
            split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        else:  # "smollm" too: its declared class, GPT2Tokenizer, rebuilds it without the file's digit split
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("qwen2", "deepseek-r1-qwen"):  # as transformers' Qwen2Tokenizer (its GGUF path drops it)
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":  # sentencepiece BPE with byte fallback: Llama 2, TinyLlama, Gemma
        if not merges:  # Gemma's scores do not follow its merge order; the order of its tokens does
            merges = _merges_from_scores(vocab, None if gemma else meta.get("tokenizer.ggml.scores"))
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
        norm = [normalizers.Replace(" ", _SPACE)]
        dec = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            norm.insert(0, normalizers.Prepend(_SPACE))
            dec.append(decoders.Strip(" ", 1, 0))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence(dec)
    else:
        raise GGUFConversionError(f"tokenizer model {kind!r} in GGUF metadata is not supported (gpt2 and llama are)")

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and vocab.get(t) is not None])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, s, ty in zip(tokens, spelled, types) if ty == _USER_DEFINED and t == s])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if add_bos and bos_id is not None:
        bos = tokens[int(bos_id)]
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        specials.append((bos, int(bos_id)))
    if add_eos and eos_id is not None:
        eos = tokens[int(eos_id)]
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        specials.append((eos, int(eos_id)))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _merges_from_scores(vocab: Dict[str, int], scores) -> List[Tuple[str, str]]:
    """Every split of a token into two known tokens, ranked as transformers ranks them: by the merged
    token's score (else its id), then the longer left, then the longer right part."""
    ranked = []
    for tok, i in vocab.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]) if scores is not None else i, -cut, cut - len(tok), i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _write_tokenizer(meta: dict, config: dict, out: Path) -> None:
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else None

    kind = meta.get("tokenizer.ggml.model")
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos_token_id"),
                  "eos_token": token("eos_token_id"), "unk_token": token("unknown_token_id"),
                  "pad_token": token("padding_token_id"),
                  "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
                  "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                  "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"]}
    if meta.get("tokenizer.chat_template"):
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    special_map = {k: tok_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if tok_config[k] is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    if "eos_token_id" in config:
        gen = {k: config[k] for k in ("eos_token_id", "bos_token_id") if k in config}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move the files into place, config.json last: a directory with one is complete."""
    with contextlib.suppress(OSError):
        return os.rename(tmp, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model*.safetensors*"):
        if not (tmp / old.name).exists():
            old.unlink()
    for f in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(f, out_dir / f.name)
