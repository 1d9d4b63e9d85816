"""The progress bars of `run` on a terminal, drawn from the run's Progress (pipelines/execution/progress.py).

Two bars, both counted in rows (one row = one (input row, sample) generation):
    prefill   rows handed to the engine; the engine prefills a row as it takes it, so this bar
              runs ahead of decode by about one batch. Postfix: prompt tokens prefilled and
              their rate while prefilling, live while a long prompt is prefilled span by span.
    decode    rows finished. Postfix, live from the first decode round: generated tokens,
              tokens/s, while the engine builds a compiled program "building kernels" (its first call: on
              a machine's first run seconds each), acceptance, tokens per verify, and the ETA. Its last tokens/s is the
              summary line's and `status`'s (the figures are Progress's, pipelines/io/figures.py).
"""

from __future__ import annotations

from typing import Optional

from ..execution.progress import Progress

REFRESH_EVERY = 0.5  # seconds between bar redraws on engine events


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def terminal_bars(progress: Progress) -> Optional["Bars"]:
    """Bars on the progress's stream when it is a terminal, else None (nothing is drawn)."""
    return Bars(progress) if getattr(progress.stream, "isatty", lambda: False)() else None


class Bars:
    """The prefill and decode bars (tqdm) of one session; `Progress` tells them of every change."""

    def __init__(self, progress: Progress):
        from tqdm import tqdm

        self.progress = progress
        total, initial = progress.total, progress.initial
        common = dict(total=total, initial=initial, unit="row", dynamic_ncols=True,
                      file=progress.stream, smoothing=0.05, mininterval=0.5)
        # bar_format without tqdm's own row-based remaining time: the postfix carries the ETA
        fmt = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
        if total is None:
            fmt = "{desc}: {n_fmt} rows [{elapsed}{postfix}]"
        self.prefill = tqdm(desc="prefill", position=0, bar_format=fmt, **common)
        self.decode = tqdm(desc="decode ", position=1, bar_format=fmt, **common)
        self._last_refresh = 0.0

    def prefill_postfix(self) -> str:
        p = self.progress
        if not p.prefilled:  # the engine does not report its prefill (a Ray actor's)
            return f"{p.prompt_tokens_in} prompt tokens"
        return f"{p.prefilled} prompt tokens, {p.prefill_tokens_per_second():.0f} prompt tok/s"

    def postfix(self) -> str:
        p = self.progress
        parts = [f"{p.generated_tokens} tok", f"{p.tokens_per_second():.1f} tok/s"]
        if p.building:  # a first call of a compiled program: on a machine's first run, seconds of kernel builds
            parts.append("building kernels (first run on this machine: programs' first calls)")
        if p.drafted:
            parts.append(f"acc {p.accepted / p.drafted:.0%}")
            parts.append(f"{p.tokens_per_verify:.2f} tok/verify")
        if p.errors:
            parts.append(f"{p.errors} err")
        parts.append(f"ETA {format_duration(p.eta_seconds())}")
        return ", ".join(parts)

    def submitted(self) -> None:
        self.prefill.set_postfix_str(self.prefill_postfix(), refresh=False)
        self.prefill.update(1)

    def finished(self, via_engine: bool) -> None:
        if not via_engine:  # keep the prefill bar in step
            self.prefill.update(1)
        self.decode.set_postfix_str(self.postfix(), refresh=False)
        self.decode.update(1)

    def engine_event(self, now: float, first_round: bool) -> None:
        """Tokens prefilled or generated: redraw both postfixes, at most every REFRESH_EVERY seconds."""
        if first_round or now - self._last_refresh >= REFRESH_EVERY:
            self._last_refresh = now
            self.prefill.set_postfix_str(self.prefill_postfix(), refresh=False)
            self.prefill.refresh()
            self.decode.set_postfix_str(self.postfix(), refresh=False)
            self.decode.refresh()

    def close(self) -> None:
        """The last postfix has the session's committed figures (Progress closed)."""
        self.decode.set_postfix_str(self.postfix(), refresh=False)
        self.prefill.close()
        self.decode.close()
