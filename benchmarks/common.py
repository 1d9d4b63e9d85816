"""What every part shares: the device and its roofline, reports that print as they grow, warm runs
of our engine and of mlx-lm's generators on equal terms, interleaved repeats, fresh CLI processes.

Equal terms: the same model object or weights, the same prompt token ids, greedy, the same
max_tokens, both stopping at EOS; every measured run is first run once untimed (programs, kernels
and caches of every shape it needs exist), and timing waits for the device at both ends.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.assets import resolve_asset
from mtplx.request import Request, SamplingParams

ROOT = Path(__file__).resolve().parent.parent

# Peak memory bandwidth by GPU name (SXM parts): the batch-1 roofline is bandwidth / weight bytes.
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


# -- the device ---------------------------------------------------------------------------------------
def device_name() -> str:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return str(info.get("device_name") or platform.processor() or platform.machine())


def bandwidth(name: Optional[str] = None) -> Optional[float]:
    """Bytes/s of the GPU named `name` (default: the one present), None where it is not known."""
    name = device_name() if name is None else name
    if "PCIe" in name:  # a PCIe card's memory is slower than the SXM figures above
        return None
    return next((bw for gpu, bw in BANDWIDTH.items() if gpu in name), None)


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def versions() -> Dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("mlx", "mlx-lm", "mlx-cuda-13", "torch", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def sync():
    mx.synchronize()


# -- reports ------------------------------------------------------------------------------------------
def fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def table(rows: List[Dict[str, object]]) -> str:
    if not rows:
        return "(no rows)\n"
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


class Report:
    """One part's tables as they grow: every row and note is printed when it is added, and
    OUT/PART.md and OUT/PART.json are rewritten, so a run cut short keeps what it measured."""

    def __init__(self, out: Path, part: str):
        self.out, self.part = Path(out), part
        self.out.mkdir(parents=True, exist_ok=True)
        self.head = f"{part}: {device_name()}; {', '.join(f'{k} {v}' for k, v in versions().items())}"
        self.tables: Dict[str, List[dict]] = {}
        self.notes: List[str] = []
        self.say(self.head)

    def say(self, message: str):
        print(f"[{self.part}] {message}", flush=True)

    def row(self, name: str, **cells) -> dict:
        self.tables.setdefault(name, []).append(cells)
        self.say(f"{name}: " + ", ".join(f"{k} {fmt(v)}" for k, v in cells.items()))
        self.write()
        return cells

    def note(self, text: str):
        self.notes.append(text)
        self.say(text)
        self.write()

    def markdown(self) -> str:
        parts = [self.head + "\n"] + [f"{name}\n\n{table(rows)}" for name, rows in self.tables.items()]
        return "\n".join(parts + self.notes) + "\n"

    def write(self):
        (self.out / f"{self.part}.md").write_text(self.markdown())
        (self.out / f"{self.part}.json").write_text(json.dumps(
            {"head": self.head, "tables": self.tables, "notes": self.notes}, indent=1, default=str))


# -- measuring ----------------------------------------------------------------------------------------
class Warm:
    """A measured run, run once untimed when made. Calling it times one more run: `measure(out, seconds)`."""

    def __init__(self):
        sync()
        t0 = time.perf_counter()
        self.run()
        sync()
        self.warmup_s = time.perf_counter() - t0

    def run(self):
        raise NotImplementedError

    def measure(self, out, seconds: float) -> dict:
        raise NotImplementedError

    def __call__(self) -> dict:
        sync()
        t0 = time.perf_counter()
        out = self.run()
        sync()
        return self.measure(out, time.perf_counter() - t0)


def requests(prompts: Sequence[Sequence[int]], tokens: int) -> List[Request]:
    return [Request(key=i, prompt_tokens=list(p), params=SamplingParams(max_tokens=tokens)) for i, p in enumerate(prompts)]


class Ours(Warm):
    """Our engine for one setting at one width: the whole batch of rows through `generate()`.
    The engine's counters (rounds, programs built, ...) are read around each timed run."""

    def __init__(self, bundle, spec: SpeculativeConfig, width: int, prompts, tokens: int):
        self.engine = Engine(bundle, spec, ScheduleConfig(max_batch=width))
        self.requests = requests(prompts, tokens)
        super().__init__()
        self.warm_counters = self.engine.counters.as_dict()

    def run(self):
        before = self.engine.counters.as_dict()
        results = sorted(self.engine.generate(self.requests), key=lambda r: r.key)
        after = self.engine.counters.as_dict()
        return results, {k: after[k] - before[k] for k in after}

    def measure(self, out, seconds: float) -> dict:
        results, counted = out
        n = sum(len(r.tokens) for r in results)
        verifies = sum(r.stats.verify_calls for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        rounds = counted["rounds"]
        return {"tok/s": n / seconds, "tokens": n, "s": seconds,
                "tokens/verify": (accepted + verifies) / verifies if verifies else 1.0,
                "rounds": rounds, "ms/round": 1e3 * seconds / max(rounds, 1),
                "new programs": counted["programs_built"],  # built inside a timed run: 0 once warm
                "texts": [list(r.tokens) for r in results]}


class RowAfterRow(Warm):
    """An mlx-lm generator of one row, `steps(prompt, max_tokens)` yielding (token, from_draft), over
    every prompt in turn; a row ends at EOS or max_tokens."""

    def __init__(self, steps, prompts, tokens: int, eos):
        self.steps, self.prompts, self.tokens, self.eos = steps, prompts, tokens, set(eos)
        super().__init__()

    def run(self):
        texts, drafted = [], 0
        for p in self.prompts:
            out = []
            for tok, from_draft in self.steps(mx.array(p), self.tokens):
                tok = int(tok)
                if tok in self.eos:
                    break
                out.append(tok)
                drafted += bool(from_draft)
            texts.append(out)
        return texts, drafted

    def measure(self, out, seconds: float) -> dict:
        texts, drafted = out
        n = sum(map(len, texts))
        # a verify emits one token of its own plus the drafts it accepted
        return {"tok/s": n / seconds, "tokens": n, "s": seconds, "tokens/verify": n / max(n - drafted, 1), "texts": texts}


def generate_step(model, prompts, tokens: int, eos) -> RowAfterRow:
    """mlx-lm's `generate_step`, row after row."""
    from mlx_lm.generate import generate_step as steps

    return RowAfterRow(lambda p, n: ((t, False) for t, _ in steps(p, model, max_tokens=n)), prompts, tokens, eos)


def speculative_generate_step(model, draft_model, prompts, tokens: int, eos, num_draft: int) -> RowAfterRow:
    """mlx-lm's own speculative decoding with a draft model, row after row."""
    from mlx_lm.generate import speculative_generate_step as steps

    return RowAfterRow(lambda p, n: ((t, d) for t, _, d in steps(p, model, draft_model, num_draft_tokens=num_draft,
                                                                  max_tokens=n)), prompts, tokens, eos)


class BatchGenerate(Warm):
    """mlx-lm's `batch_generate`, keeping up to `width` rows in flight (its completion batch size)."""

    def __init__(self, model, tokenizer, prompts, tokens: int, width: int):
        self.args = (model, tokenizer, [list(p) for p in prompts])
        self.kwargs = dict(max_tokens=tokens, return_token_ids=True, completion_batch_size=width,
                           prefill_batch_size=min(8, width))
        super().__init__()

    def run(self):
        from mlx_lm import batch_generate

        return batch_generate(*self.args, **self.kwargs).token_ids

    def measure(self, out, seconds: float) -> dict:
        n = sum(map(len, out))
        return {"tok/s": n / seconds, "tokens": n, "s": seconds, "texts": [list(t) for t in out]}


def interleaved(runs: Dict[str, Callable[[], dict]], repeats: int, say) -> Dict[str, List[dict]]:
    """Every run `repeats` times, in rounds whose order rotates: a slow spell of a shared host, and the
    run before each, fall on every setting alike."""
    labels = list(runs)
    out: Dict[str, List[dict]] = {label: [] for label in labels}
    for rep in range(repeats):
        k = rep % len(labels)
        for label in labels[k:] + labels[:k]:
            r = runs[label]()
            out[label].append(r)
            say(f"run {rep + 1}/{repeats} {label}: " + ", ".join(
                f"{key} {fmt(v)}" for key, v in r.items() if isinstance(v, (int, float))))
    return out


def median(values: List[float]) -> float:
    return statistics.median(values)


def median_ratio(ours: List[dict], peer: List[dict], key: str = "tok/s") -> float:
    """The median of the per-repeat ratios ours / peer (each pair ran in the same round)."""
    return median([a[key] / b[key] for a, b in zip(ours, peer)])


def spread(values: List[float]) -> str:
    return f"{min(values):.3g}..{max(values):.3g}" if len(values) > 1 else "n=1"


def same_rows(a: List[list], b: List[list]) -> str:
    """How many rows of `a` equal `b`'s, as 'k/n' (greedy: every row, up to exact ties of the logits)."""
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


# -- prompts ------------------------------------------------------------------------------------------
def load_prompts(source: str, tokenizer, rows: int, skip=()) -> List[List[int]]:
    """`rows` prompts of a dataset (a known name or a JSONL file with a `prompt` field), through the
    model's chat template where it has one; rows whose index is in `skip` are left out."""
    prompts = []
    with open(resolve_asset(source, "dataset")) as f:
        for i, line in enumerate(f):
            if i in skip:
                continue
            text = json.loads(line)["prompt"]
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            else:
                ids = tokenizer.encode(text)
            prompts.append(list(ids))
            if len(prompts) == rows:
                break
    return prompts


# -- fresh processes ----------------------------------------------------------------------------------
def cli_run(job: str, overrides: Sequence[str], run_dir: Path, timeout: float = 3600) -> dict:
    """`mtplx-batch run JOB --restart --log-json` in a fresh process, as a user runs it: the wall
    time of the whole process and its `startup` and `summary` events."""
    cmd = [sys.executable, "-m", "pipelines.cli", "run", job, "--restart", "--log-json",
           "--set", f"output.dir={run_dir}"] + [a for o in overrides for a in ("--set", o)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    events = {}
    for line in proc.stderr.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            events[event["event"]] = event
    if proc.returncode != 0 or "summary" not in events:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return {"wall s": wall, "startup": events.get("startup", {}), "summary": events["summary"]}
