"""The engine (`mtplx`) stands without the job machinery (`pipelines`): every mtplx module imports
with `pipelines` made unimportable (test_layers.py reads the sources for the same)."""

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

