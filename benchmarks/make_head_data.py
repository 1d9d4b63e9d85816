"""Prompts for training the default model's MTP head, with no HumanEval row among them.

The head for SmolLM2 is benchmarked on HumanEval, so it must not be trained there. Its training
prompts are code-completion prompts cut from the Python standard library (a function's
signature and docstring, the body left to the model) plus GSM8K and MMLU questions, all local.
`train-head` then self-distills: the model's own greedy continuations are the targets.

    python -m benchmarks.make_head_data --out benchmarks/data/head_train_prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

STDLIB_MODULES = [
    "textwrap", "string", "heapq", "bisect", "functools", "fractions", "statistics", "shlex", "difflib",
    "calendar", "colorsys", "fnmatch", "glob", "html/__init__", "ipaddress", "json/encoder", "pprint",
    "quopri", "random", "reprlib", "sched", "secrets", "shutil", "tabnanny", "tokenize", "uu", "wave",
    "zipapp", "base64", "binhex", "csv", "dataclasses", "enum", "graphlib", "gzip", "hmac", "imghdr",
    "inspect", "locale", "mimetypes", "netrc", "numbers", "operator", "optparse", "pathlib", "pickle",
    "platform", "plistlib", "posixpath", "queue", "selectors", "smtplib", "socket", "stat", "struct",
    "subprocess", "tempfile", "threading", "timeit", "trace", "types", "typing", "uuid", "weakref",
]


def code_prompts(limit: int):
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.name.startswith("_"):
                doc = node.body[0]
                head = "\n".join(lines[node.lineno - 1 : doc.end_lineno])
                indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
                head = "\n".join(l[indent:] for l in head.splitlines())
                if 40 <= len(head) <= 1500:
                    out.append({"id": f"stdlib/{name}/{node.name}/{node.lineno}", "prompt": head + "\n"})
    random.Random(0).shuffle(out)
    return out[:limit]


def question_prompts(name: str, limit: int):
    from mtplx.models.assets import resolve_asset

    rows = []
    with open(resolve_asset(name, "dataset")) as f:
        for line in f:
            row = json.loads(line)
            rows.append({"id": f"{name}/{row['id']}", "prompt": row["prompt"]})
    return rows[:limit]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/data/head_train_prompts.jsonl")
    ap.add_argument("--code", type=int, default=600)
    ap.add_argument("--questions", type=int, default=100)
    args = ap.parse_args()
    rows = code_prompts(args.code) + question_prompts("gsm8k-100", args.questions) + question_prompts("mmlu-1k", args.questions)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} prompts -> {out}")


if __name__ == "__main__":
    main()
