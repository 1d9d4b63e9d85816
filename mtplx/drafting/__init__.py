"""Draft sources, one per `speculative.method`, behind one base class (base.Drafter): prompt lookup
on the host (ngram.py), a smaller model with the target's tokenizer (draft_model.py), the model's
MTP head with prompt lookup on the device beside it (mtp.py, over mtp_bank.py's drafting vocabulary
and compiled programs). A new draft method is one `Drafter` subclass and one line in `DRAFTERS`.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from ..config import SPEC_METHODS, SpeculativeConfig
from ..counters import Counters
from ..models.loading import ModelBundle
from . import draft_model, mtp
from .base import Drafter
from .ngram import NgramDrafter

# speculative.method -> the drafter for a job's settings, the target model, and the engine's counters
DRAFTERS: Dict[str, Callable[[SpeculativeConfig, ModelBundle, Counters], Drafter]] = {
    "ngram": lambda spec, bundle, counters: NgramDrafter(spec.ngram_size, counters),
    "draft": draft_model.load,
    "mtp": mtp.load,
}

if set(DRAFTERS) != set(SPEC_METHODS) - {"none"}:  # the job schema checks methods without loading this module
    raise ImportError(f"mtplx.config.SPEC_METHODS {SPEC_METHODS} and DRAFTERS {sorted(DRAFTERS)} disagree")


def make_drafter(spec: SpeculativeConfig, bundle: ModelBundle, counters: Optional[Counters] = None) -> Optional[Drafter]:
    """The drafter `spec.method` names; None for plain decoding (`none`)."""
    if spec.method == "none":
        return None
    if spec.method not in DRAFTERS:
        raise ValueError(f"unknown speculative method {spec.method!r}")
    return DRAFTERS[spec.method](spec, bundle, counters)
