"""Importing mtplx or pipelines changes nothing in the process; the CLI, the Ray predictor and a
model's load make the changes mtplx/process.py lists."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobkit import job_dict, sample_rows, write_job, write_parquet

ROOT = Path(__file__).resolve().parent.parent

# What a process looks like: is mlx_lm deferred, and is an OpenBLAS mapped in (Linux only).
STATE = """
def state():
    import json, os, sys, types
    m = sys.modules.get("mlx_lm")
    real = m is None or (type(m) is types.ModuleType and "load" in vars(m))  # vars(): no deferred __init__ runs
    maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
    libs = {os.path.basename(line.split()[-1]) for line in maps.splitlines() if "/" in line}
    return json.dumps({"mlx_lm_real": real, "openblas": any(n.startswith("libopenblas") for n in libs)})
"""


def _run(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", STATE + code, *args], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_imports_change_nothing():
    got = _run("import mtplx, pipelines, pipelines.cli, pipelines.execution.ray_engine\n"
               "import mtplx.models.loading, mtplx.models.mtp, mtplx.generation, mtplx.training.train_head\n"
               "print(state())")
    assert got == {"mlx_lm_real": True, "openblas": False}


def test_load_defers_mlx_lm_init(tiny_model):
    got = _run("from mtplx.models.loading import load\n"
               f"load({str(tiny_model('llama'))!r})\n"
               "print(state())")
    assert got["mlx_lm_real"] is False


needs_cpu_extra = pytest.mark.skipif(
    not sys.platform.startswith("linux") or importlib.util.find_spec("ngsolve_openblas") is None,
    reason="the `cpu` extra (ngsolve-openblas) is not installed")


@needs_cpu_extra
def test_cli_and_ray_predictor_bind_openblas(tiny_model, tmp_path):
    model = tiny_model("llama")
    data = write_parquet(tmp_path / "in.parquet", sample_rows(2))
    job = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run", generation={"max_tokens": 2}))
    cli = _run("import sys\nfrom pipelines.cli import main\n"
               "main(['run', sys.argv[1], '--quiet'], standalone_mode=False)\n"
               "print(state())", str(job))
    assert cli == {"mlx_lm_real": False, "openblas": True}
    ray = _run("from pipelines.execution.ray_engine import MTPLXPredictor\n"
               f"MTPLXPredictor({str(model)!r})\n"
               "print(state())")
    assert ray == {"mlx_lm_real": False, "openblas": True}
