"""General prompts for self-distillation (`train-head --prompts KIND:N`), built from the standard
library source that every machine has, so one head sees the trunk write more than the job's kind
of text.

- `stdlib-code:N`: N functions cut to their signature and docstring (the shape of a HumanEval
  prompt); the trunk writes the body.
- `stdlib-chat:N`: N docstrings' prose put as a question (explain, give an example, step by
  step); the trunk writes an answer in words.

Prompts are picked from a seeded shuffle of the stdlib's files (tests and site-packages skipped),
rendered through the model's chat template where it has one, as a job's rows are.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

import numpy as np

from .config import KINDS, TrainHeadError, parse_spec

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
MAX_DOC_CHARS = 1200  # longer docstrings are cut at a paragraph end (prompts stay shorter than the answer)
MIN_DOC_CHARS = 40  # "Return x." teaches nothing
PER_FILE = 16  # functions taken from one file at most

CHAT_ASKS = (
    "Explain in simple words what the following describes, then give a short example:\n\n{doc}",
    "Here is some documentation:\n\n{doc}\n\nSummarize it step by step.",
    "Answer step by step: how would I use this, and what should I watch out for?\n\n{doc}",
    "Rewrite the following as a short tutorial for a beginner:\n\n{doc}",
)


def text_files(path: str) -> List[Path]:
    """The text files of `path`: itself, every text file under a directory, or for `stdlib` the
    running Python's standard library source (on every machine)."""
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


def _cut_doc(doc: str) -> str:
    doc = doc.strip()
    if len(doc) <= MAX_DOC_CHARS:
        return doc
    end = doc.rfind("\n\n", 0, MAX_DOC_CHARS)
    return doc[: end if end > MIN_DOC_CHARS else MAX_DOC_CHARS].rstrip()


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
        doc = ast.get_docstring(node)
        first = node.body[0] if node.body else None
        if not doc or len(doc) < MIN_DOC_CHARS or first is None or first.end_lineno is None:
            continue
        if len(doc) > MAX_DOC_CHARS or first.end_lineno - node.lineno > 40:
            continue  # a prompt of the size HumanEval's are
        code = textwrap.dedent("\n".join(lines[node.lineno - 1 : first.end_lineno])) + "\n"
        yield code, doc


def stdlib_prompts(kind: str, n: int, seed: int) -> List[str]:
    """n user messages of `kind` from a seeded shuffle of the stdlib's .py files (fewer if it has fewer)."""
    files = [f for f in text_files("stdlib") if f.suffix == ".py"]
    salt = KINDS.index(kind) + 1  # each kind its own draw of functions
    order = np.random.default_rng([seed, salt]).permutation(len(files))
    rng = np.random.default_rng([seed, salt, 1])
    out: List[str] = []
    for k in order:
        found = list(_functions(files[int(k)]))
        if not found:
            continue
        # a few per file, so N prompts cover many modules
        for j in rng.permutation(len(found))[:PER_FILE]:
            code, doc = found[int(j)]
            if kind == "stdlib-code":
                out.append(code)
            else:
                out.append(CHAT_ASKS[int(rng.integers(len(CHAT_ASKS)))].format(doc=_cut_doc(doc)))
            if len(out) >= n:
                return out
    return out


def render(tokenizer, messages: Sequence[str]) -> List[List[int]]:
    """Token ids of each user message, through the chat template when the tokenizer has one (no
    second BOS when the rendered text starts with one, as a job renders its rows)."""
    out = []
    bos = getattr(tokenizer, "bos_token", None)
    chat = bool(getattr(tokenizer, "chat_template", None))
    for m in messages:
        text = tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                             tokenize=False) if chat else m
        add = not (isinstance(bos, str) and bos and text.startswith(bos))
        out.append(list(tokenizer.encode(text, add_special_tokens=add)))
    return out


def general_prompts(tokenizer, specs: Sequence[str], seed: int) -> Tuple[List[List[int]], List[str]]:
    """(prompt token lists, kind of each) for the `--prompts` specs, the kinds interleaved (so a
    time limit on generation keeps a mix)."""
    per_kind = []
    for spec in specs:
        kind, n = parse_spec(spec)
        per_kind.append((kind, render(tokenizer, stdlib_prompts(kind, n, seed))))
    pairs = [(prompts[i], kind) for i in range(max((len(p) for _, p in per_kind), default=0))
             for kind, prompts in per_kind if i < len(prompts)]
    return [t for t, _ in pairs], [k for _, k in pairs]
