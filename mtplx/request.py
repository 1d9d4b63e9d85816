"""What the engine takes in and gives back, one request per (row, sample): all the pipeline sees of it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: Tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Request:
    """One generation: a tokenized prompt, its sampler, and its own seed. `key` is opaque to the engine;
    `stable_prefix_len` ends a prompt prefix shared with other rows (prefill splits there to reuse it)."""

    key: Any
    prompt_tokens: List[int]
    params: SamplingParams
    seed: int = 0
    stable_prefix_len: int = 0


@dataclass
class RowStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_chunks: int = 0
    verify_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_depth: List[int] = field(default_factory=list)
    compiled_verify_calls: int = 0
    eager_verify_calls: int = 0
    parity_failures: int = 0
    batch_width: int = 0
    draft_depth: int = 0
    decode_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_verify(self) -> Optional[float]:
        return tokens_per_verify(self.accepted_tokens, self.verify_calls)


def tokens_per_verify(accepted_tokens: int, verify_calls: int) -> Optional[float]:
    """Tokens committed per drafting verify, (accepted + verifies) / verifies, None without any: the one
    definition behind the `tokens_per_verify` column, `status`, `report` and progress."""
    return (accepted_tokens + verify_calls) / verify_calls if verify_calls else None


@dataclass
class Result:
    key: Any
    tokens: List[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    error: Optional[str] = None
    stats: RowStats = field(default_factory=RowStats)
    seed: int = 0


def derive_seed(job_seed: int, row_id: str, sample: int) -> int:
    """A row's sampling seed from (job seed, row id, sample): stable across runs and resumes."""
    digest = hashlib.sha256(f"{job_seed}\x00{row_id}\x00{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
