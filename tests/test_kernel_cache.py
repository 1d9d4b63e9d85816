"""mtplx/kernels/kernel_cache.py: MLX's names for a custom kernel and its cache entry, the private
directory the cache lives in, and when an entry is trusted or built. The NVRTC compile itself needs MLX's
CUDA library, absent here: `FakeNvrtc` takes its place (the seam is `kc.compiler`), every file is real. The
compile is checked on the GPU host (benchmarks/kernel_cache_check: MLX's own generated source, MLX loading
the entries, first-call times)."""

import hashlib
import os

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


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not prepared the cache, with no MLX_PTX_CACHE_DIR of the user's."""
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setattr(kc, "private_dir", None)
    monkeypatch.setattr(kc, "off", kc.off)
    monkeypatch.setattr(kc, "stats", {"found": 0, "built": 0, "build_s": 0.0, "left_to_mlx": 0, "reasons": {}})


def test_the_cache_is_a_private_directory(fresh, tmp_path, monkeypatch):
    """By default MLX's cache moves from the shared /tmp to the user's cache, created 0700; a directory there
    that group or others can write, another user's or a symlink is refused (said in a line), and MLX is
    then given no disk cache rather than its shared default."""
    def prepare():  # in a fresh process: MLX_PTX_CACHE_DIR not set yet
        monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
        return kc.prepare_cache_dir()

    monkeypatch.setenv("MTPLX_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "cache" / "mlx-ptx" / mx.__version__
    assert prepare() is None
    assert kc.private_dir == mine and os.environ["MLX_PTX_CACHE_DIR"] == str(mine)
    assert mine.stat().st_mode & 0o777 == 0o700

    mine.chmod(0o770)
    assert "not private" in prepare() and "mode 770" in kc.off
    assert kc.private_dir is None and os.environ["MLX_PTX_CACHE_DIR"] == "/dev/null/mlx-ptx"
    mine.chmod(0o700)
    assert kc.prepare_cache_dir() is None  # a child process of the refused one checks again
    other = os.geteuid() + 1
    with monkeypatch.context() as m:  # the directory as another user's process sees it
        m.setattr(os, "geteuid", lambda: other)
        assert f"this user is uid {other}" in prepare() and kc.private_dir is None

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    mine.rmdir()
    mine.symlink_to(elsewhere)
    assert "not a directory but a symlink" in prepare() and kc.private_dir is None


def test_the_users_own_cache_dir_is_kept_and_checked(fresh, tmp_path, monkeypatch):
    """MLX_PTX_CACHE_DIR of the user's stays what MLX uses; we write there only if it passes the same
    checks, including the directories above it (one anyone may change, not sticky, is refused)."""
    own = tmp_path / "own" / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(own))
    assert kc.prepare_cache_dir() is None and kc.private_dir == own
    assert own.stat().st_mode & 0o777 == 0o700 and os.environ["MLX_PTX_CACHE_DIR"] == str(own)
    own.chmod(0o755)
    assert kc.prepare_cache_dir() is None  # readable by others, writable only by us
    own.chmod(0o757)
    assert "not private" in kc.prepare_cache_dir() and os.environ["MLX_PTX_CACHE_DIR"] == str(own)
    own.chmod(0o700)
    (tmp_path / "own").chmod(0o777)
    assert "can be changed by another user" in kc.prepare_cache_dir() and kc.private_dir is None
    (tmp_path / "own").chmod(0o777 | 0o1000)  # sticky, as /tmp: others cannot rename what is ours
    assert kc.prepare_cache_dir() is None


class FakeNvrtc:
    """NVRTC in build(): compiling needs CUDA, absent here. A "cubin" that depends on source and options."""
    version = (13, 0)

    def __init__(self):
        self.options = ["--device-as-default-execution-space", "--gpu-architecture=sm_90a"]
        self.compiled = []

    def compile(self, source, kernel, options, headers):
        self.compiled.append(kernel.rsplit("::", 1)[1])
        return hashlib.sha256((source + "".join(options)).encode()).digest(), "_Z6mangled"


@pytest.fixture
def nvrtc(fresh, tmp_path, monkeypatch):
    """A prepared private cache at tmp_path/ptx, on "CUDA", with FakeNvrtc as the compiler."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert kc.prepare_cache_dir() is None
    fake = FakeNvrtc()
    monkeypatch.setattr(kc, "cuda_ready", lambda: True)
    monkeypatch.setattr(kc, "compiler", lambda: (fake, fake.options, {"utils.cuh": b"// MLX's header"}))
    return fake


def _kernel():
    return kc.cuda_kernel("demo", ["x"], ["out"], "  out[0] = x[0];")


def test_an_instantiation_is_built_once_per_machine(nvrtc, tmp_path):
    """The first process that meets an instantiation builds its entry and record (once, whatever the
    calls); a later process (a new kernel object, as after a restart) finds it; another template is
    another entry; a call builds its instantiation before MLX runs it."""
    x = mx.zeros((4,), mx.float16)
    k = _kernel()
    for _ in range(3):
        k.ensure([x], [mx.float16], [("T", mx.float16)])
    assert nvrtc.compiled == ["custom_kernel_demo_float16_t"] and kc.stats["built"] == 1
    entry = next((tmp_path / "ptx").glob("*.ptx"))
    assert entry.with_suffix(".txt").read_text() == "mlx::core::cu::custom_kernel_demo_float16_t\t_Z6mangled\n"
    record = next((tmp_path / "ptx" / "mtplx-records").glob("*.sha256")).read_text()
    assert record == "".join(sorted(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                                    for p in (entry, entry.with_suffix(".txt"))))  # as sha256sum writes it
    _kernel().ensure([x], [mx.float16], [("T", mx.float16)])
    assert nvrtc.compiled == ["custom_kernel_demo_float16_t"] and kc.stats["found"] == 1
    _kernel().ensure([x.astype(mx.float32)], [mx.float32], [("T", mx.float32)])
    assert nvrtc.compiled[-1] == "custom_kernel_demo_float" and kc.stats["built"] == 2
    with pytest.raises(RuntimeError):  # the call goes on to MLX, which has no CUDA here
        _kernel()(inputs=[x], output_dtypes=[mx.float16], template=[("T", mx.bfloat16)], grid=(1, 1, 1),
                  threadgroup=(1, 1, 1), output_shapes=[(4,)])
    assert nvrtc.compiled[-1] == "custom_kernel_demo_bfloat16_t" and kc.stats["built"] == 3


def test_only_entries_we_wrote_unchanged_are_trusted(nvrtc, tmp_path):
    """An entry whose binary or kernel names changed after we wrote it, one we never wrote (an entry of
    MLX's name without our record) and one built with other options (another architecture) are each
    built again before MLX loads them, replacing the file."""
    x = mx.zeros((4,), mx.float16)
    args = ([x], [mx.float16], [("T", mx.float16)])
    _kernel().ensure(*args)
    entry = next((tmp_path / "ptx").glob("*.ptx"))
    good = entry.read_bytes()
    for tampered, data in ((entry, b"someone else's cubin"), (entry.with_suffix(".txt"), b"k\t_Z5other\n")):
        tampered.write_bytes(data)
        _kernel().ensure(*args)
        assert entry.read_bytes() == good and entry.with_suffix(".txt").read_text().endswith("\t_Z6mangled\n")
    assert len(nvrtc.compiled) == 3 and kc.stats["found"] == 0

    for record in (tmp_path / "ptx" / "mtplx-records").iterdir():  # the entry as MLX or anyone else left it
        record.unlink()
    _kernel().ensure(*args)
    assert len(nvrtc.compiled) == 4 and entry.read_bytes() == good
    _kernel().ensure(*args)
    assert len(nvrtc.compiled) == 4 and kc.stats["found"] == 1

    nvrtc.options[1] = "--gpu-architecture=sm_80"
    _kernel().ensure(*args)
    assert len(nvrtc.compiled) == 5 and entry.read_bytes() != good


def test_nothing_is_trusted_in_a_cache_that_is_not_prepared(fresh, tmp_path, monkeypatch):
    """Without prepare_cache_dir() (or after it refused), no entry is looked up or written: MLX compiles."""
    monkeypatch.setattr(kc, "cuda_ready", lambda: True)
    _kernel().ensure([mx.zeros((4,), mx.float16)], [mx.float16], [("T", mx.float16)])
    assert kc.stats["left_to_mlx"] == 1 and "not prepared" in next(iter(kc.stats["reasons"]))


def test_what_cannot_be_built_is_left_to_mlx(fresh, tmp_path, monkeypatch):
    """A build that fails (here: no CUDA) writes nothing and says why; MLX then compiles it itself."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert kc.prepare_cache_dir() is None
    _kernel().ensure([mx.zeros((4,), mx.float16)], [mx.float16], [("T", mx.float16)])
    assert kc.stats["left_to_mlx"] == 1 and "not on CUDA" in next(iter(kc.stats["reasons"]))
    assert not list(tmp_path.iterdir())
