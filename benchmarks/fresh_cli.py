"""`mtplx-batch ARGS` in this (fresh) process, with module attributes set first: a user's run with
one engine setting changed, for benchmarks that compare fresh processes (benchmarks/gpu_mtp.sh clirep).

    python -m benchmarks.fresh_cli --attr mtplx.kernel_cache.ENABLED=false -- run jobs/eval-mtp.yaml --limit 8
"""

from __future__ import annotations

import argparse
import importlib
import sys

import yaml


def set_attrs(argv, doc=__doc__) -> list:
    """Parse `[--attr MODULE.NAME=V ...] -- CLI ARGS`, set each attribute, return the CLI's args."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attr", action="append", default=[], help="MODULE.NAME=V, set before the command runs")
    args = ap.parse_args(argv[:cut])
    for a in args.attr:
        target, value = a.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, yaml.safe_load(value))
    return argv[cut + 1:]


def main(argv=None):
    rest = set_attrs(argv)
    from pipelines.cli.commands import main as cli

    cli(args=rest, prog_name="mtplx-batch")


if __name__ == "__main__":
    main()
