"""Engine settings: the job file's `speculative:` and `schedule:` sections.

MTPLX's three environment variables are read here and nowhere else: `MTPLX_PREFILL_CHUNK_SIZE`
(over `schedule.prefill_chunk`; 0: no chunking), `MTPLX_SUSTAINED_PREFILL_LAYOUT` (off: one span a
prompt) and `MTPLX_COMPILED_VERIFY_MAX_LEN` (where `speculative.verify_max_len` does not say)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from .checks import (BOOL_VERIFY, auto_or_bytes, auto_or_int, boolean, check_fields, integer, one_of, optional,
                     setting, string)

SPEC_METHODS = ("none", "mtp", "draft", "ngram")
VERIFY_MODES = ("off", "on", "parity", "parity2")
ORDERS = ("prefix", "length", "input")
# model.gguf_mode: auto (the faster here: floats on a CPU, exact quant types kept packed on a GPU)
GGUF_MODES = ("auto", "dequantize", "quantized")


def _env_int(name: str, lowest: int) -> Optional[int]:
    raw = os.environ.get(name)
    try:
        return None if raw is None else max(lowest, int(raw))
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def prefill_chunk_env() -> Optional[int]:
    return _env_int("MTPLX_PREFILL_CHUNK_SIZE", 0)


def verify_max_len_env() -> Optional[int]:
    return _env_int("MTPLX_COMPILED_VERIFY_MAX_LEN", 1)


def sustained_prefill_env() -> bool:
    """MTPLX_SUSTAINED_PREFILL_LAYOUT: on (default: chunk spans split at stable-prefix edges) or off."""
    raw = os.environ.get("MTPLX_SUSTAINED_PREFILL_LAYOUT", "on")
    value = raw.strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"MTPLX_SUSTAINED_PREFILL_LAYOUT must be on or off (1/0, true/false), got {raw!r}")
    return value in ("1", "true", "yes", "on")


@dataclass
class SpeculativeConfig:
    method: str = setting(one_of(*SPEC_METHODS, aliases={False: "none"}), "none")  # none | mtp | draft | ngram
    depth: int = setting(integer(1, 16), 3)  # drafted tokens per verify (the most; adaptive depth may use fewer)
    draft_model: Optional[str] = setting(optional(string), None)  # path, for method: draft
    mtp_head: Optional[str] = setting(optional(string), None)  # sidecar head dir from `mtplx-batch train-head`
    compiled_verify: str = setting(one_of(*VERIFY_MODES, aliases=BOOL_VERIFY), "on")  # off | on | parity | parity2
    # each round's depth, plain decoding (0) included, from the rows' acceptance and the measured costs
    adaptive_depth: bool = setting(boolean, True)
    ngram_size: int = setting(integer(1), 3)  # longest suffix matched by prompt lookup
    # method mtp: a row drafts by prompt lookup where a suffix of at least this many tokens recurs; 0: off
    mtp_lookup: int = setting(integer(0, 16), 3)
    # longest compiled verify; None: MTPLX_COMPILED_VERIFY_MAX_LEN, else max(8, depth + 1)
    verify_max_len: Optional[int] = setting(optional(integer(1)), None)

    def __post_init__(self):
        check_fields(self, "speculative")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.method: draft needs speculative.draft_model (a model path)")


@dataclass
class ScheduleConfig:
    order: str = setting(one_of(*ORDERS), "prefix")  # prefix | length | input
    max_batch: Union[str, int] = setting(auto_or_int, 32)  # rows decoded together, or auto (calibrate.py)
    prefill_chunk: Union[str, int] = setting(auto_or_int, "auto")  # tokens per prefill span, or auto
    memory_budget: Union[str, int] = setting(auto_or_bytes, "auto")  # bytes, or auto: a safe share of device memory
    calibration: Optional[str] = setting(optional(string), None)  # a calibrate profile; default: beside the model

    def __post_init__(self):
        check_fields(self, "schedule")
