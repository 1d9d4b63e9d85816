"""The import graph of the sources, read with `ast` (every import, inside functions too):
the engine (`mtplx`) never imports the job machinery (`pipelines`); the layers of `pipelines`
import only from their own layer or lower ones; neither package has an import cycle."""

import ast
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parent.parent

# The layers of pipelines/, lowest first: a module imports only from its own layer or lower ones.
LAYERS = ("errors", "job", "io", "execution", "cli")


def modules(package: str) -> Dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a package by its own name)."""
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path) -> Set[str]:
    """The absolute names module `name` (at `path`) imports: `from a import b` gives a and a.b."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def graph(package: str) -> Dict[str, Set[str]]:
    """Module -> the modules of the same package it imports (its own parent packages left out)."""
    mods = modules(package)
    edges = {}
    for name, path in mods.items():
        edges[name] = set()
        for target in imported(name, path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges[name].add(target)
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> int:
    """The layer of a pipelines module; the package itself sits below every layer."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    assert parts[1] in LAYERS, f"{module} is in no layer of {LAYERS}: add its package to LAYERS"
    return LAYERS.index(parts[1])


def test_the_engine_never_imports_pipelines():
    offenders = sorted(f"{name} -> {target}" for name, path in modules("mtplx").items()
                       for target in imported(name, path) if target.split(".")[0] == "pipelines")
    assert not offenders, "the engine imports pipelines:\n" + "\n".join(offenders)


def test_pipelines_imports_only_its_own_layer_or_lower():
    upward = sorted(f"{a} ({LAYERS[layer(a)]}) -> {b} ({LAYERS[layer(b)]})"
                    for a, targets in graph("pipelines").items() for b in targets if layer(b) > layer(a))
    assert not upward, f"upward imports (layers, lowest first: {' < '.join(LAYERS)}):\n" + "\n".join(upward)


def check_no_cycle(package: str) -> None:
    edges = graph(package)
    found = [f"{len(c)} modules: {' '.join(c)}\n" + "".join(f"    {a} -> {b}\n" for a in c for b in sorted(edges[a])
                                                          if b in c) for c in cycles(edges)]
    assert not found, f"import cycles in {package}/:\n" + "".join(found)


def test_no_import_cycle_in_mtplx():
    check_no_cycle("mtplx")


def test_no_import_cycle_in_pipelines():
    check_no_cycle("pipelines")
