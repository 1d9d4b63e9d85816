"""OpenBLAS from pip is what MLX's CPU matmuls run on after `prepare_process()` (mtplx/blas.py)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from jobkit import job_dict, read_output, sample_rows, write_job, write_parquet

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="the cpu extra pins ngsolve-openblas on Linux x86_64 only",
)

# Times 512x512 float32 matmuls; prints what mtplx.blas says is in use and a checksum.
PROBE = """
import json, sys, time
if sys.argv[1] == "mlx-first":
    import mlx.core  # binds libmlx to its bundled BLAS before mtplx can offer OpenBLAS
import mtplx.blas
from mtplx.process import prepare_process
prepare_process()
import mlx.core as mx
mx.random.seed(0)
a = mx.random.normal((512, 512)); b = mx.random.normal((512, 512))
mx.eval(a @ b)
t = time.perf_counter()
for _ in range(8):
    c = a @ b
    mx.eval(c)
info = mtplx.blas.use_openblas()
print(json.dumps({"seconds": time.perf_counter() - t, "library": info.library, "detail": info.detail,
                  "notice": mtplx.blas.slow_blas_notice(), "checksum": c[:4, :4].tolist()}))
"""


def _probe(mode: str, cache: Path, cwd=None) -> dict:
    env = dict(os.environ, MTPLX_CACHE=str(cache), PYTHONPATH=str(ROOT))
    env.pop("LD_PRELOAD", None)
    env.pop("OPENBLAS_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True,
                         timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prepare_process_binds_mlx_to_pip_openblas(tmp_path):
    fast = _probe("prepared-first", tmp_path / "cache")
    slow = _probe("mlx-first", tmp_path / "cache")
    assert fast["library"] and "libopenblas" in fast["library"], fast
    assert "OpenBLAS" in fast["detail"] and fast["notice"] is None
    assert slow["library"] is None and slow["notice"].startswith("note: MLX is using its bundled reference BLAS")
    assert "prepare_process() before anything imports mlx.core" in slow["notice"]
    # the same products, summed in another order
    import numpy as np

    np.testing.assert_allclose(np.array(fast["checksum"]), np.array(slow["checksum"]), rtol=1e-4, atol=1e-3)


def test_a_folder_named_mlx_on_the_path_does_not_hide_mlx_cpu(tmp_path):
    """`mlx` is a namespace package: a folder of that name where Python starts (MLX's kernel cache in
    /tmp, say) is a directory of it too, and mlx-cpu's libraries are looked for beside each."""
    (tmp_path / "mlx").mkdir()
    got = _probe("prepared-first", tmp_path / "cache", cwd=tmp_path)
    assert got["library"] and "libopenblas" in got["library"] and got["notice"] is None, got


def test_link_directory_supplies_libgfortran(tmp_path):
    """Without a system libgfortran.so.5, the links in the cache make the wheel's OpenBLAS load."""
    fast = _probe("prepared-first", tmp_path / "cache")
    if not fast["library"].startswith(str(tmp_path)):
        pytest.skip("this machine has a libgfortran.so.5 of its own: no link directory needed")
    links = {p.name: os.readlink(p) for p in Path(fast["library"]).parent.iterdir()}
    assert "libgfortran.so.5" in links and "mlx_cpu.libs" in links["libgfortran.so.5"]
    assert "ngsolve_openblas" in links["libopenblas.so.0"]


def test_run_prints_one_line_notice_on_the_bundled_blas(tiny_model, tmp_path):
    model = tiny_model("llama")
    data = write_parquet(tmp_path / "in.parquet", sample_rows(2))
    job = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run", generation={"max_tokens": 2}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LD_PRELOAD", None)
    slow = "import mlx.core, sys; from pipelines.cli.commands import main; main(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", slow, "run", str(job)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if "bundled reference BLAS" in line]
    assert len(notes) == 1, out.stderr
    assert len(read_output(tmp_path / "run")) == 2
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(job), "--restart"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "bundled reference BLAS" not in out.stderr
