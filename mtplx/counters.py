"""What the engine counts as it runs (`Engine.counters`): benchmarks and tests read these numbers."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Optional


@dataclass
class Counters:
    rounds: int = 0  # decode rounds landed
    host_reads: int = 0  # decode rounds read from the device (one each)
    admissions: int = 0  # prefill passes that admitted rows
    prefill_tokens: int = 0  # prompt tokens prefilled
    cached_prompt_tokens: int = 0  # prompt tokens copied from a shared prefix instead
    programs_built: int = 0  # compiled programs: the verify bank's and the drafter's
    first_call_seconds: float = 0.0  # wall seconds of those programs' first calls, build included
    prefill_seconds: float = 0.0  # host seconds spent in each phase
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    # called as a program's first call starts (its build: seconds, and on a fresh GPU host far more)
    on_build: Optional[Callable[[], None]] = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "on_build"}
