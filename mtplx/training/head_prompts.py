"""General prompts for self-distillation (`train-head --prompts KIND:N`), so one head sees the trunk
write more than the job's kind of text. `stdlib-code`: stdlib functions cut to signature and docstring
(a HumanEval-shaped prompt); `stdlib-chat`: docstrings put as questions; the dataset kinds
(KIND_DATASETS) are spread over their sources. No kind reads a held-out dataset; prompts are seeded."""

from __future__ import annotations

import ast
import json
import textwrap
from itertools import islice
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from .config import KINDS, TrainHeadError, parse_spec

KIND_DATASETS = {"chat": ("evals-chat", {"category": "chat"}, "source"),  # (dataset, rows taken, spread over)
                 "math": ("evals-chat", {"category": "math"}, "source"),
                 "writing": ("writingbench-1k", {"lang": "en"}, "subdomain"),
                 "tools": ("bfcl-tools", {}, "category"),
                 "prose": ("evals-prose", {}, "source")}
# The datasets heads are evaluated on (`--heldout-data`)
HELDOUT_DATASETS = ("owt-1k", "wikipedia-1k", "hellaswag-100", "truthfulqa-100", "gsm8k-100", "humaneval", "mmlu-1k")
WRITING_CHARS = 1000  # a longer writing request is cut at a paragraph or sentence end


class Raw(str):
    """A prompt to continue as it is: no chat template."""


Prompt = Union[str, Raw, List[Dict[str, str]]]  # a user message, raw text, or chat turns

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
MAX_DOC_CHARS = 1200  # longer docstrings are cut at a paragraph end (prompts stay shorter than the answer)
MIN_DOC_CHARS = 40  # "Return x." teaches nothing
PER_FILE = 16  # functions taken from one file at most

CHAT_ASKS = ("Explain in simple words what the following describes, then give a short example:\n\n{doc}",
             "Here is some documentation:\n\n{doc}\n\nSummarize it step by step.",
             "Answer step by step: how would I use this, and what should I watch out for?\n\n{doc}",
             "Rewrite the following as a short tutorial for a beginner:\n\n{doc}")


def text_files(path: str) -> List[Path]:
    """The text files of `path` (a file, a directory, or `stdlib`: this Python's standard library)."""
    if path == "stdlib":
        import sysconfig
        path = sysconfig.get_paths()["stdlib"]
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise TrainHeadError(f"--text {path!r} does not exist: give a text file, a directory of them, or stdlib")
    skip = ("test", "tests", "site-packages", "idlelib", "__pycache__", "lib2to3")
    return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
                  and not any(part in skip for part in f.relative_to(p).parts))


def _cut(text: str, limit: int = MAX_DOC_CHARS) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    end = max(text.rfind("\n\n", 0, limit), text.rfind(". ", 0, limit) + 1)
    return text[: end if end > MIN_DOC_CHARS else limit].rstrip()


def _functions(path: Path) -> Iterator[Tuple[str, str]]:
    """(signature + docstring source, docstring) of each documented function in one file."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)  # (then body[0] is the docstring)
        if not doc or not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS or node.body[0].end_lineno - node.lineno > 40:
            continue  # a prompt of the size HumanEval's are
        code = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])) + "\n"
        yield code, doc


def stdlib_prompts(kind: str, n: int, seed: int) -> List[str]:
    return list(islice(_stdlib(kind, seed), n))


def _stdlib(kind: str, seed: int) -> Iterator[str]:
    files = [f for f in text_files("stdlib") if f.suffix == ".py"]
    salt = KINDS.index(kind) + 1
    order = np.random.default_rng([seed, salt]).permutation(len(files))
    rng = np.random.default_rng([seed, salt, 1])
    for k in order:
        found = list(_functions(files[int(k)]))
        for j in rng.permutation(len(found))[:PER_FILE]:
            code, doc = found[int(j)]
            yield code if kind == "stdlib-code" else CHAT_ASKS[int(rng.integers(len(CHAT_ASKS)))].format(doc=_cut(doc))


def dataset_prompts(kind: str, seed: int) -> Iterator[Prompt]:
    """A dataset kind's prompts, seeded, taking its sources in turn so the first N cover the most."""
    from ..models.assets import fetch
    name, where, column = KIND_DATASETS[kind]
    with open(fetch(name), encoding="utf-8") as f:
        rows = [r for r in map(json.loads, f) if all(r.get(k) == v for k, v in where.items())]
    groups: Dict[str, list] = {}
    for r in rows:
        groups.setdefault(str(r.get(column)), []).append(r)
    rng = np.random.default_rng([seed, KINDS.index(kind) + 1])
    queues = [[g[int(i)] for i in rng.permutation(len(g))] for g in (groups[k] for k in sorted(groups))]
    queues = [queues[int(i)] for i in rng.permutation(len(queues))]
    for i in range(max(map(len, queues), default=0)):
        for q in queues:
            if i < len(q):
                yield _as_prompt(kind, q[i])


def _as_prompt(kind: str, row: dict) -> Prompt:
    if kind == "prose":
        return Raw(row["prompt"])
    return _cut(row["prompt"], WRITING_CHARS) if kind == "writing" else row["messages"]


def prompts_of(kind: str, seed: int) -> Iterator[Prompt]:
    return _stdlib(kind, seed) if kind.startswith("stdlib-") else dataset_prompts(kind, seed)


def render(tokenizer, prompts: Sequence[Prompt]) -> List[List[int]]:
    out = []
    bos = getattr(tokenizer, "bos_token", None)
    chat = bool(getattr(tokenizer, "chat_template", None))
    for p in prompts:
        if not isinstance(p, Raw):
            turns = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
            p = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False) if chat \
                else "\n\n".join(t["content"] for t in turns)
        add = not (isinstance(bos, str) and bos and p.startswith(bos))
        out.append(list(tokenizer.encode(p, add_special_tokens=add)))
    return out


def general_prompts(tokenizer, specs: Sequence[str], seed: int,
                    max_tokens: Optional[int] = None) -> Tuple[List[List[int]], List[str]]:
    """(prompt token lists, kind of each): of each spec's kind the first N of at most `max_tokens`
    tokens, kinds interleaved (a time limit on generation keeps a mix)."""
    per_kind = []
    for spec in specs:
        kind, n = parse_spec(spec)
        fits = (ids for (ids,) in (render(tokenizer, [p]) for p in prompts_of(kind, seed))
                if max_tokens is None or len(ids) <= max_tokens)
        per_kind.append((kind, list(islice(fits, n))))
    pairs = [(prompts[i], kind) for i in range(max((len(p) for _, p in per_kind), default=0))
             for kind, prompts in per_kind if i < len(prompts)]
    return [t for t, _ in pairs], [k for _, k in pairs]


def check_heldout(specs: Sequence[str], heldout: Sequence[str], data: Optional[str] = None):
    """Refuse a held-out set that the training data is, or that a --prompts kind trains on."""
    trained = {KIND_DATASETS[kind][0]: f"--prompts {kind}" for kind, _ in map(parse_spec, specs)
               if kind in KIND_DATASETS}
    if data is not None:
        trained[data] = "--data"
    for name in heldout:
        if name in trained:
            raise TrainHeadError(f"--heldout-data {name}: {trained[name]} trains on it; hold out another dataset "
                                 f"(e.g. {', '.join(HELDOUT_DATASETS[:4])})")
