"""mtplx/cuda_graphs.py: MLX's CUDA-graph limits chosen from the job (width bucket, plain or speculative), given
only where the user set none, only before mlx.core loads, only on Linux; the CLI sets them from the job file in a
fresh process before anything imports mlx.core, records them in the run, and still refuses a bad job first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobkit import job_dict, sample_rows, write_job, write_parquet
from mtplx import cuda_graphs

REPO = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")
TABLE = {("1", True): {"MLX_MAX_OPS_PER_BUFFER": "123"}, ("2-16", False): {"MLX_MAX_OPS_PER_BUFFER": "45"},
         ("17+", True): {"MLX_MAX_OPS_PER_BUFFER": "400", "MLX_MAX_MB_PER_BUFFER": "64000"}}


@pytest.fixture
def before_mlx(monkeypatch):
    """This process as before mlx.core loads (put back afterwards: never re-imported), with a test table."""
    import mlx.core

    monkeypatch.setattr(cuda_graphs, "TABLE", TABLE)
    monkeypatch.setattr(cuda_graphs, "applied", {})
    monkeypatch.setattr(cuda_graphs, "chosen", None)
    monkeypatch.delitem(sys.modules, "mlx.core")
    yield
    monkeypatch.setitem(sys.modules, "mlx.core", mlx.core)


def test_the_job_picks_the_row(before_mlx):
    assert cuda_graphs.limits_for(1, "mtp") == ("width 1, speculative", {"MLX_MAX_OPS_PER_BUFFER": "123"})
    assert cuda_graphs.limits_for(1, "none") == ("width 1, plain", {})  # a row not in the table: MLX's defaults
    assert cuda_graphs.limits_for(8, "none")[1] == cuda_graphs.limits_for(16, "none")[1] == {"MLX_MAX_OPS_PER_BUFFER": "45"}
    assert cuda_graphs.limits_for(17, "none") == ("width 17+, plain", {})
    assert cuda_graphs.limits_for("auto", "ngram")[1] == TABLE[("17+", True)]  # a calibrated width: the widest
    env = {"MLX_MAX_MB_PER_BUFFER": "10"}
    assert cuda_graphs.apply_for(32, "mtp", env, platform="linux") == {"MLX_MAX_OPS_PER_BUFFER": "400"}
    assert env == {"MLX_MAX_MB_PER_BUFFER": "10", "MLX_MAX_OPS_PER_BUFFER": "400"}  # the user's own value wins
    note = cuda_graphs.describe(env)
    assert note["table"] == "width 17+, speculative"
    assert note["MLX_MAX_OPS_PER_BUFFER"] == "400 (table)" and note["MLX_MAX_MB_PER_BUFFER"] == "10 (yours)"


def test_nothing_off_linux_switched_off_or_once_mlx_is_loaded(before_mlx, monkeypatch):
    env = {}
    assert cuda_graphs.apply_for(1, "mtp", env, platform="darwin") == {} and env == {}  # Metal reads it for itself
    monkeypatch.setattr(cuda_graphs, "ENABLED", False)
    assert cuda_graphs.apply_for(1, "mtp", env, platform="linux") == {} and env == {}
    monkeypatch.setattr(cuda_graphs, "ENABLED", True)
    monkeypatch.setattr(cuda_graphs, "chosen", None)
    monkeypatch.setitem(sys.modules, "mlx.core", object())
    assert cuda_graphs.apply_for(1, "mtp", env, platform="linux") == {} and env == {}  # too late: MLX has read them
    assert cuda_graphs.chosen == "mlx.core loaded before the job was read"


# A fresh process: records MLX_MAX_OPS_PER_BUFFER as it is when mlx.core is first imported, sets the test
# table, then runs `mtplx-batch ARGS` (mode "cli") or pipelines' load_engine, as a Ray actor does ("engine").
SPY = """
import importlib.abc, json, os, sys
seen = {}
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core" and not seen:
            seen["ops"] = os.environ.get("MLX_MAX_OPS_PER_BUFFER")
        return None
assert "mlx.core" not in sys.modules
sys.meta_path.insert(0, Spy())
import mtplx.cuda_graphs as g
g.TABLE = TEST_TABLE
code = 0
if sys.argv[1] == "cli":
    from pipelines.cli.commands import main
    try:
        main(args=sys.argv[2:], prog_name="mtplx-batch")
    except SystemExit as e:
        code = e.code
else:
    from pipelines.job.config import load_job
    from pipelines.execution.opening import load_engine
    load_engine(load_job(sys.argv[2], sys.argv[3:]))
print("SPY " + json.dumps({"seen": seen, "code": code}))
"""


def _spy(mode, *args, env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_MAX_")} | (env or {})
    proc = subprocess.run([sys.executable, "-c", SPY.replace("TEST_TABLE", repr(TABLE)), mode, *map(str, args)], cwd=REPO,
                          env=env | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    spy = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("SPY ")]
    assert spy, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    return spy[0]["seen"].get("ops"), spy[0]["code"], events


@pytest.fixture
def job_file(tmp_path, tiny_model):
    data = write_parquet(tmp_path / "in.parquet", sample_rows(4))
    job = job_dict(tiny_model("llama"), data, tmp_path / "run", generation={"max_tokens": 4},
                   speculative={"method": "ngram"})
    return write_job(tmp_path / "job.yaml", job)


def test_the_cli_sets_them_from_the_job_before_mlx_core_loads(tmp_path, job_file):
    ops, code, events = _spy("cli", "run", job_file, "--set", "schedule.max_batch=1", "--log-json")
    assert code == 0, events
    assert ops == ("123" if LINUX else None)  # width 1, speculative: in the environment when mlx.core loaded
    summary = next(e for e in events if e["event"] == "summary")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert summary["cuda_graphs"] == manifest["cuda_graphs"]
    if LINUX:
        assert summary["cuda_graphs"]["table"] == "width 1, speculative"
        assert summary["cuda_graphs"]["MLX_MAX_OPS_PER_BUFFER"] == "123 (table)"
        assert "MLX_MAX_OPS_PER_BUFFER=123 (table)" in next(e for e in events if e["event"] == "start")["cuda_graphs"]
    # plain at width 4 (the job's max_batch) takes its own row; a user's own value wins over the table
    ops, code, events = _spy("cli", "run", job_file, "--set", "speculative.method=none", "--restart", "--log-json",
                             env={"MLX_MAX_OPS_PER_BUFFER": "77"})
    assert code == 0 and ops == "77"
    summary = next(e for e in events if e["event"] == "summary")
    if LINUX:
        assert summary["cuda_graphs"]["table"] == "width 2-16, plain"
        assert summary["cuda_graphs"]["MLX_MAX_OPS_PER_BUFFER"] == "77 (yours)"


def test_a_bad_job_is_refused_before_mlx_core_loads(tmp_path, job_file):
    ops, code, events = _spy("cli", "run", job_file, "--set", "generation.max_tokens=lots", "--log-json")
    assert code == 2 and "generation.max_tokens" in events[-1]["message"]
    assert ops is None and not (tmp_path / "run").exists()  # mlx.core never imported, nothing set


def test_an_engine_loaded_for_a_job_gets_its_row(job_file):
    """What a Ray actor runs (JobPredictor -> load_engine): the job's row, before the engine imports mlx.core."""
    ops, code, _ = _spy("engine", job_file, "speculative.method=none")
    assert code == 0 and ops == ("45" if LINUX else None)  # plain at width 4
