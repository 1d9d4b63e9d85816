"""Multi-token-prediction heads: the model's own (or a trained sidecar), rebuilt from checkpoints.

Two checkpoint layouts carry them:
- Qwen3-Next / Qwen3.5: `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`,
  `mtp.layers.{i}.*` (decoder layers of the model's own kind), `mtp.norm`; lm_head shared.
- DeepSeek-V3 / GLM-4.5 NextN: layer `model.layers.{N}` after the N trunk layers, with `enorm`,
  `hnorm`, `eh_proj`, a decoder block, `shared_head.norm`, `shared_head.head`.
Sidecar heads from `mtplx-batch train-head` use the NextN layout with the trunk's own block.

Both compute: x = fc([norm_e(embed(t+1)), norm_h(h_t)]); x = block(x); h' = norm(x);
logits = head(h'). Drafting depth k feeds (h', draft) back into the same head.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from .loading import ModelBundle

SIDECAR_META = "mtp_head.json"
SIDECAR_WEIGHTS = "mtp_head.safetensors"


def trunk_hidden(model, tokens: mx.array, cache) -> mx.array:
    """The trunk's final (normed) hidden states, without projecting to the vocabulary."""
    return model.model(tokens, cache=cache)


def project_logits(model, hidden: mx.array) -> mx.array:
    if hasattr(model, "lm_head"):
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def has_trunk_split(model) -> bool:
    """Whether the model exposes `model.model` (hidden states) and a separable output head."""
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "embed_tokens") and (
        hasattr(model, "lm_head") or hasattr(inner.embed_tokens, "as_linear")
    )


def make_block(model, index: int) -> nn.Module:
    """A fresh decoder block of the trunk's own kind, built as if it were layer `index`."""
    layers = model.layers
    full = [l for l in layers if not getattr(l, "is_linear", False)] or layers
    cls = type(full[-1])
    params = inspect.signature(cls.__init__).parameters
    args = model.args
    if "layer_idx" in params:
        if getattr(args, "model_type", "") == "qwen3_next":
            index = args.full_attention_interval - 1  # an index whose layer is full attention
        return cls(args, index)
    return cls(args)


class MTPHead(nn.Module):
    def __init__(self, model, n_layers: int = 1, own_head: bool = False, block_index: Optional[int] = None):
        super().__init__()
        args = model.args
        dim = args.hidden_size
        eps = getattr(args, "rms_norm_eps", 1e-6)
        self.norm_embedding = nn.RMSNorm(dim, eps=eps)
        self.norm_hidden = nn.RMSNorm(dim, eps=eps)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        idx = len(model.layers) - 1 if block_index is None else block_index
        self.layers = [make_block(model, idx) for _ in range(n_layers)]
        self.norm = nn.RMSNorm(dim, eps=eps)
        if own_head:
            self.head = nn.Linear(dim, args.vocab_size, bias=False)
        # The trunk's embedding and head are shared, not owned: keep them out of parameters().
        self._trunk = [model]

    def embed(self, tokens):
        return self._trunk[0].model.embed_tokens(tokens)

    def logits(self, h):
        return self.head(h) if "head" in self else project_logits(self._trunk[0], h)

    def __call__(self, hidden: mx.array, tokens: mx.array, caches=None, mask=None):
        h = self.hidden(hidden, tokens, caches, mask)
        return h, self.logits(h)

    def hidden(self, hidden: mx.array, tokens: mx.array, caches=None, mask=None) -> mx.array:
        """The head's output hidden state h' alone (drafting projects only the positions it needs)."""
        e = self.norm_embedding(self.embed(tokens))
        x = self.fc(mx.concatenate([e, self.norm_hidden(hidden)], axis=-1))
        caches = caches or [None] * len(self.layers)
        if mask is None and caches[0] is not None:  # rows have their own lengths: always mask
            mask = caches[0].make_mask(x.shape[1])
        for layer, c in zip(self.layers, caches):
            x = layer(x, mask, c)
        return self.norm(x)


def _split_layouts(weights: Dict[str, mx.array], config: dict):
    """(head-level weights by our names, block weights per layer by block-relative names)."""
    head, blocks, extra = {}, {}, {}
    if any(k.startswith("mtp.") for k in weights):
        names = {"pre_fc_norm_embedding": "norm_embedding", "pre_fc_norm_hidden": "norm_hidden", "fc": "fc", "norm": "norm"}
        for k, v in weights.items():
            rest = k[len("mtp."):]
            if rest.startswith("layers."):
                _, i, sub = rest.split(".", 2)
                blocks.setdefault(int(i), {})[sub] = v
            else:
                mod, param = rest.split(".", 1)
                if mod not in names:
                    raise ValueError(f"unknown MTP weight {k!r}")
                head[f"{names[mod]}.{param}"] = v
        return head, blocks, extra
    n = config["num_hidden_layers"]
    # A sidecar head with several blocks keeps block i at model.layers.{N+i} (block keys only).
    sidecar_blocks = int(config.get("mtp_sidecar_blocks", 1))
    names = {"enorm": "norm_embedding", "hnorm": "norm_hidden", "eh_proj": "fc", "shared_head.norm": "norm", "shared_head.head": "head"}
    for k, v in weights.items():
        _, _, i, rest = k.split(".", 3)
        depth = int(i) - n
        if 0 < depth < sidecar_blocks:
            blocks.setdefault(depth, {})[rest] = v
            continue
        if depth != 0:
            continue  # deeper NextN modules: drafting recurses on the first one
        for src, dst in names.items():
            if rest.startswith(src + "."):
                head[f"{dst}.{rest[len(src) + 1:]}"] = v
                break
        else:
            if rest.startswith("embed_tokens."):
                extra[rest] = v
            else:
                blocks.setdefault(0, {})[rest] = v
    return head, blocks, extra


def build_head(bundle: ModelBundle, weights: Dict[str, mx.array], config: Optional[dict] = None) -> MTPHead:
    model, config = bundle.model, config or bundle.config
    head_w, blocks, _ = _split_layouts(weights, config)
    if not blocks:
        raise ValueError("MTP weights hold no decoder layer")
    trunk_idx = len(model.layers) - 1
    head = MTPHead(model, n_layers=len(blocks), own_head=any(k.startswith("head.") for k in head_w))
    # Run block weights through the trunk's own sanitize (expert stacking, norm offsets, ...).
    params = dict(head_w)
    for i, block in sorted(blocks.items()):
        as_trunk = {f"model.layers.{trunk_idx}.{k}": v for k, v in block.items()}
        clean = model.sanitize(as_trunk) if hasattr(model, "sanitize") else as_trunk
        prefix = f"model.layers.{trunk_idx}."
        for k, v in clean.items():
            params[f"layers.{i}.{k[len(prefix):]}"] = v
    if bundle.model_type == "qwen3_next" and _norms_offset(model, blocks):
        for k in ("norm_embedding.weight", "norm_hidden.weight", "norm.weight"):
            if k in params:
                params[k] = params[k] + 1.0
    head.load_weights(list(params.items()), strict=True)
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        head.set_dtype(norm.weight.dtype)  # a bf16 sidecar on an fp32 trunk runs in fp32 (and back)
    head.eval()
    mx.eval(head.parameters())
    return head


def _norms_offset(model, blocks) -> bool:
    """mlx-lm adds 1 to Qwen3-Next norms only for MoE checkpoints; do the same for the head's."""
    return any(k.endswith("mlp.experts.0.up_proj.weight") for b in blocks.values() for k in b)


def load_head(bundle: ModelBundle, sidecar: Optional[str] = None) -> MTPHead:
    """The model's own MTP head, or the sidecar at `sidecar` (refusing a mismatched trunk)."""
    if sidecar is None:
        if not bundle.mtp_weights:
            raise ValueError(
                f"model {bundle.path} ships no multi-token-prediction weights: use speculative.method "
                "ngram or draft, or train a head with `mtplx-batch train-head` and set speculative.mtp_head"
            )
        return build_head(bundle, bundle.mtp_weights)
    path = Path(sidecar)
    meta = json.loads((path / SIDECAR_META).read_text())
    check_sidecar_trunk(meta, bundle)
    weights = mx.load(str(path / SIDECAR_WEIGHTS))
    config = dict(bundle.config, num_hidden_layers=meta["num_hidden_layers"],
                  mtp_sidecar_blocks=meta.get("depth_layers", 1))
    return build_head(bundle, weights, config)


def trunk_signature(bundle: ModelBundle) -> dict:
    cfg = bundle.config
    return {
        "model_type": cfg.get("model_type"),
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
    }


PROBE_TOKENS = 16  # token ids whose embeddings fingerprint a trunk's weights
PROBE_DIMS = 32


def trunk_probe(bundle: ModelBundle) -> list:
    """A few embedding values (dequantized, rounded): same-shaped trunks with other weights differ."""
    emb = bundle.model.model.embed_tokens
    vocab = int(bundle.config.get("vocab_size") or emb.weight.shape[0])
    ids = mx.array([(i * 7919 + 13) % vocab for i in range(PROBE_TOKENS)], dtype=mx.int32)
    vals = emb(ids)[:, :PROBE_DIMS].astype(mx.float32)
    return [round(float(x), 5) for x in vals.reshape(-1).tolist()]


def _probe_matches(want: list, have: list) -> bool:
    """Correlation, so a quantized or re-cast copy of the same trunk still matches."""
    import numpy as np

    a, b = np.asarray(want, dtype=np.float64), np.asarray(have, dtype=np.float64)
    if a.shape != b.shape or not a.size:
        return False
    a, b = a - a.mean(), b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return bool(denom > 0 and (a * b).sum() / denom > 0.9)


def check_sidecar_trunk(meta: dict, bundle: ModelBundle):
    want, have = meta.get("trunk", {}), trunk_signature(bundle)
    diff = {k: (want.get(k), have[k]) for k in have if want.get(k) != have[k]}
    if diff:
        details = ", ".join(f"{k}: head {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"MTP head was trained for a different trunk ({details}); train one for this model")
    if meta.get("trunk_probe") is not None and not _probe_matches(meta["trunk_probe"], trunk_probe(bundle)):
        raise ValueError(
            f"MTP head was trained for a different trunk (same shape, other weights: its embedding "
            f"fingerprint does not match {bundle.path}); train one for this model with `mtplx-batch train-head`"
        )
