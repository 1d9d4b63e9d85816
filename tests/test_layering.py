"""The engine (`mtplx`) stands without the job machinery (`pipelines`): every mtplx module imports
with `pipelines` made unimportable, and no mtplx source imports it, not even inside a function."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BLOCK_AND_IMPORT = r"""
import importlib, importlib.abc, pkgutil, sys

class NoPipelines(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pipelines" or name.startswith("pipelines."):
            raise ImportError(f"the engine imported {name}")
        return None

sys.meta_path.insert(0, NoPipelines())
import mtplx
names = [m.name for m in pkgutil.walk_packages(mtplx.__path__, "mtplx.")]
for name in names:
    importlib.import_module(name)
assert not any(m == "pipelines" or m.startswith("pipelines.") for m in sys.modules)
print(len(names))
"""


def test_every_engine_module_imports_without_pipelines():
    res = subprocess.run([sys.executable, "-c", BLOCK_AND_IMPORT], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip()) >= 20  # every module was reached (mtplx has more than 20)


def test_no_engine_source_imports_pipelines():
    offenders = []
    for path in sorted((REPO / "mtplx").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                          if n == "pipelines" or n.startswith("pipelines.")]
    assert offenders == []
