"""mtplx/kernels/kernel_cache.py: MLX's names for a custom kernel and its cache entry, and when an entry
is built. The NVRTC compile itself needs MLX's CUDA library (checked on the GPU host, against MLX's own
generated source and first-call times)."""

import mlx.core as mx
import pytest

from mtplx.kernels import kernel_cache as kc


def test_std_hash_names_mlx_kernels_as_mlx_does(tmp_path, monkeypatch):
    """MLX names a fused kernel by its ops and the std::hash of its constants as printed (here 3,
    1234567 and 7 in the order they enter: "312345677"); the CPU backend writes the library under
    that name. An empty string hashes to the suffix of every kernel without constants."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    f = mx.compile(lambda x: (x + 3) * 1234567 - 7)
    mx.eval(f(mx.ones((5,), mx.int32)))
    libs = [p.name for p in tmp_path.glob("mlx/*/cpu/*.so")]
    assert libs and all(f"_{kc.std_hash(b'312345677')}_" in n for n in libs), libs
    assert kc.std_hash(b"") == 6142509188972423790


def test_generated_source_is_mlx_layout():
    """The source MLX's CUDA backend writes for a custom kernel: its default header, ours, the
    signature (inputs const, an input's shape where the body reads it, then outputs), the template
    as constants, the body. Its name carries the template (bools as t/f, dtypes by MLX's names)."""
    func, src = kc.generated_source(
        "demo", ["x", "n"], ["out"], "  out[0] = x[0] + x_shape[0] + N;", "// ours\n",
        [(mx.float16, 2), (mx.int32, 1)], [mx.float16], [("T", mx.float16), ("N", 3), ("ON", True)])
    assert func == "custom_kernel_demo_float16_t_3_t"
    assert src == ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n// ours\n'
                   "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                   "__global__ void custom_kernel_demo_float16_t_3_t(\n"
                   "    const __half* x,\n    const __grid_constant__ Shape x_shape,\n    const int32_t* n,\n"
                   "    __half* out) {\n  using T = __half;\n  constexpr int N = 3;\n  constexpr bool ON = true;\n\n"
                   "  out[0] = x[0] + x_shape[0] + N;\n}\n\n} // namespace mlx::core::cu\n")
    assert kc.entry_name(func, src) == f"{func}_{kc.std_hash(src.encode()):x}"


def test_long_entry_names_become_directories(tmp_path):
    name = "k" * 300
    assert kc.entry_path(tmp_path, name) == tmp_path / ("k" * 245) / ("k" * 55 + ".ptx")
    assert kc.entry_path(tmp_path, "short") == tmp_path / "short.ptx"


def _kernel():
    return kc.cuda_kernel("demo", ["x"], ["out"], "  out[0] = x[0];")


def test_an_instantiation_is_built_once_per_machine(tmp_path, monkeypatch):
    """The first process that meets an instantiation builds its entry (once, whatever the calls);
    a later process (a new kernel object, as after a restart) finds it; another template is
    another entry; a call builds its instantiation before MLX runs it."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kc, "cuda_ready", lambda: True)
    built = []

    def build(func, source, directory=None):  # what kc.build writes, without NVRTC
        built.append(func)
        path = kc.entry_path(kc.ptx_dir(), kc.entry_name(func, source))
        kc.write_entry(path, "mlx::core::cu::" + func, "mangled", b"cubin")
        return path

    monkeypatch.setattr(kc, "build", build)
    monkeypatch.setattr(kc, "stats", {"found": 0, "built": 0, "build_s": 0.0, "left_to_mlx": 0, "reasons": {}})
    x = mx.zeros((4,), mx.float16)
    k = _kernel()
    for _ in range(3):
        k.ensure([x], [mx.float16], [("T", mx.float16)])
    assert built == ["custom_kernel_demo_float16_t"] and kc.stats["built"] == 1
    entry = next(tmp_path.glob("*.ptx"))
    assert entry.read_bytes() == b"cubin"
    assert entry.with_suffix(".txt").read_text() == "mlx::core::cu::custom_kernel_demo_float16_t\tmangled\n"
    _kernel().ensure([x], [mx.float16], [("T", mx.float16)])
    assert built == ["custom_kernel_demo_float16_t"] and kc.stats["found"] == 1
    _kernel().ensure([x.astype(mx.float32)], [mx.float32], [("T", mx.float32)])
    assert built[-1] == "custom_kernel_demo_float" and kc.stats["built"] == 2
    with pytest.raises(RuntimeError):  # the call goes on to MLX, which has no CUDA here
        _kernel()(inputs=[x], output_dtypes=[mx.float16], template=[("T", mx.bfloat16)], grid=(1, 1, 1),
                  threadgroup=(1, 1, 1), output_shapes=[(4,)])
    assert built[-1] == "custom_kernel_demo_bfloat16_t" and kc.stats["built"] == 3


def test_what_cannot_be_built_is_left_to_mlx(tmp_path, monkeypatch):
    """A build that fails (here: no CUDA) writes nothing and says why; MLX then compiles it itself."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kc, "stats", {"found": 0, "built": 0, "build_s": 0.0, "left_to_mlx": 0, "reasons": {}})
    _kernel().ensure([mx.zeros((4,), mx.float16)], [mx.float16], [("T", mx.float16)])
    assert kc.stats["left_to_mlx"] == 1 and "not on CUDA" in next(iter(kc.stats["reasons"]))
    assert not list(tmp_path.iterdir())
