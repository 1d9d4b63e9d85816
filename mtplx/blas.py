"""OpenBLAS for MLX on a Linux CPU, loaded into the process before mlx.core.

mlx-cpu links a reference BLAS; OpenBLAS opened with RTLD_GLOBAL before mlx.core binds libmlx's calls
(a 1024 x 1024 matmul: 22 ms, not 370): one already loaded, the `ngsolve-openblas` wheel, or the
system's. One BLAS thread by default leaves the other core to tokenizing and the job machinery."""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional

SYSTEM_OPENBLAS = ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
                   "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0")
PIP_PACKAGE = "ngsolve-openblas"


@dataclass(frozen=True)
class BlasInfo:
    library: Optional[str]  # the OpenBLAS MLX uses; None: MLX's bundled reference BLAS
    detail: str  # OpenBLAS's own config string, or why none is in use
    fix: str = (f"install OpenBLAS with: pip install {PIP_PACKAGE} (the `cpu` extra has it), "
                "or apt-get install libopenblas0-pthread")

    @property
    def fast(self) -> bool:
        return self.library is not None or not sys.platform.startswith("linux")


@functools.cache
def use_openblas() -> BlasInfo:
    if not sys.platform.startswith("linux"):
        return BlasInfo(None, "not Linux: MLX uses the platform's BLAS")
    mapped = _mapped_openblas()
    if mapped is not None:
        return BlasInfo(mapped, _config(ctypes.CDLL(mapped)))
    if "mlx.core" in sys.modules:
        return BlasInfo(None, "mlx.core was imported before OpenBLAS could be bound",
                        "call mtplx.process.prepare_process() before anything imports mlx.core")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    errors: List[str] = []
    found = _package_files(PIP_PACKAGE.replace("-", "_"), "libopenblas*.so*")
    for path in found + [p for p in SYSTEM_OPENBLAS if os.path.exists(p)]:
        try:
            lib = _open(path)
            return BlasInfo(lib._name, _config(lib))
        except OSError as e:
            errors.append(f"{path}: {e}")
    return BlasInfo(None, "; ".join(errors) or "no OpenBLAS installed")


def slow_blas_notice() -> Optional[str]:
    """One line for the user when MLX's CPU matmuls run on the slow bundled BLAS, else None."""
    info = use_openblas()  # (before mlx.core is imported: it binds OpenBLAS where it still can)
    if info.fast:
        return None
    import mlx.core as mx
    if mx.default_device() != mx.cpu:
        return None
    return f"note: MLX is using its bundled reference BLAS, about 15x slower on a CPU ({info.detail}); {info.fix}"


def _mapped_openblas() -> Optional[str]:
    """An OpenBLAS with the standard symbols already in the process (not numpy's cblas_sgemm64_)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.rstrip("\n").split(" ", 5)[-1].strip() for line in f}
    except OSError:
        return None
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libopenblas")):
        try:
            if hasattr(ctypes.CDLL(path), "cblas_sgemm"):
                return path
        except OSError:
            continue
    return None


def _package_files(name: str, pattern: str) -> List[str]:
    """The files matching `pattern` in any directory of the top-level package `name`, found without
    importing it. `mlx` is a namespace package: a folder named mlx on sys.path (a kernel cache in
    /tmp, a checkout) is one of its directories too."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(os.path.normpath(p) for d in dirs for p in glob.glob(os.path.join(d, pattern)))


def _open(path: str) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        if "libgfortran.so.5" not in str(e):
            raise
        return ctypes.CDLL(os.path.join(_link_dir(path), "libopenblas.so.0"), mode=ctypes.RTLD_GLOBAL)


def _link_dir(openblas: str) -> str:
    """A directory of links to `openblas` and mlx-cpu's libgfortran, as the wheel's RPATH asks."""
    bundled = _package_files("mlx", os.path.join(os.pardir, "mlx_cpu.libs", "*.so*"))
    gfortran = [p for p in bundled if os.path.basename(p).startswith("libgfortran")]
    if not gfortran:
        raise OSError(f"{openblas} needs libgfortran.so.5, which neither the system nor mlx-cpu has "
                      "(apt-get install libgfortran5)")
    links = {"libopenblas.so.0": openblas, "libgfortran.so.5": gfortran[0]}
    links.update({os.path.basename(p): p for p in bundled
                  if not os.path.basename(p).startswith(("libblas", "liblapack", "libgfortran"))})
    from .paths import cache_dir
    key = hashlib.sha256(repr(sorted(links.items())).encode()).hexdigest()[:12]
    parent = cache_dir() / "openblas"
    final = parent / key
    if not final.is_dir():
        parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
        for name, target in links.items():
            os.symlink(target, os.path.join(tmp, name))
        try:
            os.rename(tmp, final)  # atomic: concurrent processes agree on one complete directory
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.is_dir():
                raise
    return str(final)


def _config(lib: ctypes.CDLL) -> str:
    fn = getattr(lib, "openblas_get_config", None)
    if fn is None:
        return "OpenBLAS"
    fn.restype = ctypes.c_char_p
    return (fn() or b"OpenBLAS").decode(errors="replace").strip()
