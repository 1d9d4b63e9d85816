"""executor: ray on a real local Ray cluster (2 CPUs): same rows as local, kill -9 then resume,
per-row errors stay rows, fixed schema, and MTPLXPredictor in a user's own Ray pipeline.

One Ray cluster serves the module; in-process runs reuse it (`ray.is_initialized()`), the killed
subprocess attaches to it through `executor.address`, and the resume starts its own cluster
(the default, `executor.address: null`).
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from jobkit import job_dict, read_output, records, sample_rows, write_job, write_jsonl, write_parquet  # noqa: E402
from pipelines.errors import JobError, RunError  # noqa: E402
from pipelines.job.config import build_job  # noqa: E402
from pipelines.execution.ray_engine import MTPLXPredictor  # noqa: E402
from pipelines.execution.session import run_job  # noqa: E402
from pipelines.io.columns import output_schema  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# Everything that must agree between executors (timings and batch widths may differ).
SAME = ("id", "row", "sample", "completion", "finish_reason", "error", "seed", "prompt_tokens",
        "completion_tokens")


@pytest.fixture(scope="module")
def ray_address():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def both(tmp_path, llama, data, fmt="parquet", keep=(), **sections):
    """The job run locally and on Ray; (local rows, ray rows, local dir, ray dir)."""
    dirs = []
    for executor in ("local", "ray"):
        job = build_job(job_dict(llama, data, tmp_path / executor, fmt=fmt, executor=executor,
                                 output={"shard_rows": 5, "keep_columns": list(keep)}, **sections))
        summary = run_job(job)
        assert summary.outputs == len(read_output(job.output.dir)), executor
        dirs.append(tmp_path / executor)
    return read_output(dirs[0]), read_output(dirs[1]), dirs[0], dirs[1]


def shard_schemas(run_dir):
    return [pq.read_schema(run_dir / e["file"]) for e in records(run_dir)]


def test_same_rows_and_greedy_texts_as_local(tmp_path, llama, ray_address):
    rows = sample_rows(12)
    rows[5]["prompt"] = None  # an error row on both executors
    data = write_parquet(tmp_path / "in.parquet", rows)
    local, on_ray, _, ray_dir = both(tmp_path, llama, data, keep=("topic", "weight"),
                                     generation={"max_tokens": 10},
                                     schedule={"order": "prefix", "max_batch": 4, "min_prefix_tokens": 8})
    assert [(r["row"], r["sample"]) for r in on_ray] == [(i, 0) for i in range(12)]
    assert [{k: r[k] for k in SAME + ("topic", "weight")} for r in on_ray] == \
           [{k: r[k] for k in SAME + ("topic", "weight")} for r in local]
    assert sum(r["completion"] is not None and r["completion_tokens"] > 0 for r in on_ray) == 11
    assert on_ray[5]["finish_reason"] == "error" and "is null" in on_ray[5]["error"]
    assert sum(r["cached_prompt_tokens"] for r in on_ray) > 0  # prefix groups survive the reader
    manifest = json.loads((ray_dir / "manifest.json").read_text())
    assert manifest["input_rows"] == 12 and sum(e["rows"] for e in records(ray_dir)) == 12
    assert run_job(build_job(job_dict(llama, data, ray_dir, executor="ray", generation={"max_tokens": 10},
                                      output={"shard_rows": 5, "keep_columns": ["topic", "weight"]},
                                      schedule={"order": "prefix", "max_batch": 4, "min_prefix_tokens": 8}))
                   ).outputs == 0  # nothing left: every key was filtered before map_batches


def test_bad_rows_stay_rows_and_the_schema_is_fixed(tmp_path, tiny_model, ray_address):
    model = tiny_model("llama", max_position_embeddings=64)
    lines = [
        {"id": "ok", "prompt": "What is two plus two?", "x": 1.5},
        {"id": "null", "prompt": None, "x": 2.5},
        {"id": "int", "prompt": 42},
        {"id": "long", "prompt": " ".join(["word"] * 200)},
        {"id": "ok", "prompt": "duplicate id"},
        b'{"id": "trunc", "prompt": ',
        b'{"id": "latin", "prompt": "caf\xe9"}',
        {"prompt": "no id here"},
        {"id": "ok2", "prompt": "What is three plus four?", "x": 3.5},
    ]
    data = write_jsonl(tmp_path / "in.jsonl", lines)
    local, on_ray, local_dir, ray_dir = both(tmp_path, model, data, fmt="jsonl", keep=("x",),
                                             input={"chat_template": "off"}, generation={"max_tokens": 6})
    assert [{k: r[k] for k in SAME + ("x",)} for r in on_ray] == [{k: r[k] for k in SAME + ("x",)} for r in local]
    errors = {r["row"]: r["error"] for r in on_ray if r["finish_reason"] == "error"}
    assert sorted(errors) == [1, 2, 3, 4, 5, 6, 7]
    for row, reason in {1: "is null", 3: "context holds 64", 4: "duplicate id 'ok'", 5: "not valid JSON",
                        6: "not UTF-8", 7: "no id column 'id'"}.items():
        assert reason in errors[row], (row, errors[row])
    # One schema for every shard of both executors, error-only shards included.
    schemas = shard_schemas(ray_dir) + shard_schemas(local_dir)
    expected = output_schema([("x", schemas[0].field("x").type)])
    assert all(s.equals(expected) for s in schemas), schemas
    assert any(all(r["finish_reason"] == "error" for r in pq.read_table(ray_dir / e["file"]).to_pylist())
               for e in records(ray_dir))


def test_engine_errors_are_rows_and_a_run_of_only_errors_fails(tmp_path, llama, ray_address):
    data = write_parquet(tmp_path / "in.parquet", sample_rows(4))
    job = build_job(job_dict(llama, data, tmp_path / "run", executor="ray", schedule={"memory_budget": 4096}))
    with pytest.raises(RunError, match="every one of the 4 output rows is an error row"):
        run_job(job)
    out = read_output(job.output.dir)  # committed all the same
    assert len(out) == 4 and all(r["finish_reason"] == "error" and "memory_budget" in r["error"] for r in out)


def test_the_reader_hands_the_actors_a_batch_at_a_time(tmp_path, llama, ray_address):
    """Ray Data joins what a task yields into blocks of up to 128 MiB by default: the reader's
    whole output was one block, so one actor task ran every row, whatever executor.concurrency
    said, and its rows came back only at its end. The job's blocks are about a batch each."""
    from pipelines.execution.ray_executor import ray_data_context, actor_batch_rows, build_dataset
    from pipelines.io.records import CommittedKeys

    data = write_parquet(tmp_path / "in.parquet", sample_rows(64))
    job = build_job(job_dict(llama, data, tmp_path / "run", executor="ray", generation={"max_tokens": 4},
                             schedule={"max_batch": 4}))
    with ray_data_context(quiet=True):
        ds = build_dataset(job, CommittedKeys.of([], []))
        rows = [r for t in ds.iter_batches(batch_format="pyarrow", batch_size=None) for r in t.to_pylist()]
        stats = ds.stats()
    assert sorted((r["row"], r["sample"]) for r in rows) == [(i, 0) for i in range(64)]
    tasks = int(re.search(r"MapBatches\(JobPredictor\): (\d+) tasks executed", stats).group(1))
    assert tasks >= 64 // (2 * actor_batch_rows(job)), stats  # batches of 16 rows: about one or two a task


# ------------------------------------------------------------------ kill -9, then resume


def _shards(run_dir):
    try:
        return len(records(run_dir))
    except JobError:  # not started yet
        return 0


def _cli(job_file, *extra):
    return [sys.executable, "-m", "pipelines.cli", "run", str(job_file), "--executor", "ray", "-q", *extra]


@pytest.mark.slow
def test_sigkill_after_first_commit_then_resume_exactly_once(tmp_path, llama, ray_address):
    rows = sample_rows(40)
    rows[9]["prompt"] = None
    data = write_parquet(tmp_path / "in.parquet", rows)
    settings = dict(generation={"max_tokens": 16}, output={"shard_rows": 2, "keep_columns": ["topic"]},
                    schedule={"order": "prefix", "max_batch": 4})
    ref = build_job(job_dict(llama, data, tmp_path / "ref", **settings))
    run_job(ref)  # the uninterrupted local reference
    expected = [{k: r[k] for k in SAME + ("topic",)} for r in read_output(ref.output.dir)]
    assert len(expected) == 40

    run_dir = tmp_path / "run"
    # The killed run attaches to this module's cluster; the resume starts its own (the default).
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, run_dir, executor={"type": "ray", "address": ray_address},
                                                    **settings))
    proc = subprocess.Popen(_cli(job), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while _shards(run_dir) < 1:
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "no shard was committed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _shards(run_dir)
    partial = read_output(run_dir)
    assert 0 < len(partial) < 40, len(partial)  # killed mid-way, with committed shards

    final = subprocess.run(_cli(job, "--set", "executor.address=null"), cwd=REPO, capture_output=True, text=True,
                           timeout=400)
    assert final.returncode == 0, final.stderr[-3000:]
    got = [{k: r[k] for k in SAME + ("topic",)} for r in read_output(run_dir)]
    assert got == expected  # every row exactly once, the same text as the uninterrupted run
    assert len(records(run_dir)) > done
    recorded = {Path(e["file"]).name for e in records(run_dir)}
    assert recorded == set(os.listdir(run_dir / "shards"))  # no uncommitted leftovers


# ------------------------------------------------------------------ the callable class on its own


def test_predictor_in_a_users_ray_pipeline(tmp_path, llama, ray_address):
    rows = sample_rows(6)
    data = write_parquet(tmp_path / "in.parquet", rows)
    job = build_job(job_dict(llama, data, tmp_path / "run", generation={"max_tokens": 8}))
    run_job(job)
    want = {r["id"]: r["completion"] for r in read_output(job.output.dir)}

    ds = ray.data.from_items([{"id": r["id"], "prompt": r["prompt"], "topic": r["topic"]} for r in rows]
                             + [{"id": "bad", "prompt": None, "topic": "x"}])
    out = ds.map_batches(
        MTPLXPredictor, batch_size=4, compute=ray.data.ActorPoolStrategy(size=1),
        fn_constructor_kwargs={"model_path": str(llama), "generation": {"max_tokens": 8, "n": 2},
                               "schedule": {"max_batch": 4}},
    ).take_all()
    assert len(out) == 14 and {(r["id"], r["sample"]) for r in out} == {(i, s) for i in list(want) + ["bad"]
                                                                          for s in (0, 1)}
    for r in out:
        assert r["topic"] == ("x" if r["id"] == "bad" else rows[int(r["id"][1:])]["topic"])  # passed through
        if r["id"] == "bad":
            assert r["finish_reason"] == "error" and "is null" in r["error"] and r["completion"] is None
        else:
            assert r["completion"] == want[r["id"]] and r["completion_tokens"] > 0 and r["error"] is None


def test_predictor_called_directly_numpy_and_token_ids(llama):
    pred = MTPLXPredictor(str(llama), generation={"max_tokens": 5}, chat_template="off")
    out = pred({"id": np.array(["a", "b"]), "prompt": np.array(["Hello there", ""], dtype=object)})
    assert list(out["id"]) == ["a", "b"] and list(out["sample"]) == [0, 0]
    assert out["finish_reason"][1] == "error" and "empty" in out["error"][1]
    assert out["completion_tokens"].dtype == np.int64 and out["completion_tokens"][0] == 5
    toks = pred.engine.tokenizer.encode("Hello there")
    again = pred({"token_ids": np.array([np.array(toks)], dtype=object)})
    assert again["completion"][0] == out["completion"][0]
