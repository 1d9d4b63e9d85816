"""The table of `gpu_mtp.sh clirep`: per setting, the median wall and run seconds of its fresh
`mtplx-batch run`s and how many wrote the same text as the first setting's first run.

    python -m benchmarks.clirep_table "TAG|JOB|SETS|ON|DIR ..." REPEATS LOG   (the run dirs are /tmp/b/rep-TAG-N)
"""

from __future__ import annotations

import re
import statistics
import sys


def texts(run_dir: str):
    """{id: completion} of a run directory's committed shards, or None where it has none."""
    import pyarrow.dataset as ds

    try:
        rows = ds.dataset(f"{run_dir}/shards").to_table(columns=["id", "completion"]).to_pylist()
    except Exception:  # a run that failed or was cut off: no shards
        return None
    return {r["id"]: r["completion"] for r in rows}


def drafting(run_dir: str) -> str:
    """'tokens drafted per drafting round, verify programs built (of them warmed ahead), head programs
    (warmed)' of a run directory: what adaptive depth chose and built ('-' where the run left none)."""
    import json

    import pyarrow.dataset as ds

    try:
        t = ds.dataset(f"{run_dir}/shards").to_table(columns=["drafted_tokens", "verify_calls"]).to_pydict()
        manifest = json.load(open(f"{run_dir}/manifest.json"))
    except Exception:
        return "-"
    bank, drafts = manifest.get("compiled_verify") or {}, manifest.get("compiled_drafts") or {}
    calls = sum(v or 0 for v in t["verify_calls"])
    depth = f"{sum(d or 0 for d in t['drafted_tokens']) / calls:.2f}" if calls else "0"
    return (f"{depth}, {bank.get('programs', '-')} ({bank.get('warmed', '-')}), "
            f"{drafts.get('programs', '-')} ({drafts.get('warmed', '-')})")


def table(tags, repeats: int, log: str, root: str = "/tmp/b") -> str:
    ref = texts(f"{root}/rep-{tags[0]}-1")
    out = [f"| setting | wall s, median | wall s, each run | run s (summary), median | same text as {tags[0]} "
           "| per run: depth of drafting rounds, verify programs (warmed), head programs (warmed) |",
           "|---|---|---|---|---|---|"]
    for tag in tags:
        walls, runs = [], []
        for wall, run in re.findall(rf"== rep \d+ {re.escape(tag)}: exit 0, wall (\d+) ms(?: \"seconds\": ([0-9.]+))?", log):
            walls.append(int(wall) / 1000)
            if run:
                runs.append(float(run))
        same = sum(texts(f"{root}/rep-{tag}-{r}") == ref for r in range(1, repeats + 1)) if ref else "n/a"
        med = (lambda v: f"{statistics.median(v):.2f}" if v else "-")
        runs_drafting = "; ".join(drafting(f"{root}/rep-{tag}-{r}") for r in range(1, repeats + 1))
        out.append(f"| {tag} | {med(walls)} | {' '.join(f'{w:.2f}' for w in walls)} | {med(runs)} | {same}/{repeats} "
                   f"| {runs_drafting} |")
    return "\n".join(out)


if __name__ == "__main__":
    specs, repeats, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    print(table([s.split("|")[0] for s in specs.split()], repeats, open(log).read()))
