"""Everything mtplx does to the whole process; `import mtplx` does none of it.

`prepare_process()` (the CLI, the Ray predictor, `models.loading.load` and train-head call it), once:
1. binds OpenBLAS on a Linux CPU (blas.py), which works only before mlx.core is imported;
2. defers mlx-lm's package __init__ (it imports transformers: seconds): `sys.modules['mlx_lm']` is the
   package with its __init__ run only when a name other than a submodule is asked for;
3. on CUDA gives MLX's kernel cache a private directory (kernels/kernel_cache.py).
Installing a model's CUDA decode paths also points its mlx-lm modules at `rows_attention.attention`."""

from __future__ import annotations

import importlib.util
import sys
import types

from .blas import use_openblas


def prepare_process() -> None:
    use_openblas()
    _defer_mlx_lm_init()
    import mlx.core as mx  # (after the BLAS binding)
    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        from .kernels import kernel_cache
        if kernel_cache.private_dir is None:
            kernel_cache.prepare_cache_dir()


class _DeferredPackage(types.ModuleType):
    """The `mlx_lm` package with its __init__ not yet run."""

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
