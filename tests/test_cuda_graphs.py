"""mtplx/cuda_graphs.py: MLX's CUDA-graph limits are given only where the user set none, only before
mlx.core loads, and only on Linux; `import mtplx` applies them before mlx.core in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mtplx import cuda_graphs


def test_user_settings_win_and_loaded_mlx_is_left_alone(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "LIMITS", {"MLX_MAX_OPS_PER_BUFFER": "4000", "MLX_MAX_MB_PER_BUFFER": "64000"})
    env = {"MLX_MAX_MB_PER_BUFFER": "10"}
    import mlx.core

    monkeypatch.delitem(sys.modules, "mlx.core")  # as before mlx.core loads (put back below: never re-imported)
    assert cuda_graphs.apply(env, platform="linux") == {"MLX_MAX_OPS_PER_BUFFER": "4000"}
    assert env == {"MLX_MAX_MB_PER_BUFFER": "10", "MLX_MAX_OPS_PER_BUFFER": "4000"}
    assert cuda_graphs.apply({}, platform="darwin") == {}  # Metal reads MLX_MAX_OPS_PER_BUFFER for itself
    monkeypatch.setitem(sys.modules, "mlx.core", mlx.core)
    assert cuda_graphs.apply({}, platform="linux") == {}  # too late: MLX has read them


def test_import_mtplx_sets_them_before_mlx_core():
    """A fresh process with LIMITS set: the variables are in the environment when mlx.core loads."""
    code = ("import mtplx.cuda_graphs as g; import sys, os, json;"
            "g.LIMITS = {'MLX_MAX_OPS_PER_BUFFER': '123'}; g.apply();"
            "import mlx.core;"
            "print(json.dumps([os.environ.get('MLX_MAX_OPS_PER_BUFFER'), g.applied]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_MAX_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    value, applied = json.loads(out.strip().splitlines()[-1])
    if sys.platform.startswith("linux"):
        assert value == "123" and applied == {"MLX_MAX_OPS_PER_BUFFER": "123"}
    else:
        assert value is None and applied == {}
    # and the shipped LIMITS are what `import mtplx` gave this process (or the user's own values)
    for k, v in cuda_graphs.LIMITS.items():
        assert os.environ.get(k) is not None
