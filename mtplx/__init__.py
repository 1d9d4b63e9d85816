"""mtplx: the MLX generation engine behind mtplx-batch."""

import importlib.util
import sys
import types

from .blas import use_openblas

__version__ = "0.1.0"

use_openblas()  # before anything imports mlx.core (mtplx/blas.py says why)


class _DeferredPackage(types.ModuleType):
    """The `mlx_lm` package with its __init__ not yet run.

    mlx_lm/__init__.py imports its generate and convert modules, which import transformers (and,
    where it is installed, torch): seconds before the first token. The engine needs only
    `mlx_lm.models.*`, so submodules import without it; any other name (`mlx_lm.load`,
    `from mlx_lm import batch_generate`, `mlx_lm.__version__`) runs the real __init__ first, so
    code that uses mlx-lm's own API sees the package as usual.
    """

    _IMPORT_NAMES = frozenset({"__path__", "__spec__", "__name__", "__loader__", "__package__", "__file__",
                               "__cached__", "__dict__", "__class__", "models"})

    def __getattribute__(self, name):
        if name not in _DeferredPackage._IMPORT_NAMES:
            self.__class__ = types.ModuleType
            self.__spec__.loader.exec_module(self)
        return types.ModuleType.__getattribute__(self, name)


def _defer_mlx_lm_init() -> None:
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return
    pkg = importlib.util.module_from_spec(spec)
    pkg.__class__ = _DeferredPackage
    sys.modules["mlx_lm"] = pkg


_defer_mlx_lm_init()
