"""`mtplx-batch calibrate`: measure this machine for a model (mtplx/calibrate.py).

Registered in `pipelines/cli/commands.py` beside train-head.
"""

from __future__ import annotations

import sys
from typing import Optional

import click

from .assets import gguf_mode_option

EPILOG = """\b
Examples:
  mtplx-batch calibrate smollm2-135m-instruct            # profile beside the converted model
  mtplx-batch calibrate models/qwen3-8b --widths 1,32,128,256 --depth 4
  mtplx-batch calibrate models/qwen3-8b --out profiles/h200.json
  # then, in a job:  schedule: {max_batch: auto}   (and calibration: profiles/h200.json if elsewhere)

\b
It times the verify forward at every width (rows in flight) that fits the memory budget and at
every verify length 1..depth+1, and prints plain tokens/s by width and the depth that pays. A run
with schedule.max_batch: auto starts at the best width (capped by memory); the adaptive depth
controller starts from the measured cost curves; one-row plain decoding runs whichever of the
compiled program and the eager forward was faster here (the same logits either way). The run's
manifest records the profile it used.
A profile holds its device and model config: one measured elsewhere is ignored.
"""


@click.command("calibrate", epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None, metavar="PROFILE",
              help="Where the profile goes (default: mtplx_calibration.json beside the model).")
@click.option("--widths", default="1,8,32,64,128,256", show_default=True, metavar="W,W,...",
              help="Batch widths to measure (those over the memory budget are skipped).")
@click.option("--depth", type=click.IntRange(1, 16), default=4, show_default=True,
              help="Deepest draft measured (verify lengths 1..depth+1).")
@click.option("--context", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens already cached per row while verifies are timed.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed verifies per (width, length); the median counts.")
@click.option("--memory-budget", default="auto", show_default=True,
              help="Bytes (or auto) the rows in flight may use, as schedule.memory_budget.")
@gguf_mode_option
def calibrate(model: str, out: Optional[str], widths: str, depth: int, context: int, repeats: int,
              memory_budget: str, gguf_mode: str):
    """Measure throughput by batch width and verify cost by length for MODEL on this machine."""
    try:
        ws = [int(w) for w in widths.split(",") if w.strip()]
        if not ws or min(ws) < 1:
            raise ValueError
    except ValueError:
        click.echo(f"error: --widths must be positive integers separated by commas, got {widths!r}", err=True)
        sys.exit(2)
    from mtplx.calibrate import calibrate as measure
    from mtplx.calibrate import profile_path, save_profile
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine

    from mtplx.checks import auto_or_bytes

    try:
        budget = auto_or_bytes(memory_budget)
    except Exception:
        click.echo(f"error: --memory-budget must be auto or a size such as 40GiB, got {memory_budget!r}", err=True)
        sys.exit(2)
    try:
        engine = Engine.load(model, SpeculativeConfig(method="none", depth=depth),
                             ScheduleConfig(memory_budget=budget), gguf_mode=gguf_mode)
    except (FileNotFoundError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    profile = measure(engine, ws, depth=depth, context=context, repeats=repeats,
                      log=lambda m: click.echo(m, err=True))
    if not profile["verify_seconds"]:
        click.echo(f"error: no width in {widths} fits the memory budget; lower --widths or --context", err=True)
        sys.exit(2)
    path = save_profile(profile, out or profile_path(engine.bundle.path))
    pays = ", ".join(f"{w}: {k}" for w, k in profile["depth_that_pays"].items())
    click.echo(f"best width {profile['best_width']} ({profile['tokens_per_second'][str(profile['best_width'])]:.1f} "
               f"tok/s plain); depth that pays by width (acceptance {profile['acceptance']}): {pays}")
    if profile["skipped_widths"]:
        click.echo(f"skipped (over the memory budget): {profile['skipped_widths']}")
    click.echo(f"profile -> {path}")
