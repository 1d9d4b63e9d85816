"""Every file, directory, `module.name` and job key that docs/architecture.md names exists.

The page's inline code and code blocks are read for names: `path.py` (a repository path, or a
file name found in mtplx/, pipelines/ or benchmarks/), `dir/`, dotted names (resolved with `ast`,
nothing imported: a module by a dotted suffix of its path, `rounds.Rounds.run` or
`cli.status.run_status`, or a top-level class or function of any module, `Scheduler.select`, then
its members: methods, class fields and the attributes its methods set on `self`) and job keys
(`speculative.depth`). Names from outside the repository are listed in OUTSIDE. The page's rule for
the kernels package is checked here too.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Set

from test_layers import graph
from test_layers import modules as package_modules

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("mtplx", "pipelines", "benchmarks")
OUTSIDE = {"mx", "mlx", "mlx_lm", "np", "ray"}  # first parts of names that are not the repository's
DATA_FILES = (".yaml", ".jsonl", ".json", ".parquet", ".md", ".npy", ".safetensors")  # named, not code
NAME = re.compile(r"[A-Za-z_][\w./-]*")


def modules() -> Dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    return {name: path for package in PACKAGES for name, path in package_modules(package).items()}


@lru_cache(maxsize=None)
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _targets(node) -> List[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def members(node) -> Dict[str, ast.AST]:
    """The names a module or class defines: functions, classes, assignments, imports; for a class also
    the attributes its methods set on `self`."""
    out = {}
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[child.name] = child
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name.split(".")[0], child) for a in child.names)
        for name in _targets(child):
            out[name] = child
    if isinstance(node, ast.ClassDef):
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        out.setdefault(t.attr, sub)
    return out


def resolves(node, rest: List[str]) -> bool:
    for part in rest:
        found = members(node).get(part) if isinstance(node, (ast.Module, ast.ClassDef)) else None
        if found is None:
            return False
        node = found
    return True


def job_keys() -> Set[str]:
    from pipelines.job.config import JobConfig

    out = set()
    for section, cls in typing.get_type_hints(JobConfig).items():
        out.add(section)
        if dataclasses.is_dataclass(cls):
            out.update(f"{section}.{f.name}" for f in dataclasses.fields(cls))
    return out


def code_names(text: str) -> List[str]:
    """The names in inline code and in fenced blocks."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", text, re.M | re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```\w*\n.*?^```", "", text, flags=re.M | re.S))
    out = []
    for snippet in blocks + inline:
        for word in NAME.findall(snippet):
            word = word.rstrip(".")
            if ".." in word:  # not a name: [d1..dK]
                continue
            if "." in word or word.endswith("/"):
                out.append(word)
    return out


def missing(word: str, mods: Dict[str, Path], keys: Set[str]) -> Optional[str]:
    """Why `word` names nothing, or None where it does (or is not the repository's to check)."""
    if word.endswith(DATA_FILES) or word.split(".")[0] in OUTSIDE:
        return None
    if word.endswith("/"):  # a directory of the repository or of a package
        found = (ROOT / word).is_dir() or any((ROOT / p / word).is_dir() for p in PACKAGES)
        return None if found else f"{word}: no such directory"
    if word.endswith(".py"):
        if "/" in word:
            return None if (ROOT / word).is_file() else f"{word}: no such file"
        found = any(p.name == word for p in mods.values()) or any((ROOT / "tests").glob(word))
        return None if found else f"{word}: no such file in {', '.join(PACKAGES)}"
    if "/" in word:
        return None  # a path outside the repository (RUN_DIR/...)
    if word in keys:
        return None
    parts = word.split(".")
    for n in range(len(parts), 0, -1):  # a module by a dotted suffix of its name, longest first
        prefix = ".".join(parts[:n])
        candidates = [m for m in mods if m == prefix or m.endswith("." + prefix)]
        if candidates:
            if any(resolves(tree(mods[m]), parts[n:]) for m in candidates):
                return None
            return f"{word}: {', '.join(candidates)} has no {'.'.join(parts[n:])}"
    # a class or function by its own name, in whichever module defines it
    owners = [m for m in mods if isinstance(members(tree(mods[m])).get(parts[0]), (ast.ClassDef, ast.FunctionDef))]
    if not owners:
        return f"{word}: no module, class or function of that name"
    return None if any(resolves(tree(mods[m]), parts) for m in owners) else f"{word}: {', '.join(owners)} lack it"


def test_every_name_on_the_page_exists():
    mods, keys = modules(), job_keys()
    names = code_names(PAGE.read_text(encoding="utf-8"))
    assert len(names) > 100, names  # the page names its modules and functions
    problems = sorted({p for p in (missing(w, mods, keys) for w in names) if p})
    assert not problems, "docs/architecture.md names what does not exist:\n" + "\n".join(problems)


def test_the_check_catches_a_wrong_name():
    mods, keys = modules(), job_keys()
    for wrong in ("rounds.Rounds.no_such_step", "Scheduler.no_such_rule", "mtplx/no_such.py", "no_such.py",
                  "execution.no_such_module.plan", "speculative.no_such_key"):
        assert missing(wrong, mods, keys), wrong
    for right in ("rounds.Rounds.run", "Scheduler.select", "Engine.counters", "kernels.device", "speculative.depth",
                  "mtplx/kernels/device.py", "sink.py", "drafting/"):
        assert missing(right, mods, keys) is None, right


def test_the_core_reaches_kernels_where_the_page_says():
    """Outside kernels/, the engine imports kernels.device and the package's install functions (the
    package imports its CUDA modules inside them); process.py also reaches kernel_cache."""
    reached = {"mtplx.kernels", "mtplx.kernels.device"}
    wrong = sorted(f"{a} -> {b}" for a, targets in graph("mtplx").items() if not a.startswith("mtplx.kernels")
                   for b in targets if b.startswith("mtplx.kernels")
                   and b not in reached | ({"mtplx.kernels.kernel_cache"} if a == "mtplx.process" else set()))
    assert not wrong, "the core imports kernel modules docs/architecture.md does not allow:\n" + "\n".join(wrong)
    top = [n for n in tree(ROOT / "mtplx" / "kernels" / "__init__.py").body
           if isinstance(n, (ast.Import, ast.ImportFrom)) and getattr(n, "module", None) != "__future__"]
    assert not top, "mtplx/kernels/__init__.py imports at load: the core would load every kernel module"
