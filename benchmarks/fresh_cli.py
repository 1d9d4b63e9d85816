"""`mtplx-batch ARGS` in this (fresh) process, with module attributes set first: a user's run with
one engine setting changed, for benchmarks that compare fresh processes (benchmarks/gpu_mtp.sh clirep).

    python -m benchmarks.fresh_cli --attr mtplx.generation.Engine.TAIL_KEEPS_WIDTH=32 -- run jobs/eval-mtp.yaml --limit 8
"""

from __future__ import annotations

import argparse
import importlib
import sys

import yaml


def _set(target: str, value: str) -> None:
    """MODULE.NAME=V, or MODULE.CLASS.NAME=V: a class attribute (`mtplx.generation.Engine.TAIL_KEEPS_WIDTH=32`,
    a GPU's tail on a CPU)."""
    owner, name = target.rsplit(".", 1)
    try:
        obj = importlib.import_module(owner)
    except ImportError:
        module, cls = owner.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), cls)
    setattr(obj, name, yaml.safe_load(value))


def set_attrs(argv, doc=__doc__) -> list:
    """Parse `[--attr MODULE.NAME=V ...] -- CLI ARGS`, set each attribute, return the CLI's args."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attr", action="append", default=[], help="MODULE.NAME=V, set before the command runs")
    args = ap.parse_args(argv[:cut])
    for target, value in (a.split("=", 1) for a in args.attr):
        _set(target, value)
    return argv[cut + 1:]


def main(argv=None):
    rest = set_attrs(argv)
    from pipelines.cli.commands import main as cli

    cli(args=rest, prog_name="mtplx-batch")


if __name__ == "__main__":
    main()
