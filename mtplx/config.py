"""Engine settings. The job file's `speculative:` and `schedule:` sections load into these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

SPEC_METHODS = ("none", "mtp", "draft", "ngram")
VERIFY_MODES = ("off", "on", "parity", "parity2")


@dataclass
class SpeculativeConfig:
    method: str = "none"  # none | mtp | draft | ngram
    depth: int = 3  # drafted tokens per verify (the most; adaptive depth may use fewer)
    draft_model: Optional[str] = None  # path, for method: draft
    mtp_head: Optional[str] = None  # sidecar head dir from `mtplx-batch train-head`
    compiled_verify: str = "on"  # off | on | parity | parity2
    adaptive_depth: bool = True  # lower depth as the batch widens or acceptance falls
    ngram_size: int = 3  # longest suffix matched by prompt lookup

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.compiled_verify not in VERIFY_MODES:
            raise ValueError(
                f"speculative.compiled_verify must be one of {VERIFY_MODES}, got {self.compiled_verify!r}"
            )
        if not 1 <= int(self.depth) <= 16:
            raise ValueError(f"speculative.depth must be in 1..16, got {self.depth}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.method: draft needs speculative.draft_model (a model path)")


@dataclass
class ScheduleConfig:
    order: str = "prefix"  # prefix | length | input
    max_batch: Union[str, int] = 32  # rows decoded together, or auto: from the calibration (calibrate.py)
    prefill_chunk: Union[str, int] = "auto"  # tokens per prefill span; MTPLX_PREFILL_CHUNK_SIZE overrides
    memory_budget: Union[str, int] = "auto"  # bytes, or auto: a safe share of device memory
    calibration: Optional[str] = None  # a profile from `mtplx-batch calibrate`; default: beside the model

    def __post_init__(self):
        if self.order not in ("prefix", "length", "input"):
            raise ValueError(f"schedule.order must be prefix, length or input, got {self.order!r}")
        if self.max_batch != "auto" and int(self.max_batch) < 1:
            raise ValueError(f"schedule.max_batch must be >= 1, got {self.max_batch}")
