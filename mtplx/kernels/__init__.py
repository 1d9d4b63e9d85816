"""Device code: CUDA kernels and the model transforms that route decoding through them, each keeping
the values of the ops it replaces. The core imports only `device`; `install` and `install_head`
change nothing off CUDA."""

from __future__ import annotations


def install(model, compiled: bool, layers: bool = True) -> dict:
    """The CUDA decode paths on `model` (layer_kernels with `layers`); how many of each."""
    from . import fusion, layer_kernels, rows_attention
    return {"rows_attention": rows_attention.install(model),
            "stacked_projections": fusion.fuse_projections(model) if compiled and fusion.stacking_pays() else 0,
            "layer_kernels": layer_kernels.install(model) if layers else 0}


def install_head(head, vocab, compiled: bool) -> dict:
    """The MTP head's few-row products as vector products, then stacked (`vocab`: a DraftVocab or None)."""
    from . import fusion
    if not (compiled and fusion.stacking_pays()):
        return {}
    return {"head_gemv": fusion.head_gemv(head, vocab), "head_stacked_projections": fusion.fuse_projections(head)}
