"""Multi-token-prediction heads: the model's own or a trained sidecar, rebuilt from checkpoints
(layouts: mtp_layouts.py; a head `mtplx-batch convert` wrote built: convert.py).

A module computes h' = norm(block(fc([norm_e(embed(t+1)), norm_h(h_t)]))), logits = head(h'). Depth k
feeds (h', draft) back into the same module (MTPHead) or module k of one per depth (MTPHeadStack)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..cache import RowCacheList, RowKVCache, layer_kinds
from .loading import ModelBundle, load_config, tensor_index
from .mtp_layouts import (ZERO_CENTRED_BLOCK_NORMS, ZERO_CENTRED_HEAD_NORMS, ModuleWeights, is_mtp_key, split_modules,
                          text_config)

SIDECAR_META = "mtp_head.json"  # a sidecar from `mtplx-batch train-head`
SIDECAR_WEIGHTS = "mtp_head.safetensors"
HEAD_META = "mtplx_head.json"  # a head `mtplx-batch convert` wrote already built
HEAD_WEIGHTS = "mtplx_head.safetensors"


def text_model(model) -> nn.Module:
    """The module holding `args`, `model` and `lm_head` (a multimodal wrapper's `language_model`)."""
    return getattr(model, "language_model", model)


def trunk_hidden(model, tokens: mx.array, cache) -> mx.array:  # the final (normed) hidden states
    return text_model(model).model(tokens, cache=cache)


def project_logits(model, hidden: mx.array) -> mx.array:
    lm = text_model(model)
    return lm.lm_head(hidden) if hasattr(lm, "lm_head") else lm.model.embed_tokens.as_linear(hidden)


def has_trunk_split(model) -> bool:
    lm = text_model(model)
    inner = getattr(lm, "model", None)
    return inner is not None and hasattr(inner, "embed_tokens") and (
        hasattr(lm, "lm_head") or hasattr(inner.embed_tokens, "as_linear"))


def _attention_layer_index(model) -> int:
    """The trunk's last full-attention layer (MTP layers are full attention)."""
    full = [i for i, l in enumerate(model.layers) if not getattr(l, "is_linear", False)]
    return full[-1] if full else len(model.layers) - 1


def _leaves(cache) -> list:
    return list(getattr(cache, "caches", [cache]))


def make_block(model) -> nn.Module:
    full = _attention_layer_index(model)
    cls = type(model.layers[full])
    args = text_model(model).args
    return cls(args, full) if "layer_idx" in inspect.signature(cls.__init__).parameters else cls(args)


class MTPHead(nn.Module):
    def __init__(self, model, n_layers: int = 1, own_head: bool = False, hidden_first: bool = False,
                 zero_first: bool = False):
        super().__init__()
        args = text_model(model).args
        dim = args.hidden_size
        eps = getattr(args, "rms_norm_eps", 1e-6)
        self.norm_embedding = nn.RMSNorm(dim, eps=eps)
        self.norm_hidden = nn.RMSNorm(dim, eps=eps)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.layers = [make_block(model) for _ in range(n_layers)]
        # each block's cache is its trunk twin's kind (a pair of KV caches for DeepSeek-V3.2)
        self._cache_kinds = [layer_kinds(model)[_attention_layer_index(model)]] * n_layers
        self.norm = nn.RMSNorm(dim, eps=eps)
        if own_head:
            self.head = nn.Linear(dim, args.vocab_size, bias=False)
        self.hidden_first = hidden_first  # fc over [hidden, embedding] (MiMo)
        self.zero_first = zero_first  # no embedding at position 0 (NextN, MiMo)
        self._trunk = [model]  # shared embedding and head: not parameters

    @property
    def cache_kinds(self) -> list:
        return list(self._cache_kinds)

    def embed(self, tokens):
        return text_model(self._trunk[0]).model.embed_tokens(tokens)

    def logits(self, h, step: int = 0):
        return self.head(h) if "head" in self else project_logits(self._trunk[0], h)

    def __call__(self, hidden: mx.array, tokens: mx.array, caches=None, mask=None):
        h = self.hidden(hidden, tokens, caches, mask)
        return h, self.logits(h)

    def hidden(self, hidden: mx.array, tokens: mx.array, caches=None, mask=None, step=None) -> mx.array:
        """h' alone (drafting projects only the positions it needs); `step`: the draft depth."""
        e = self.embed(tokens)
        if self.zero_first:
            pos = mx.arange(e.shape[1], dtype=mx.int32)[None]
            if caches and caches[0] is not None:
                pos = _leaves(caches[0])[0].rows.device[:, None] + pos
            e = mx.where((pos == 0)[..., None], mx.zeros_like(e), e)
        e = self.norm_embedding(e.astype(self.norm_embedding.weight.dtype))  # a bfloat16 head over a float16 trunk
        parts = [self.norm_hidden(hidden), e] if self.hidden_first else [e, self.norm_hidden(hidden)]
        return self._blocks(self.fc(mx.concatenate(parts, axis=-1)), caches, mask)

    def _blocks(self, x: mx.array, caches, mask) -> mx.array:
        caches = caches or [None] * len(self.layers)
        if mask is None and caches[0] is not None:  # rows have their own lengths
            mask = _leaves(caches[0])[0].make_mask(x.shape[1], return_array=True)
        for layer, c in zip(self.layers, caches):
            x = layer(x, mask, c)
        return self.norm(x)

    def fc_split(self, tokens: mx.array) -> Optional[Tuple[mx.array, mx.array]]:
        """fc split in two (DraftVocab.step_table): the tokens' embeddings' share of its output, and its
        hidden-state half [D, D]; None for a quantized or biased fc (fusion.RowsLinear is one)."""
        if not isinstance(self.fc, nn.Linear) or "bias" in self.fc:
            return None
        D = self.fc.weight.shape[1] // 2
        w = self.fc.weight
        w_embed, w_hidden = (w[:, D:], w[:, :D]) if self.hidden_first else (w[:, :D], w[:, D:])
        share = self.norm_embedding(self.embed(tokens).astype(self.norm_embedding.weight.dtype)) @ w_embed.T
        return share, mx.contiguous(w_hidden)

    def hidden_after(self, hidden: mx.array, share: mx.array, w_hidden: mx.array, caches=None, mask=None) -> mx.array:
        """`hidden(hidden, tokens, ...)` from the tokens' share and fc's hidden-state half (`fc_split`)."""
        return self._blocks(share + self.norm_hidden(hidden) @ w_hidden.T, caches, mask)


class _ShiftedRows:
    """A module's view of the draft cache's per-row lengths, `shift` entries back."""

    def __init__(self, rows, shift: int):
        self.device = rows.device - shift
        self.host = None if rows.host is None else rows.host - shift
        self.shared = None if getattr(rows, "shared", None) is None else rows.shared - shift

    @property
    def max(self) -> int:
        return int(self.host.max()) if self.host is not None and self.host.size else 0

    def positions(self, L: int) -> mx.array:  # as RowLengths'
        return (self.device[:, None] + mx.arange(L, dtype=mx.int32))[:, None, :, None]

    def resident(self) -> mx.array:
        return self.device


def _run_shifted(module, hidden, tokens, caches, shift: int):
    """Run `module` on KV caches whose rows look `shift` entries shorter (it writes there)."""
    pairs = []

    def view(c):
        v = RowKVCache(_ShiftedRows(c.rows, shift))
        v.keys, v.values, v.attend_len = c.keys, c.values, c.attend_len
        pairs.append((c, v))
        return v

    views = [RowCacheList([view(x) for x in c.caches]) if hasattr(c, "caches") else view(c) for c in caches]
    out = module.hidden(hidden, tokens, views)
    for c, v in pairs:
        c.keys, c.values = v.keys, v.values
    return out


class MTPHeadStack(nn.Module):
    """One MTP module per draft depth (the last drafts every deeper one). Prefill and commit run them all
    (`step=None`); module k joined the round at step k, so it sees the rows k-1 entries shorter."""

    def __init__(self, modules: List[MTPHead]):
        super().__init__()
        self.depths = modules

    @property
    def layers(self):
        return [b for m in self.depths for b in m.layers]

    @property
    def cache_kinds(self):
        return [k for m in self.depths for k in m.cache_kinds]

    @property
    def fc(self):
        return self.depths[0].fc

    @property
    def norm(self):
        return self.depths[0].norm

    def _caches(self, caches, k):
        start = sum(len(m.layers) for m in self.depths[:k])
        return caches[start : start + len(self.depths[k].layers)]

    def logits(self, h, step: int = 0):
        return self.depths[min(step, len(self.depths) - 1)].logits(h)

    __call__ = MTPHead.__call__  # (h', logits) of module 0, as MTPHead's

    def hidden(self, hidden, tokens, caches=None, mask=None, step=None):
        if caches is None:
            return self.depths[min(step or 0, len(self.depths) - 1)].hidden(hidden, tokens, None, mask)
        if step is None:
            return [m.hidden(hidden, tokens, self._caches(caches, k), mask) for k, m in enumerate(self.depths)][0]
        k = min(step, len(self.depths) - 1)
        return _run_shifted(self.depths[k], hidden, tokens, self._caches(caches, k), max(k - 1, 0))


def _block_params(model, block: Dict[str, mx.array], zero_centred: bool) -> Dict[str, mx.array]:
    """One block's weights through the trunk's own sanitize, as its last full-attention layer's."""
    marker = f"layers.{_attention_layer_index(model)}."
    as_trunk = {f"model.{marker}{k}": v for k, v in block.items()}
    clean = model.sanitize(as_trunk) if hasattr(model, "sanitize") else as_trunk
    out = _stack_experts({k[k.index(marker) + len(marker):]: v for k, v in clean.items() if marker in k})
    if zero_centred:
        out = {k: v + 1.0 if v.ndim == 1 and ("." + k).endswith(ZERO_CENTRED_BLOCK_NORMS) else v
               for k, v in out.items()}
    return out


def _stack_experts(block: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Stack per-expert MoE weights a sanitize left alone (some MTP layers store experts one by one)."""
    for n in ("gate_proj", "up_proj", "down_proj"):
        count = next(e for e in range(len(block) + 1) if f"mlp.experts.{e}.{n}.weight" not in block)
        if count:
            block[f"mlp.switch_mlp.{n}.weight"] = mx.stack([block.pop(f"mlp.experts.{e}.{n}.weight")
                                                           for e in range(count)])
    return block


def _zero_centred(bundle: ModelBundle, modules: List[ModuleWeights]) -> Tuple[bool, bool]:
    """(shift the head's norms, shift its blocks' norms) by +1, as mlx-lm does the trunk's: Qwen3-Next
    shifts MoE checkpoints (its sanitize the blocks'); Qwen3.5 those in the HF layout (conv1d [C, 1, K])."""
    kind = bundle.model_type
    if kind == "qwen3_next":
        moe = any(k.endswith("mlp.experts.0.up_proj.weight") for m in modules for b in m.blocks.values() for k in b)
        return moe, False
    if kind in ("qwen3_5", "qwen3_5_moe"):
        hf = any(k.endswith("conv1d.weight") and s[-1] != 1 for k, s in bundle.shapes.items())
        return hf, hf
    return False, False


def _build_module(bundle: ModelBundle, mod: ModuleWeights, shift: Tuple[bool, bool]) -> MTPHead:
    model = bundle.model
    if not mod.blocks:
        raise ValueError("MTP weights hold no decoder layer")
    head = MTPHead(model, n_layers=len(mod.blocks), own_head=any(k.startswith("head.") for k in mod.head),
                   hidden_first=mod.hidden_first, zero_first=mod.zero_first)
    params = dict(mod.head)
    if shift[0]:
        params = {k: v + 1.0 if k in ZERO_CENTRED_HEAD_NORMS else v for k, v in params.items()}
    for i, block in sorted(mod.blocks.items()):
        params.update({f"layers.{i}.{k}": v for k, v in _block_params(model, block, shift[1]).items()})
    head.load_weights(list(params.items()), strict=True)
    return _ready(head, model)


def _ready(head, model):
    norm = getattr(text_model(model).model, "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        head.set_dtype(norm.weight.dtype)
    head.eval()
    mx.eval(head.parameters())
    return head


def build_head(bundle: ModelBundle, weights: Dict[str, mx.array], config: Optional[dict] = None):
    modules = split_modules(weights, config or bundle.config)
    if not modules:
        raise ValueError("MTP weights hold no MTP module")
    shift = _zero_centred(bundle, modules)
    built = [_build_module(bundle, m, shift) for m in modules]
    return built[0] if len(built) == 1 else MTPHeadStack(built)


def load_built_head(bundle: ModelBundle):
    meta = json.loads((bundle.path / HEAD_META).read_text())
    if meta.get("format") != 1:
        raise ValueError(f"{bundle.path / HEAD_META}: unknown head format {meta.get('format')!r}; "
                         "convert the checkpoint again with this version of `mtplx-batch convert`")
    weights = mx.load(str(bundle.path / HEAD_WEIGHTS))
    modules = [MTPHead(bundle.model, n_layers=m["layers"], own_head=m["own_head"], hidden_first=m["hidden_first"],
                       zero_first=m.get("zero_first", False)) for m in meta["modules"]]
    head = MTPHeadStack(modules) if meta["stack"] else modules[0]
    quant = meta.get("quantization")
    if quant:
        overrides = quant.get("overrides", {})
        nn.quantize(head, quant["group_size"], quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights and overrides.get(p, True))
    head.load_weights(list(weights.items()), strict=True)
    return _ready(head, bundle.model)


def no_head_message(path) -> str:
    return (f"model {path} ships no multi-token-prediction weights (none of the layouts in docs/models.md: "
            "mtp.*, model.mtp_layers.*, NextN layers after the trunk, or a head from `mtplx-batch convert`): "
            "use speculative.method ngram (prompt lookup, no extra weights) or draft, or train a head with "
            "`mtplx-batch train-head` and set speculative.mtp_head")


def check_native_head(model_dir) -> None:
    """Refuse, from the file headers alone, a model directory without an MTP head."""
    path = Path(model_dir)
    if (path / HEAD_META).exists():
        return
    config = load_config(path)
    if not any(is_mtp_key(k, config) for k in tensor_index(path)):
        raise ValueError(no_head_message(path))


def load_head(bundle: ModelBundle, sidecar: Optional[str] = None) -> MTPHead:
    """The model's own MTP head, or the sidecar at `sidecar` (refusing a mismatched trunk)."""
    if sidecar is None:
        if (bundle.path / HEAD_META).exists():
            return load_built_head(bundle)
        if not bundle.mtp_weights:
            raise ValueError(no_head_message(bundle.path))
        return build_head(bundle, bundle.mtp_weights)
    path = Path(sidecar)
    meta = json.loads((path / SIDECAR_META).read_text())
    _check_trunk_shape(meta, bundle.config)
    if meta.get("trunk_probe") is not None and not _probe_matches(meta["trunk_probe"], trunk_probe(bundle)):
        raise ValueError(f"MTP head was trained for a different trunk (same shape, other weights: its embedding "
                         f"fingerprint does not match {bundle.path}); train one for this model with "
                         "`mtplx-batch train-head`")
    config = dict(bundle.config, num_hidden_layers=meta["num_hidden_layers"],
                  mtp_sidecar_blocks=meta.get("depth_layers", 1))
    return build_head(bundle, mx.load(str(path / SIDECAR_WEIGHTS)), config)


def trunk_signature(config: dict) -> dict:
    """The trunk shape a sidecar head is trained for, from the model's config."""
    cfg = text_config(config)
    return {k: cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}


PROBE_TOKENS = 16  # token ids whose embeddings fingerprint a trunk's weights
PROBE_DIMS = 32


def trunk_probe(bundle: ModelBundle) -> list:
    """A few embedding values: tells same-shaped trunks with other weights apart."""
    emb = text_model(bundle.model).model.embed_tokens
    vocab = int(text_config(bundle.config).get("vocab_size") or emb.weight.shape[0])
    ids = mx.array([(i * 7919 + 13) % vocab for i in range(PROBE_TOKENS)], dtype=mx.int32)
    vals = emb(ids)[:, :PROBE_DIMS].astype(mx.float32)
    return [round(float(x), 5) for x in vals.reshape(-1).tolist()]


def _probe_matches(want: list, have: list) -> bool:
    """By correlation, so a quantized or re-cast copy of the same trunk matches."""
    import numpy as np
    a, b = np.asarray(want, dtype=np.float64), np.asarray(have, dtype=np.float64)
    if a.shape != b.shape or not a.size:
        return False
    a, b = a - a.mean(), b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return bool(denom > 0 and (a * b).sum() / denom > 0.9)


def _check_trunk_shape(meta: dict, config: dict) -> None:
    want, have = meta.get("trunk", {}), trunk_signature(config)
    diff = {k: (want.get(k), have[k]) for k in have if want.get(k) != have[k]}
    if diff:
        details = ", ".join(f"{k}: head {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"MTP head was trained for a different trunk ({details}); train one for this model")


def check_sidecar(sidecar, config: dict) -> None:
    """Refuse, from files alone, a sidecar head directory that is incomplete or for another trunk shape."""
    path = Path(sidecar)
    missing = [name for name in (SIDECAR_META, SIDECAR_WEIGHTS) if not (path / name).is_file()]
    if missing:
        raise ValueError(f"{path} has no {' and no '.join(missing)}: not a head directory written by "
                         "`mtplx-batch train-head`")
    try:
        meta = json.loads((path / SIDECAR_META).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / SIDECAR_META} is unreadable ({e}); train the head again")
    _check_trunk_shape(meta, config)
