"""What the engine counts as it runs (`Engine.counters`): benchmarks and tests read these numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def as_dict(self) -> dict:
        return asdict(self)
