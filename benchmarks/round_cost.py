"""What one decode round costs the host: MTP rounds against plain rounds, same engine, same run.

    python -m benchmarks.round_cost --tiny --widths 32 --tokens 48            # CPU: a deep, narrow model
    python -m benchmarks.round_cost --model smollm2-135m-instruct --head heads/smollm2-135m-instruct \
        --prompts humaneval --widths 32,1 --tokens 128 --depths 3s,3,a --peer

On a small model on a big GPU a round is host work and kernel launches, not FLOPs: a verify of
W x 4 tokens costs about what W x 1 costs. `--tiny` builds a model with that profile on a CPU (30
layers of width 64, as SmolLM2-135M has 30 layers, with a random MTP head): its rounds are
launch- and host-bound too, so the ratio of an MTP round to a plain round says how much host work
and synchronization a speculative round adds. Prints per method: tok/s, rounds, seconds per
round, MTP rounds per plain round (time), and `mx.eval` calls per round (explicit host syncs); admissions (prefills of new rows),
drains (calls of the rounds that returned with the one-ahead pipeline read empty; an admission behind a
round in flight is none) and `tail s` (the part-empty rounds after
the last row was admitted; `--cycle` repeats the prompts for longer streams, where it weighs less);
`--peer` adds mlx-lm on the same rows;
`--cprofile N` also prints the N costliest functions of the MTP run (host-side Python).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import importlib
import pstats
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import yaml

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams

from . import phase_profile
from .common import device_name, sync, table
from .real_models import load_prompts
from .round_graph import GraphCounter

ROOT = Path(__file__).resolve().parent.parent


def tiny_setup(tmp: Path, layers: int = 30):
    """A deep, narrow llama (random weights, eos never chosen) and a random MTP sidecar head."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_model
    from mtplx.training.train_head import TrainConfig, _init_head, save_sidecar

    path = make_tiny_model(tmp / "model", "llama", num_hidden_layers=layers)
    bundle = load(path)
    head = save_sidecar(bundle, _init_head(bundle.model, TrainConfig(seed=2)), tmp / "head", {})
    prompts = [[3 + (i * 7) % 400, 17, 9, 40 + i % 300, 11, 12 + i % 50] for i in range(256)]
    return bundle, str(head), prompts


def real_setup(model: str, head: str, prompts_source):
    bundle = load(model)
    return bundle, head, load_prompts(prompts_source, bundle.tokenizer, 256) if prompts_source else None


class EvalCounter:
    """Counts mx.eval calls (the explicit host syncs) while active."""

    def __init__(self):
        self.calls = 0
        self._real = mx.eval

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        mx.eval = counted
        return self

    def __exit__(self, *exc):
        mx.eval = self._real


def _time_prefill(eng):
    """Wrap the engine's prefill in a timer: the host's time inside it, not synchronized at its start (a
    round may still run on the device then, and waiting for it here would stop the host from building the
    prefill's graphs meanwhile) nor at its end (an admission behind a round in flight does not read its
    first tokens there: the round they join is queued first). Where the prefill reads its first tokens
    (the first admission, a drained batch's, `defer_first_read` off) it holds the device's prefill and
    the round queued before it."""
    spent = [0.0]
    inner = eng.prefiller.run

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        return out

    eng.prefiller.run = timed
    return spent


def _time_reads(eng):
    """Seconds the host spends inside the speculative rounds' reads (blocked on the device)."""
    spent = [0.0]
    inner = eng._read

    def timed(flight):
        t0 = time.perf_counter()
        out = inner(flight)
        spent[0] += time.perf_counter() - t0
        return out

    eng._read = timed
    return spent


def _time_full(eng, total: int):
    """Tokens as they come out (decode and first tokens) and when the last of `total` requests was
    admitted: the `full` columns are the rate until then, while finished rows are still replaced
    (a long job's steady state), without the last rows' part-empty rounds."""
    seen = {"events": [], "drained": None, "taken": set(), "admissions": 0, "calls": 0, "widths": {}}
    eng.on_progress = lambda kind, k: seen["events"].append((time.perf_counter(), k)) if kind == "decode" else None
    inner = eng._admit

    def admit(batch):
        if "next_request" not in batch.__dict__:
            take = batch.next_request

            def taking():
                req = take()
                if req is not None:
                    seen["taken"].add(req.key)
                return req
            batch.next_request = taking
        before = len(seen["taken"])
        again = yield from inner(batch)
        seen["admissions"] += len(seen["taken"]) > before
        if len(seen["taken"]) >= total and seen["drained"] is None:
            seen["drained"] = (time.perf_counter(), eng.counters["rounds"])
        return again

    eng._admit = admit
    for name in ("_round", "_plain_rounds"):  # calls that return with the pipeline read empty (not carried)
        def calls(*args, _inner=getattr(eng, name), **kwargs):
            before = eng.counters["rounds"]
            out = yield from _inner(*args, **kwargs)
            seen["calls"] += getattr(eng, "_carried", None) is None
            width = len(args[0])  # the slots: a drained batch moved to a tail width runs narrower calls
            seen["widths"][width] = seen["widths"].get(width, 0) + eng.counters["rounds"] - before
            return out
        setattr(eng, name, calls)

    def landed(slots, cache, _inner=eng._land_carried):  # the round carried across the last admission, read
        before = eng.counters["rounds"]  # before the batch narrows: a round of no call
        out = _inner(slots, cache)
        seen["widths"][len(slots)] = seen["widths"].get(len(slots), 0) + eng.counters["rounds"] - before
        return out
    eng._land_carried = landed
    return seen


def prepare(bundle, prompts, spec: SpeculativeConfig, width: int, rows: int, tokens: int, phases=False,
            sync_rounds=False, carry=True, tail_width=None, attrs=()):
    """An engine for one setting and its requests, after one untimed run of them (the warm-up: every
    program and kernel shape exists): (engine, requests, warm-up seconds). `attrs`: (dotted name,
    value) pairs set on the engine first (`refill_at`, `prefiller.padding_waste`: the engine's knobs), or
    on a module (`mtplx.qmm_rows.ONE_MATRIX`) while the engine is made and warmed (module_attrs)."""
    with module_attrs(attrs):
        return _prepare(bundle, prompts, spec, width, rows, tokens, phases, sync_rounds, carry, tail_width, attrs)


@contextlib.contextmanager
def module_attrs(attrs):
    """The `mtplx.MODULE.NAME` entries of `attrs` set on their modules while the block runs (a module switch
    is read when an engine is made, a product is called or a program traced: a setting's engine is made,
    warmed and timed under them), then put back."""
    restore = []
    try:
        for name, value in attrs:
            if name.startswith("mtplx."):
                module, attr = name.rsplit(".", 1)
                mod = importlib.import_module(module)
                if not hasattr(mod, attr):
                    raise SystemExit(f"--depths: @{name}: {module} has no such attribute")
                old = getattr(mod, attr)
                restore.append((mod, attr, old))
                setattr(mod, attr, type(old)(value) if isinstance(old, (bool, int)) else value)
        yield
    finally:
        for mod, attr, old in reversed(restore):
            setattr(mod, attr, old)


def _prepare(bundle, prompts, spec, width, rows, tokens, phases, sync_rounds, carry, tail_width, attrs):
    eng = Engine(bundle, spec, ScheduleConfig(max_batch=width))
    for name, value in attrs:
        if name.startswith("mtplx."):
            continue  # a module's (module_attrs)
        *path, last = name.split(".")
        target = eng
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, last):
            raise SystemExit(f"--depths: @{name}: the engine has no such attribute")
        setattr(target, last, value)
    eng.carry_admissions = carry  # False: each admission empties the pipeline first (before session 7)
    if tail_width is not None:  # how far a drained batch narrows (Engine.TAIL_KEEPS_WIDTH; default by device)
        eng.TAIL_KEEPS_WIDTH = tail_width
    if sync_rounds:  # the drafter as if it drafted on the host: one synchronous round per call (the old path)
        d = eng.drafter
        d.__class__ = type(f"Synchronous{type(d).__name__}", (type(d),), {"device_side": False})
    reqs = [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=tokens)) for i, p in enumerate(prompts[:rows])]
    if phases:  # the device synchronized at every phase edge (no overlap left): the split, not the total.
        # Instrumented before the warm-up: evaluating a program's outputs at other edges builds other
        # CUDA kernels (H200, session 5: 37.7 ms a head commit, kernel builds, when warmed unsynchronized)
        phase_profile.instrument(eng)
    sync()
    w0 = time.perf_counter()
    list(eng.generate(reqs))
    sync()
    warm_s = time.perf_counter() - w0
    if phases:
        phase_profile.TIMES.clear()
        phase_profile.CALLS.clear()
    return eng, reqs, warm_s


def measure(eng, reqs, profile=None, graph=False) -> dict:
    """One timed run of `reqs` through a prepared engine: its columns (and `texts`, each row's tokens)."""
    rounds0, built0 = eng.counters["rounds"], eng._programs_built()  # (plain's: the verify bank's)
    gc.collect()  # not inside the timed run
    prefill = _time_prefill(eng)
    full = _time_full(eng, len(reqs))
    waited = _time_reads(eng)
    sync()
    with EvalCounter() as evals:
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        res = list(eng.generate(reqs))
        sync()
        dt = time.perf_counter() - t0
        if profile is not None:
            profile.disable()
    rounds = eng.counters["rounds"] - rounds0
    built = eng._programs_built() - built0
    eng.on_progress = None
    for name in ("_admit", "_round", "_plain_rounds", "_read", "_land_carried"):  # _time_full's and _time_reads' wrappers
        eng.__dict__.pop(name, None)
    eng.prefiller.__dict__.pop("run", None)  # _time_prefill's
    reads = eng.counters["host_reads"]
    counted = {}
    if graph:  # once more, counting what each round hands the device (slow: not timed)
        rounds1 = eng.counters["rounds"]
        with GraphCounter(eng) as g:
            list(eng.generate(reqs))
        counted = g.summary(eng.counters["rounds"] - rounds1)
        counted["reads/round"] = (eng.counters["host_reads"] - reads) / max(eng.counters["rounds"] - rounds1, 1)
    n = sum(len(r.tokens) for r in res)
    verifies = sum(r.stats.verify_calls for r in res)
    decode = dt - prefill[0]
    f_end, f_rounds = full["drained"] or (t0 + dt, eng.counters["rounds"])
    f_tokens = sum(k for at, k in full["events"] if at <= f_end)
    return {"tok/s": n / dt, "tokens": n, "rounds": rounds, "tok/round": n / max(rounds, 1),
            # (no round before the last row entered: one wave, nothing refilled, no steady state)
            "full tok/s": f_tokens / max(f_end - t0, 1e-9) if f_rounds > rounds0 else "-",
            "full tok/round": f_tokens / (f_rounds - rounds0) if f_rounds > rounds0 else "-", "full tokens": f_tokens,
            "prefill s": prefill[0], "admissions": full["admissions"], "drains": full["calls"],
            # after the last row was admitted: the part-empty rounds as the batch empties
            "tail s": t0 + dt - f_end if f_rounds > rounds0 else "-",
            "ms/round": 1e3 * decode / max(rounds, 1),
            # the host blocked in a speculative round's one read, waiting for the device: near 0 when the
            # host's queueing is what bounds a round (launch-bound), near ms/round when the device is
            "wait ms/round": 1e3 * waited[0] / max(rounds, 1) if eng.drafter is not None else "-",
            "evals/round": evals.calls / max(rounds, 1),
            "tokens/verify": (sum(r.stats.accepted_tokens for r in res) + verifies) / verifies if verifies else 1.0,
            "mean depth": sum(r.stats.draft_depth for r in res) / len(res),
            # compiled programs (verify + drafter) first built inside the measured run: 0 once warmed
            "new programs": built, **counted,
            # rounds at each batch width (a drained batch moved to tail widths: Engine.tail_narrowest)
            "rounds by width": " ".join(f"{w}:{n}" for w, n in sorted(full["widths"].items(), reverse=True) if n),
            "texts": {r.key: list(r.tokens) for r in res}}


def run(bundle, prompts, spec: SpeculativeConfig, width: int, rows: int, tokens: int, profile=None, phases=False,
        sync_rounds=False, graph=False, carry=True, tail_width=None, attrs=()):
    """One setting: its warm-up run, then one timed run (`measure`'s columns and the warm-up's seconds)."""
    eng, reqs, warm_s = prepare(bundle, prompts, spec, width, rows, tokens, phases, sync_rounds, carry, tail_width, attrs)
    with module_attrs(attrs):
        return {**measure(eng, reqs, profile, graph), "warm-up s": warm_s}


@dataclass
class Setting:
    """One column of a run: plain decoding, or MTP at a depth with round_cost's suffixes (`--depths`)."""

    label: str
    spec: SpeculativeConfig
    sync_rounds: bool = False
    carry: bool = True
    tail_width: Optional[int] = None
    attrs: tuple = ()

    def prepare(self, bundle, prompts, width, rows, tokens, phases=False):
        return prepare(bundle, prompts, self.spec, width, rows, tokens, phases, self.sync_rounds, self.carry,
                       self.tail_width, self.attrs)


PLAIN = Setting("plain", SpeculativeConfig(method="none"))


def setting(entry: str, head: str) -> Setting:
    """A `--depths` entry: DEPTH or 'a' (adaptive from 3), then 's' / 'd' / 'n' / 'lN', then any
    '@NAME=VALUE' (an engine attribute, VALUE as YAML reads it; see --help). 'plain' is plain decoding."""
    entry, *extra = entry.strip().split("@")
    attrs = []
    for e in extra:
        if "=" not in e:
            raise SystemExit(f"--depths: @{e!r} is not @NAME=VALUE (e.g. 3@refill_at=32)")
        name, value = e.split("=", 1)
        value = yaml.safe_load(value)
        if isinstance(value, str):  # YAML reads 1e9 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        attrs.append((name, value))
    at = "".join(f" @{n}={v}" for n, v in attrs)
    if entry == "plain":
        return Setting("plain" + at, PLAIN.spec, attrs=tuple(attrs))
    m = re.fullmatch(r"(\d+|a)(s?)(d?)(n?)(?:l(\d+))?", entry)
    if m is None:
        raise SystemExit(f"--depths: {entry!r} is not DEPTH, 'a', a trailing 's', 'd', 'n' or 'lN' (e.g. 3, 3s, 3d, 3n, a, 3l2)")
    d, sync_rounds, drains, narrows = m.group(1), bool(m.group(2)), bool(m.group(3)), bool(m.group(4))
    lookup = int(m.group(5) or 0)
    adaptive = d == "a"
    spec = SpeculativeConfig(method="mtp", depth=3 if adaptive else int(d), adaptive_depth=adaptive, mtp_head=head,
                             mtp_lookup=lookup)
    label = (f"mtp depth {d}{' (synchronous rounds)' if sync_rounds else ''}{' (drained at admissions)' if drains else ''}"
             f"{' (tail narrows to 1)' if narrows else ''}{f' + lookup {lookup}' if lookup else ''}{at}")
    return Setting(label, spec, sync_rounds, not drains, 1 if narrows else None, tuple(attrs))


def interleaved(bundle, prompts, settings: List[Setting], width: int, rows: int, tokens: int, repeats: int,
                report=None) -> List[dict]:
    """Every setting (plain first) warmed up once, then `repeats` rounds of one timed run each, the
    order rotated every round (so a slow spell of the host, and the run before a setting, fall on
    each alike). Each setting's runs are paired with plain's of the same round: `x plain` is the
    median of those ratios, with their spread (min..max) and how many of them reach 1.2.
    `report(rows)` gets the medians so far after every round (a run cut short still says them)."""
    prepared = []
    for s in [PLAIN] + settings:
        eng, reqs, warm_s = s.prepare(bundle, prompts, width, rows, tokens)
        prepared.append((s, eng, reqs, warm_s))
        print(f"  warmed {s.label}: {warm_s:.2f} s", flush=True)
    runs: List[List[dict]] = [[] for _ in prepared]
    out: List[dict] = []
    for rep in range(repeats):
        order = list(range(len(prepared)))
        order = order[rep % len(order):] + order[: rep % len(order)]
        for i in order:
            s, eng, reqs, _ = prepared[i]
            with module_attrs(s.attrs):
                r = measure(eng, reqs)
            runs[i].append(r)
            tail = r["tail s"]
            print(f"  round {rep}: {s.label:44s} {r['tok/s']:9.1f} tok/s {r['ms/round']:6.2f} ms/round {r['rounds']:4d} rounds"
                  f"  prefill {r['prefill s']:.3f} s  tail {tail if isinstance(tail, str) else f'{tail:.3f}'} s"
                  f"  widths {r['rounds by width']}", flush=True)
        out = summarize([p[0] for p in prepared], runs, [p[3] for p in prepared])
        if report is not None:
            report(out, rep + 1)
    return out


def _med(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else "-"


def _spread(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return f"{min(values):.3g}..{max(values):.3g}" if len(values) > 1 else "-"


def _total(values):
    return sum(values) if all(isinstance(v, int) for v in values) else "-"  # (plain decoding: "-")


def summarize(settings: List[Setting], runs: List[List[dict]], warm: List[float]) -> List[dict]:
    """One row per setting from its runs (medians; x plain paired with plain's run of the same round)."""
    plain = runs[0]
    texts = plain[0]["texts"] if plain else {}
    out = []
    for s, rs, w in zip(settings, runs, warm):
        n = min(len(rs), len(plain))
        ratio = [rs[k]["tok/s"] / plain[k]["tok/s"] for k in range(n)]
        full = [rs[k]["full tok/s"] / plain[k]["full tok/s"] for k in range(n)
                if isinstance(rs[k]["full tok/s"], float) and isinstance(plain[k]["full tok/s"], float)]
        same = sum(all(r["texts"].get(key) == t for key, t in texts.items()) for r in rs)
        out.append({"method": s.label, "runs": len(rs), "tok/s": _med([r["tok/s"] for r in rs]),
                    "tok/s spread": _spread([r["tok/s"] for r in rs]),
                    "x plain tok/s": _med(ratio), "x plain spread": _spread(ratio),
                    "runs >= 1.2x": f"{sum(x >= 1.2 for x in ratio)}/{n}" if s is not settings[0] else "-",
                    "x plain full tok/s": _med(full), "x full spread": _spread(full),
                    "ms/round": _med([r["ms/round"] for r in rs]), "wait ms/round": _med([r["wait ms/round"] for r in rs]),
                    "rounds": _med([r["rounds"] for r in rs]),
                    "tok/round": _med([r["tok/round"] for r in rs]), "admissions": _med([r["admissions"] for r in rs]),
                    "drains": _med([r["drains"] for r in rs]), "prefill s": _med([r["prefill s"] for r in rs]),
                    "tail s": _med([r["tail s"] for r in rs]), "tokens/verify": _med([r["tokens/verify"] for r in rs]),
                    "new programs": _total([r["new programs"] for r in rs]) if s is not settings[0] else "-",
                    "rounds by width": rs[0].get("rounds by width", "-") if rs else "-",
                    "warm-up s": w, "runs = plain": f"{same}/{len(rs)}"})
    return out


def row_counts(spec: str, width: int) -> list[int]:
    """--rows at one width: N -> max(width, N), Nx -> N x width; later entries only add larger counts."""
    out = []
    for entry in spec.split(","):
        m = re.fullmatch(r"(\d+)(x?)", entry.strip())
        if m is None:
            raise SystemExit(f"--rows: {entry!r} is not N or Nx (e.g. 4,2x)")
        n = int(m.group(1)) * width if m.group(2) else max(width, int(m.group(1)))
        if not out or n > max(out):
            out.append(n)
    return out


def peer(bundle, prompts, width: int, rows: int, tokens: int):
    """mlx-lm on the same rows: generate_step row after row at width 1, else batch_generate."""
    from .real_models import mlx_batch, mlx_single

    p = [list(x) for x in prompts[:rows]]
    r = mlx_single(bundle.model, p, tokens, set(bundle.tokenizer.eos_token_ids)) if width == 1 else mlx_batch(bundle, p, tokens, width)
    return {"method": "mlx-lm " + ("generate_step" if width == 1 else "batch_generate"), "tok/s": r["tok_s"], "tokens": r["tokens"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 30-layer width-64 random llama with a random head")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="heads/smollm2-135m-instruct")
    ap.add_argument("--prompts", default="humaneval", help="datasets (names or .jsonl files), comma-separated: each at a width, then the next width")
    ap.add_argument("--widths", default="32", help="batch widths, in the order run")
    ap.add_argument("--rows", default="4", help="rows per width, comma-separated: N (max(width, N)) or Nx (N x width); "
                    "entries after the first only add larger counts (4,2x: width 1 runs 4 rows, width 32 runs 32 and 64). "
                    "Rows = width is one wave (rows that accept more finish first, the last rounds run part-empty); more "
                    "rows than width is a stream, refilled as rows finish, as a job runs (tok/round says how full)")
    ap.add_argument("--cycle", action="store_true", help="where --rows asks for more rows than there are prompts, repeat "
                    "the prompts (a longer stream: the part-empty tail after the last admission weighs less)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--depths", default="1,3", help="MTP depths to run ('a': adaptive from 3; a trailing 's': synchronous "
                    "rounds, the path before pipelining; 'd': each admission empties the pipeline first, the path before "
                    "rounds were carried across admissions; 'n': a drained batch narrows down to 1 row (Engine.TAIL_KEEPS_WIDTH 1; "
                    "by default a GPU keeps 32); a trailing 'lN': with speculative.mtp_lookup N, e.g. 3l2, 3dl2, 3nl2; then "
                    "'@NAME=VALUE' sets an engine attribute for that setting, e.g. 3@refill_at=32, "
                    "3@prefiller.padding_waste=1e9, 3@tail_narrowest=8 (a drained batch moves to widths 16, 8 built "
                    "ahead: mtplx/tail_widths.py), or a module's switch while that setting's engine is made, warmed "
                    "and timed, e.g. 3@mtplx.qmm_rows.ONE_MATRIX=1; 'plain@NAME=VALUE': plain decoding so)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of every setting, interleaved: all warmed up "
                    "first, then rounds of one run each (plain included) in an order rotated every round; the table gives "
                    "medians, x plain as the median of ratios to plain's run of the same round, their spread (min..max) "
                    "and how many reach 1.2x (a noisy host moves one run by more than the settings differ). 1: one run each, "
                    "in order, as before")
    ap.add_argument("--peer", action="store_true", help="also mlx-lm on the same rows (generate_step at width 1, else batch_generate)")
    ap.add_argument("--cprofile", type=int, default=0, help="print the N costliest functions of the last MTP run")
    ap.add_argument("--phases", action="store_true", help="after the first width, its first MTP setting once more, timed per phase")
    ap.add_argument("--graph", action="store_true", help="each setting once more, counting kernels / programs / reads per round")
    ap.add_argument("--attention-queries", type=int, default=None,
                    help="rows_attention's query limit for this run (CUDA; default its MAX_QUERIES, 8): 3 is MLX's own "
                         "limit, so a depth-3 verify (4 queries) runs on masked matmul + softmax as before session 5")
    args = ap.parse_args()
    if args.attention_queries is not None:
        from mtplx.kernels import rows_attention

        rows_attention.MAX_QUERIES = args.attention_queries
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            bundle, head, prompts = tiny_setup(Path(tmp))
            sets = [("tiny", prompts)]
        else:
            bundle, head, _ = real_setup(args.model, args.head, None)
            sets = [(Path(src).stem, load_prompts(src, bundle.tokenizer, 256)) for src in args.prompts.split(",")]
        print(f"device: {device_name()}; widths {args.widths}, {args.tokens} tokens a row", flush=True)
        out, prof, phased, phase_spec = [], None, False, None
        for width, rows, (data, prompts) in ((int(w), r, s) for w in args.widths.split(",")
                                             for r in row_counts(args.rows, int(w)) for s in sets):
            if rows > len(prompts) and args.cycle:
                prompts = [prompts[i % len(prompts)] for i in range(rows)]
            elif rows > len(prompts):
                print(f"{data}: {len(prompts)} prompts, fewer than {rows} rows: {len(prompts)} rows", flush=True)
                rows = len(prompts)
            settings = [setting(d, head) for d in args.depths.split(",")]
            phase_spec = phase_spec or settings[0].spec if settings else phase_spec
            if args.repeats > 1:
                print(f"{data}, width {width}, {rows} rows: {args.repeats} interleaved rounds", flush=True)
                where = {"data": data, "width": width, "rows": rows}

                def report(summary, done, where=where):
                    print(f"-- {where['data']}, width {where['width']}, {where['rows']} rows: medians of {done} round(s)")
                    print(table([{**where, **r} for r in summary]), flush=True)

                out += [{**where, **r} for r in interleaved(bundle, prompts, settings, width, rows, args.tokens,
                                                             args.repeats, report)]
                print(table(out), flush=True)
                plain = None
            else:
                plain = run(bundle, prompts, PLAIN.spec, width, rows, args.tokens, graph=args.graph)
                texts = plain.pop("texts")
                plain["rows = plain"] = f"{len(texts)}/{len(texts)}"
                out.append({"data": data, "width": width, "rows": rows, "method": "plain", **plain, "x plain round": 1.0,
                            "x plain tok/s": 1.0, "x plain full tok/s": 1.0 if isinstance(plain["full tok/s"], float) else "-"})
                print(table(out), flush=True)
            for st in settings if plain is not None else ():
                prof = cProfile.Profile() if args.cprofile else None
                r = run(bundle, prompts, st.spec, width, rows, args.tokens, prof, sync_rounds=st.sync_rounds,
                        graph=args.graph, carry=st.carry, tail_width=st.tail_width, attrs=st.attrs)
                got = r.pop("texts")
                r["rows = plain"] = f"{sum(got[k] == texts[k] for k in texts)}/{len(texts)}"  # greedy: all, up to exact ties
                out.append({"data": data, "width": width, "rows": rows, "method": st.label, **r,
                            "x plain round": r["ms/round"] / plain["ms/round"], "x plain tok/s": r["tok/s"] / plain["tok/s"],
                            "x plain full tok/s": r["full tok/s"] / plain["full tok/s"]
                            if isinstance(r["full tok/s"], float) and isinstance(plain["full tok/s"], float) else "-"})
                print(table(out), flush=True)
            if args.peer:
                r = peer(bundle, prompts, width, rows, args.tokens)
                base = plain["tok/s"] if plain is not None else out[-1 - len(settings)]["tok/s"]  # (interleaved: plain's median)
                out.append({"data": data, "width": width, "rows": rows, **r, "x plain tok/s": r["tok/s"] / base})
                print(table(out), flush=True)
            if args.phases and not phased:  # after the first width, its first MTP setting
                phased, spec = True, phase_spec
                r = run(bundle, prompts, spec, width, rows, args.tokens, phases=True)
                split = [{"phase": k, "ms/round": 1e3 * v / max(r["rounds"], 1), "calls/round": phase_profile.CALLS[k] / max(r["rounds"], 1)}
                         for k, v in sorted(phase_profile.TIMES.items(), key=lambda kv: -kv[1])]
                split.append({"phase": "whole round (synchronized at each phase edge)", "ms/round": r["ms/round"], "calls/round": 1.0})
                print(f"phases of mtp depth {spec.depth} (adaptive {spec.adaptive_depth}), width {width}:")
                print(table(split), flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
