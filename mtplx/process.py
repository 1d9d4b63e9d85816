"""Everything mtplx does to the whole process; `import mtplx` does none of it.

`prepare_process()` does, once per process:

1. BLAS (blas.py): on a Linux CPU it opens OpenBLAS with RTLD_GLOBAL, so libmlx's BLAS calls
   bind to it instead of mlx-cpu's reference BLAS (about 15x slower). Python opens extension
   modules with RTLD_NOW, so libmlx binds its BLAS symbols when mlx.core is imported: OpenBLAS
   wins only when it is opened before that import. The CLI calls prepare_process() before
   anything imports mlx.core, and the Ray predictor before it builds its engine; a library user
   calls it before importing mlx.core or mtplx's engine modules. Called later, it binds nothing
   and `blas.slow_blas_notice()` says what to do.
2. mlx-lm's package __init__ is deferred: `sys.modules['mlx_lm']` becomes the package with its
   __init__ not yet run. That __init__ imports transformers (and torch where installed), seconds
   before the first token; the engine needs only `mlx_lm.models.*`. Any other name
   (`mlx_lm.load`, `from mlx_lm import generate`, `mlx_lm.__version__`) runs the real __init__
   first, so mlx-lm's own API works as usual. Nothing is deferred once mlx_lm is imported.
3. MLX's CUDA kernel cache (kernels/kernel_cache.py): where the user has not set MLX_PTX_CACHE_DIR,
   it points MLX at a private per-user directory (0700, owner checked), where our own kernels'
   entries are kept with a record of their hashes. MLX reads the variable at its first CUDA kernel
   build, so this runs before the model loads; on a machine without CUDA it does nothing.

It also runs where a model is loaded (`models.loading.load`) and a head is trained, which covers
the mlx-lm deferral for an `Engine.load` however mtplx was imported.

One more process-wide change is made with the CUDA kernels, when a model's decode paths are
installed (`kernels.install` -> `rows_attention.install`): the mlx-lm model modules that model
uses get `rows_attention.attention` as their `scaled_dot_product_attention`, which calls mlx-lm's
own function for every cache but the engine's row caches.
"""

from __future__ import annotations

import importlib.util
import sys
import types

from .blas import use_openblas


def prepare_process() -> None:
    """Bind OpenBLAS where it still can, defer mlx-lm's package __init__ and give MLX's CUDA kernel
    cache a private directory (see above)."""
    use_openblas()
    _defer_mlx_lm_init()
    import mlx.core as mx  # (after the BLAS binding)

    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        from .kernels import kernel_cache

        if kernel_cache.private_dir is None:
            kernel_cache.prepare_cache_dir()


class _DeferredPackage(types.ModuleType):
    """The `mlx_lm` package with its __init__ not yet run: submodules import without it, any other
    name runs it first."""

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
