"""Training data for MTP heads: token sequences (prompts with the model's own continuations, or text
windows), and the frozen trunk's features over them."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from ..models.loading import ModelBundle
from ..models.mtp import project_logits, trunk_hidden
from .config import TrainConfig, TrainHeadError
from .head_prompts import general_prompts, text_files

TABLE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv",
                 ".arrow": "arrow", ".jsonl.gz": "jsonl"}


def _bar(total, desc, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False, file=sys.stderr,
                disable=not enabled or not sys.stderr.isatty())


@dataclass
class TrainData:
    """Token sequences, position t of sequence i scored from starts[i] (a prompt is context only)."""

    sequences: List[List[int]]
    source: str  # what they came from, for the metadata
    starts: Optional[List[int]] = None  # None: every position is scored
    heldout: List[int] = field(default_factory=list)  # indices of held-out sequences
    rows: Optional[List[int]] = None  # the job rows (input indices) the prompts came from, when sampled
    groups: Optional[List[int]] = None  # sequences of one prompt share a group: held out together
    extra: Optional["TrainData"] = None  # training-only sequences (--prompts), appended after the split

    def __post_init__(self):
        if self.starts is None:
            self.starts = [0] * len(self.sequences)
        if self.groups is None:
            self.groups = list(range(len(self.sequences)))

    def clip(self, seq_len: int, limit: Optional[int] = None) -> "TrainData":
        """Cut sequences to seq_len, drop those with no scored position left, keep `limit`."""
        keep = [(s[:seq_len], st, g) for s, st, g in zip(self.sequences, self.starts, self.groups)
                if min(len(s), seq_len) - 2 > st][: limit or None]
        self.sequences, self.starts, self.groups = (list(x) for x in zip(*keep)) if keep else ([], [], [])
        return self

    def split(self, fraction: float, seed: int):
        n = len(self.sequences)
        if n < 2:
            raise TrainHeadError(f"the data gave {n} usable sequence(s); need at least 2 (one is held out): give more "
                                 "prompts or text")
        groups = sorted(set(self.groups))
        if len(groups) < 2:
            raise TrainHeadError("the data holds one prompt's continuations only; need at least 2 prompts (one is held out)")
        k = min(64, max(1, int(round(len(groups) * fraction))), len(groups) - 1)
        order = np.random.default_rng(seed).permutation(len(groups))
        out = {groups[int(i)] for i in order[:k]}
        self.heldout = [i for i, g in enumerate(self.groups) if g in out]

    def save(self, path: Path, key: Optional[dict] = None):
        lens = np.array([len(s) for s in self.sequences], dtype=np.int64)
        flat = np.array([t for s in self.sequences for t in s], dtype=np.int32)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=flat, lengths=lens, starts=np.array(self.starts, dtype=np.int64),
                 heldout=np.array(self.heldout, dtype=np.int64), source=np.array(self.source),
                 key=np.array(json.dumps(key, sort_keys=True)), rows=np.array(json.dumps(self.rows)),
                 groups=np.array(self.groups, dtype=np.int64))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "TrainData":
        z = np.load(path)
        offsets = np.concatenate([[0], np.cumsum(z["lengths"])])
        seqs = [z["tokens"][offsets[i] : offsets[i + 1]].tolist() for i in range(len(z["lengths"]))]
        rows = json.loads(str(z["rows"])) if "rows" in z.files else None
        groups = [int(g) for g in z["groups"]] if "groups" in z.files else None
        return cls(seqs, str(z["source"]), [int(i) for i in z["starts"]], [int(i) for i in z["heldout"]], rows, groups)

    def extend(self, other: "TrainData"):
        base = max(self.groups, default=-1) + 1
        self.sequences += other.sequences
        self.starts += other.starts
        self.groups += [base + g for g in other.groups]
        self.source = f"{self.source} + {other.source}"

    @staticmethod
    def stored_key(path: Path) -> Optional[dict]:
        try:
            return json.loads(str(np.load(path)["key"]))
        except (OSError, KeyError, ValueError):
            return None

    def subset(self, idx: Sequence[int], source: str) -> "TrainData":
        return TrainData([self.sequences[i] for i in idx], source, [self.starts[i] for i in idx],
                         groups=[self.groups[i] for i in idx])

    def digest(self) -> str:
        h = hashlib.sha256()
        for s, st in zip(self.sequences, self.starts):
            h.update(np.asarray(s, dtype=np.int32).tobytes())
            h.update(f"\x00{st}\x00".encode())
        return h.hexdigest()[:16]


def _windows(tok, texts: Sequence[str], size: int) -> List[List[int]]:
    out = []
    for text in texts:
        ids = _encode_text(tok, text)
        out += [ids[s : s + size] for s in range(0, len(ids), size) if len(ids) - s >= 3]
    return out


def _encode_text(tok, text: str, piece_chars: int = 4000) -> List[int]:
    """Tokenize long text in pieces cut at line ends (tokenizers slow down on huge inputs)."""
    ids: List[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + piece_chars)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        ids.extend(tok.encode(text[start:end], add_special_tokens=False) if start else tok.encode(text[start:end]))
        start = end
    return ids


def self_distill(bundle: ModelBundle, prompts: Sequence[Sequence[int]], max_new_tokens: Union[int, Sequence[int]],
                 max_batch: int = 32, seq_len: Optional[int] = None, quiet: bool = True,
                 samples: Union[int, Sequence[int]] = 0, temperature: float = 0.8, seed: int = 0,
                 seconds: Optional[float] = None, log: Optional[Callable[[str], None]] = None,
                 deadline: Optional[float] = None) -> TrainData:
    """Each prompt with the model's greedy continuation and `samples` seeded sampled ones, scored from the
    first generated token; stops `seconds` after the first continuation or at `deadline`, keeping those done."""
    from ..config import ScheduleConfig, SpeculativeConfig
    from ..generation import Engine
    from ..request import Request, SamplingParams
    started = time.monotonic()
    log = log or (lambda message: None)
    compiled = "on" if mx.default_device() == mx.gpu else "off"  # on a CPU compiling does not pay
    engine = Engine(bundle, SpeculativeConfig(method="none", compiled_verify=compiled),
                    ScheduleConfig(order="input", max_batch=max_batch))
    counts = [samples] * len(prompts) if isinstance(samples, int) else list(samples)
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    reqs, groups = [], []
    for i, p in enumerate(prompts):
        p = list(p) if seq_len is None else list(p)[: max(1, seq_len - 2)]  # room for two generated tokens
        for j in range(1 + max(counts[i], 0)):
            params = SamplingParams(max_tokens=news[i], temperature=temperature if j else 0.0)
            reqs.append(Request(key=len(reqs), prompt_tokens=p, params=params, seed=seed * 1_000_003 + i * 101 + j))
            groups.append(i)
    out: Dict[int, List[int]] = {}
    bar = _bar(len(reqs), "generating", not quiet)
    generated, last_log, first = 0, started, None
    for res in engine.generate(reqs):
        out[res.key] = reqs[res.key].prompt_tokens + (res.tokens if res.finish_reason != "error" else [])
        generated += len(res.tokens)
        bar.update(1)
        now = time.monotonic()
        if first is None:
            first = now
            log(f"first continuation after {now - started:.0f}s (model warm-up); the generation limit counts from here")
        if now - last_log > 15 or len(out) == len(reqs):
            last_log = now
            log(f"generating: {len(out)}/{len(reqs)} continuations, {generated:,} tokens, "
                f"{generated / max(now - started, 1e-9):,.0f} tok/s ({now - started:.0f}s)")
        late = deadline is not None and now > deadline
        if (late or (seconds is not None and now - first > seconds)) and len(out) < len(reqs):
            why = "the deadline (half of --max-seconds)" if late else f"generation time limit of {seconds:.0f}s"
            log(f"{why}: kept {len(out)} of {len(reqs)} continuations ({generated:,} tokens)")
            break
    bar.close()
    keys = sorted(out)
    # the head first drafts from t = P-1: (h_{P-1}, x_P, the trunk's first token) -> x_{P+1}
    return TrainData([out[k] for k in keys], "self-distilled", [max(len(reqs[k].prompt_tokens) - 1, 0) for k in keys],
                     groups=[groups[k] for k in keys])


def text_data(bundle: ModelBundle, paths: Sequence[str], max_tokens: int, seq_len: int, seed: int) -> TrainData:
    files = [f for p in paths for f in text_files(p)]
    order = np.random.default_rng(seed).permutation(len(files))
    seqs: List[List[int]] = []
    total = 0
    for k in order:
        try:
            text = files[k].read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for w in _windows(bundle.tokenizer, [text], seq_len):
            seqs.append(w)
            total += len(w)
            if total >= max_tokens:
                return TrainData(seqs, f"text:{','.join(paths)}")
    return TrainData(seqs, f"text:{','.join(paths)}")


@dataclass
class ReadData:
    """A job's or a table's rows as the caller read them: prompts to self-distill, or texts."""

    source: str
    prompts: List[List[int]] = field(default_factory=list)
    texts: List[str] = field(default_factory=list)
    max_new_tokens: int = 256  # continuation length when self-distilling the prompts
    rows: Optional[List[int]] = None  # the input rows the prompts came from, when sampled


def is_job_or_table(path: str) -> bool:
    return str(path).lower().endswith((".yaml", ".yml", *TABLE_FORMATS))


def is_dataset_name(name: str) -> bool:
    from ..models.assets import ASSETS
    return name in ASSETS and ASSETS[name].kind == "dataset" and not os.path.exists(name)


def build_data(bundle: ModelBundle, data, cfg: TrainConfig, quiet: bool = True, log=None, deadline=None) -> TrainData:
    """Training sequences from ReadData, a text file, or a list of texts or of token-id lists."""
    tok = bundle.tokenizer
    limit = cfg.max_rows
    if isinstance(data, ReadData):
        return _read_data(bundle, data, cfg, quiet, log, deadline)
    if isinstance(data, (list, tuple)):
        if all(isinstance(x, str) for x in data):
            return TrainData(_windows(tok, data, cfg.seq_len), "texts").clip(cfg.seq_len, limit)
        return TrainData([list(map(int, s)) for s in data], "tokens").clip(cfg.seq_len, limit)
    path = str(data)
    if not os.path.exists(path):
        from ..models.assets import list_assets
        names = ", ".join(a.name for a in list_assets("dataset"))
        raise TrainHeadError(f"{path!r} does not exist: give a job YAML, a JSONL/Parquet/CSV file with a prompt "
                             f"or text column, a plain text file, or a known dataset ({names})")
    if is_job_or_table(path):
        raise TrainHeadError(f"--data {path!r}: a job or a table is read by the train-head command "
                             "(pipelines.io.train_data.read_train_data); pass what it reads (ReadData)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise TrainHeadError(f"--data {path!r}: not a UTF-8 text file ({e}); give a job YAML, a "
                             "JSONL/Parquet/CSV file or plain text")
    return TrainData(_windows(tok, [text], cfg.seq_len), f"text:{os.path.abspath(path)}").clip(cfg.seq_len, limit)


def _read_data(bundle: ModelBundle, data: ReadData, cfg: TrainConfig, quiet: bool, log=None, deadline=None) -> TrainData:
    """The rows' prompts self-distilled before `cfg.prompts`' (returned as `extra`), or their texts."""
    if not data.prompts:
        return TrainData(_windows(bundle.tokenizer, data.texts, cfg.seq_len), data.source).clip(cfg.seq_len)
    general, general_source = _general(bundle, cfg)
    n = len(data.prompts)
    if log is not None:
        log(f"self-distilling {n} rows x {1 + cfg.samples_per_prompt} continuations"
            + (f" + {len(general)} general prompts x {1 + cfg.general_samples} ({general_source})" if general else "")
            + f", {data.max_new_tokens} tokens each, {cfg.gen_batch} rows at a time")
    both = self_distill(bundle, list(data.prompts) + general, data.max_new_tokens, cfg.gen_batch, cfg.seq_len, quiet,
                        [cfg.samples_per_prompt] * n + [cfg.general_samples] * len(general), cfg.temperature, cfg.seed,
                        cfg.data_seconds, log, deadline)
    out = both.subset([i for i, g in enumerate(both.groups) if g < n], data.source)
    out.rows = data.rows
    if general:
        out.extra = both.subset([i for i, g in enumerate(both.groups) if g >= n], general_source)
    return out.clip(cfg.seq_len)


def _general(bundle: ModelBundle, cfg: TrainConfig) -> Tuple[List[List[int]], str]:
    """The --prompts prompts, each at most half a training sequence, and the source that names them."""
    prompts, kinds = general_prompts(bundle.tokenizer, cfg.prompts, cfg.seed, max_tokens=cfg.seq_len // 2)
    names = [spec.split(":")[0] for spec in cfg.prompts]
    return prompts, "prompts:" + ",".join(f"{k}:{kinds.count(k)}" for k in names)


def general_data(bundle: ModelBundle, cfg: TrainConfig, quiet: bool = True, log=None,
                 deadline=None) -> Optional[TrainData]:
    general, source = _general(bundle, cfg)
    if not general:
        return None
    out = self_distill(bundle, general, cfg.max_new_tokens or 256, cfg.gen_batch, cfg.seq_len, quiet,
                       cfg.general_samples, cfg.temperature, cfg.seed, cfg.data_seconds, log, deadline)
    out.source = source
    return out.clip(cfg.seq_len)


@dataclass
class Features:
    """Per sequence: tokens [L], trunk hidden [L, D], trunk greedy next token [L] or None, first scored."""

    tokens: List[np.ndarray]
    hidden: List[mx.array]
    greedy: List[Optional[np.ndarray]]
    starts: List[int]

    @property
    def positions(self) -> int:
        return sum(max(len(t) - 2 - st, 0) for t, st in zip(self.tokens, self.starts))


LENGTH_BUCKET = 64  # batches pad to a multiple of this: few shapes, few kernel builds on a GPU


def padded_length(n: int) -> int:
    return -(-n // LENGTH_BUCKET) * LENGTH_BUCKET


def trunk_features(model, sequences: Sequence[Sequence[int]], starts: Sequence[int], store_dtype, want_greedy: bool,
                   desc: str = "trunk", quiet: bool = True) -> Features:
    """The frozen trunk once over `sequences`, in right-padded batches of similar length."""
    batch_tokens = 16384 if mx.default_device() == mx.gpu else 4096
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    hidden: List[Optional[mx.array]] = [None] * len(sequences)
    greedy: List[Optional[np.ndarray]] = [None] * len(sequences)
    bar = _bar(len(sequences), desc, not quiet)
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and (j - i + 1) * len(sequences[order[j]]) <= max(batch_tokens, len(sequences[order[j]])):
            j += 1
        idx = order[i:j]
        L = padded_length(max(len(sequences[k]) for k in idx))
        x = np.zeros((len(idx), L), dtype=np.int32)
        for r, k in enumerate(idx):
            x[r, : len(sequences[k])] = sequences[k]
        h = trunk_hidden(model, mx.array(x), None)
        hs = h.astype(store_dtype)
        g = mx.argmax(project_logits(model, h), axis=-1).astype(mx.int32) if want_greedy else None
        mx.eval(hs, g)
        g = None if g is None else np.array(g)
        for r, k in enumerate(idx):
            hidden[k] = hs[r, : len(sequences[k])]
            if g is not None:
                greedy[k] = g[r, : len(sequences[k])]
        bar.update(len(idx))
        i = j
    bar.close()
    return Features([np.asarray(s, dtype=np.int32) for s in sequences], hidden, greedy, list(starts))
