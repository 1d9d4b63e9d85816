"""Our CUDA kernels built once per machine, not once per process, in a cache only this user can write.

MLX reads custom kernels from its PTX cache but never writes them (2.08 s of builds at a fresh run's
first MTP proposal, H200). `cuda_kernel` compiles each instantiation with NVRTC into that cache under
MLX's name, with a record of its hashes; whatever fails is left to MLX (the same program)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..paths import cache_dir
from .device import cuda_ready

_CTYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
           mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
           mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double"}
_TYPE_NAMES = {**_CTYPES, mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}  # in a kernel's name (get_type_string)
_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_UTILS = "mlx/backend/cuda/device/utils.cuh"
_COMPLEX = "mlx/backend/cuda/device/complex.cuh"
_SHAPE_INFO = (("Shape", "shape"), ("Strides", "strides"), ("int", "ndim"))
_MAX_FILE_NAME = 245  # MLX splits longer entry names into directories of this many characters
# instantiations this process found built, built (and seconds), or left to MLX
stats: Dict[str, object] = {"found": 0, "built": 0, "build_s": 0.0, "left_to_mlx": 0, "reasons": {}}
_NO_DISK_CACHE = "/dev/null/mlx-ptx"  # a directory MLX cannot create: it then keeps no kernels on disk
private_dir: Optional[Path] = None  # where our entries are written and trusted
off = "the kernel cache is not prepared (kernel_cache.prepare_cache_dir() runs at process start)"


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash of a std::string with these bytes (64-bit _Hash_bytes, seed 0xc70f6907)."""
    m, mask = 0xC6A4A7935BD1E995, (1 << 64) - 1
    n = len(data)
    h = (0xC70F6907 ^ (n * m)) & mask
    aligned = n & ~7
    for i in range(0, aligned, 8):
        k = (int.from_bytes(data[i:i + 8], "little") * m) & mask
        h = ((h ^ ((k ^ (k >> 47)) * m & mask)) * m) & mask
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * m) & mask
    h = ((h ^ (h >> 47)) * m) & mask
    return h ^ (h >> 47)


def _template_value(value) -> str:
    if isinstance(value, bool):
        return "t" if value else "f"
    return str(value) if isinstance(value, int) else _TYPE_NAMES[value]


def generated_source(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str,
                     inputs: Sequence[Tuple[mx.Dtype, int]], output_dtypes: Sequence[mx.Dtype],
                     template: Sequence[Tuple[str, object]]) -> Tuple[str, str]:
    """(function name, source) as MLX writes them; `inputs`: (dtype, ndim) each (KeyError: unnamed dtype)."""
    func = "custom_kernel_" + name + "".join("_" + _template_value(v) for _, v in template)
    lines = [_DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\n", "namespace cg = cooperative_groups;\n\n",
             f"__global__ void {func}(\n"]
    for n, (dtype, ndim) in zip(input_names, inputs):
        lines.append(f"    const {_CTYPES[dtype]}* {n},\n")
        if ndim > 0:
            lines += [f"    const __grid_constant__ {t} {n}_{s},\n" for t, s in _SHAPE_INFO if f"{n}_{s}" in source]
    lines.append(",\n".join(f"    {_CTYPES[dtype]}* {n}" for n, dtype in zip(output_names, output_dtypes)) + ") {\n")
    for n, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {n} = {'true' if v else 'false'};\n")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {n} = {v};\n")
        else:
            lines.append(f"  using {n} = {_CTYPES[v]};\n")
    if template:
        lines.append("\n")
    lines += [source, "\n}\n\n} // namespace mlx::core::cu\n"]
    return func, "".join(lines)


def entry_name(func: str, source: str) -> str:
    """MLX's name for a custom kernel's module: its name and the std::hash of its source."""
    return f"{func}_{std_hash(source.encode()):x}"


def check_private(path: Path) -> None:
    """Raise, saying why, unless `path` and the directories above it are safe from other users."""
    st, me = os.lstat(path), os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is not a directory{' but a symlink' if stat.S_ISLNK(st.st_mode) else ''}")
    if st.st_uid != me or st.st_mode & 0o022:
        raise RuntimeError(f"{path} is not private (uid {st.st_uid}, mode {st.st_mode & 0o777:o}; this user is "
                           f"uid {me}): make it 0700 and yours, or set MLX_PTX_CACHE_DIR to a directory that is")
    for parent in Path(os.path.abspath(path)).parents:
        st = os.stat(parent)
        if st.st_uid not in (0, me) or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX):
            raise RuntimeError(f"{parent}, above {path}, can be changed by another user")


def prepare_cache_dir() -> Optional[str]:
    """Give MLX's kernel cache a private directory before its first JIT build; None, or why not."""
    global private_dir, off
    own = os.environ.get("MLX_PTX_CACHE_DIR")
    own = None if own == _NO_DISK_CACHE else own  # a parent process's refusal: check again
    path = Path(own) if own else cache_dir() / "mlx-ptx" / mx.__version__
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(path)
    except (OSError, RuntimeError) as e:
        private_dir, off = None, f"kernel cache off: {e}"
        if not own:  # not MLX's shared default under /tmp either
            os.environ["MLX_PTX_CACHE_DIR"] = _NO_DISK_CACHE
        return off
    private_dir = path
    os.environ["MLX_PTX_CACHE_DIR"] = own or str(path)
    return None


def entry_path(directory: Path, module: str) -> Path:
    parts = [module[i:i + _MAX_FILE_NAME] for i in range(0, len(module), _MAX_FILE_NAME)] or [""]
    return directory.joinpath(*parts[:-1], parts[-1] + ".ptx")


def record_path(root: Path, source: str) -> Path:
    """The file of sums of `source`'s entry, named by the hash of all its build reads."""
    nvrtc, options, headers = compiler()
    texts = [source, repr(nvrtc.version), *options, *headers]
    key = hashlib.sha256(b"\0".join([t.encode() for t in texts] + list(headers.values()))).hexdigest()
    return root / "mtplx-records" / f"{key}.sha256"


def _sums(files: Dict[Path, bytes], root: Path) -> str:
    return "".join(sorted(f"{hashlib.sha256(data).hexdigest()}  {p.relative_to(root)}\n" for p, data in files.items()))


def trusted(root: Path, record: Path, path: Path) -> bool:
    try:
        files = {p: p.read_bytes() for p in (path, path.with_suffix(".txt"))}
        return record.read_text() == _sums(files, root)
    except OSError:
        return False


class _Nvrtc:

    def __init__(self):
        self.lib = self._load()
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        if self.version < (12, 0):
            raise RuntimeError(f"NVRTC {self.version} is older than 12.0")

    @staticmethod
    def _load():
        errors = []
        found = [str(f) for d in _package_dirs("lib") for f in sorted(d.glob("libnvrtc.so*"))]
        for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", *found]:
            try:
                return ctypes.CDLL(name)
            except OSError as e:
                errors.append(str(e))
        raise RuntimeError("no NVRTC library: " + "; ".join(errors))

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(code).decode()}")

    def compile(self, source: str, kernel: str, options: Sequence[str], headers: Dict[str, bytes]) -> Tuple[bytes, str]:
        lib, prog = self.lib, ctypes.c_void_p()
        names = list(headers)
        hdrs = (ctypes.c_char_p * len(names))(*[headers[n] for n in names])
        incl = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"mtplx_kernel.cu", len(names),
                                           hdrs, incl), "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            code = lib.nvrtcCompileProgram(prog, len(options), opts)
            if code != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC could not compile {kernel}: {log.value.decode(errors='replace')[:2000]}")
            mangled = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(mangled)), "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, mangled.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _package_dirs(sub: str) -> List[Path]:
    """<site>/nvidia/<cu13|cuda_runtime|cuda_nvrtc>/<sub> directories on sys.path and beside MLX."""
    roots = [Path(p) for p in sys.path if p] + [Path(mx.__file__).parent.parent]
    dirs = (r / "nvidia" / pkg / sub for r in roots for pkg in ("cu13", "cu12", "cuda_runtime", "cuda_nvrtc"))
    return list(dict.fromkeys(d for d in dirs if d.is_dir()))


def include_dirs() -> List[Path]:
    """MLX's bundled headers, then the CUDA runtime's, where MLX looks for them."""
    mlx_inc = Path(mx.__file__).parent / "include"
    dirs = [d for d in (mlx_inc, mlx_inc / "cccl") if d.is_dir()]
    homes = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cuda = [d for d in _package_dirs("include") + homes + [Path("/usr/local/cuda/include")] if (d / "cuda_fp16.h").exists()]
    if not cuda:
        raise RuntimeError("no CUDA headers (cuda_fp16.h) in an nvidia package, CUDA_HOME, CUDA_PATH or /usr/local/cuda")
    return dirs + cuda[:1]


def mlx_device_headers() -> Dict[str, bytes]:
    """MLX's utils.cuh and complex.cuh, embedded in libmlx (not shipped as files), by what each defines."""
    lib = Path(mx.__file__).parent / "lib" / "libmlx.so"
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        texts = set()
        for hit in re.finditer(rb"\0// Copyright", m):
            start = hit.start() + 1
            text = m[start:m.find(b"\0", start)]
            if b"#pragma once" in text:
                texts.add(text)
    found = {_UTILS: [t for t in texts if b'#include "' + _COMPLEX.encode() + b'"' in t
                      and b"struct Limits" in t and b"load_vector" in t],
             _COMPLEX: [t for t in texts if b"using complex64_t" in t and b'#include "' not in t]}
    for name, hits in found.items():
        if len(hits) != 1:
            raise RuntimeError(f"{len(hits)} texts in {lib} look like MLX's {name}")
    return {name: hits[0] for name, hits in found.items()}


def arch_option() -> str:
    info = mx.device_info()
    major, minor = info.get("compute_capability_major"), info.get("compute_capability_minor")
    if major is None:
        arch = str(info.get("architecture", ""))
        if not (arch.startswith("sm_") and arch[3:].isdigit() and len(arch) >= 5):
            raise RuntimeError(f"no compute capability in mx.device_info(): {info}")
        major, minor = int(arch[3:-1]), int(arch[-1])
    return f"--gpu-architecture=sm_{major}{minor}{'a' if int(major) >= 9 else ''}"


@functools.cache
def compiler() -> Tuple[_Nvrtc, List[str], Dict[str, bytes]]:
    nvrtc = _Nvrtc()
    return (nvrtc, ["--device-as-default-execution-space", arch_option()]
            + [f"--include-path={d}" for d in include_dirs()], mlx_device_headers())


def build(func: str, source: str, path: Path, root: Path, record: Path) -> None:
    """Compile; write the kernel-name file, the binary, then the record, each renamed into place (MLX
    never reads half)."""
    nvrtc, options, headers = compiler()
    kernel = "mlx::core::cu::" + func
    binary, mangled = nvrtc.compile(source, kernel, options, headers)
    files = {path.with_suffix(".txt"): f"{kernel}\t{mangled}\n".encode(), path: binary}
    files[record] = _sums(files, root).encode()
    for target, data in files.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)


class CachedKernel:
    """An mx.fast.cuda_kernel whose instantiations are in MLX's cache before their first call."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, shared_memory: int = 0):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header = source, header
        self._options = {"ensure_row_contiguous": ensure_row_contiguous, "shared_memory": shared_memory}
        self._mlx = None  # made at the first call: it exists only on CUDA
        self._seen = set()

    def __call__(self, *, inputs, output_dtypes, template=(), **kwargs):
        self.ensure(inputs, output_dtypes, template)
        if self._mlx is None:
            self._mlx = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names, output_names=self.output_names,
                                            source=self.source, header=self.header, **self._options)
        return self._mlx(inputs=inputs, output_dtypes=output_dtypes, template=template, **kwargs)

    def ensure(self, inputs, output_dtypes, template) -> None:
        arrays = [(a.dtype, a.ndim) if isinstance(a, mx.array) else None for a in inputs]
        key = (tuple(arrays), tuple(output_dtypes), tuple((n, v) for n, v in template))
        if key in self._seen:
            return
        self._seen.add(key)
        try:
            if None in arrays:
                raise KeyError("an input that is not an array")
            if private_dir is None:
                raise RuntimeError(off)
            if not cuda_ready():
                raise RuntimeError("not on CUDA")
            func, source = generated_source(self.name, self.input_names, self.output_names, self.source, self.header,
                                            arrays, output_dtypes, list(template))
            record, path = record_path(private_dir, source), entry_path(private_dir, entry_name(func, source))
            if trusted(private_dir, record, path):
                stats["found"] += 1
                return
            t0 = time.perf_counter()
            build(func, source, path, private_dir, record)
            stats["built"] += 1
            stats["build_s"] += time.perf_counter() - t0
        except Exception as e:  # MLX compiles it at its first call
            stats["left_to_mlx"] += 1
            reason = f"{type(e).__name__}: {e}"[:300]
            stats["reasons"][reason] = stats["reasons"].get(reason, 0) + 1


cuda_kernel = CachedKernel  # `mx.fast.cuda_kernel` with the same arguments, built once per machine
