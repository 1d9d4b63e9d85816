"""The benchmark suite on tiny models: each part's tables and ratio columns come out, and what it hands
its peers is what our engine gets. No timing is asserted (the numbers of a shared CPU mean nothing)."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from benchmarks import run
from benchmarks.common import bandwidth
from benchmarks.torch_peer import HF_KEYS, dense_weights
from mtplx.models.loading import load


def tables(out, part) -> dict:
    return json.loads((out / f"{part}.json").read_text())["tables"]


def test_roofline_is_the_bandwidth_of_the_device_present():
    assert bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bandwidth("NVIDIA H200") == 4.8e12
    assert bandwidth("NVIDIA H100 PCIe") is None  # slower memory than the SXM part's
    assert bandwidth("AMD EPYC") is None and bandwidth("Apple M3 Max") is None


def test_options_take_the_suites_defaults_and_say_which_were_given():
    opts = run.parse(["--suite", "gpu", "--tokens", "5"])
    assert opts.tokens == 5 and opts.rows == run.SUITES["gpu"]["rows"] and opts.explicit == {"tokens"}
    assert "draft_pair" in opts.parts.split(",") and "ray" in run.parse(["--suite", "cpu"]).parts.split(",")
    with pytest.raises(SystemExit):
        run.parse(["--parts", "decode,warp_speed"])


def test_decode_and_round_cost_parts(tmp_path):
    """Plain decoding at 1 and 2 streams against mlx-lm, the roofline unknown off the known GPUs; a
    forward of K tokens against one of 1 token at each width."""
    run.main(["--suite", "cpu", "--parts", "decode", "--shapes", "tiny", "--tokens", "4", "--streams", "2",
              "--repeats", "2", "--out", str(tmp_path)])
    rows = tables(tmp_path, "decode")["plain decoding"]
    assert [(r["streams"], r["mlx-lm"]) for r in rows] == [(1, "generate_step"), (2, "batch_generate")]
    assert all(r["x mlx-lm"] > 0 and r["ours tok/s"] > 0 for r in rows)
    assert rows[0]["roofline tok/s"] == "unknown" or bandwidth() is not None

    run.main(["--suite", "cpu", "--parts", "round_cost", "--shapes", "tiny", "--model", "", "--streams", "2",
              "--context", "16", "--repeats", "1", "--out", str(tmp_path)])
    rows = tables(tmp_path, "round_cost")["verify of K tokens a row against 1"]
    assert [(r["rows"], r["K"]) for r in rows] == [(w, k) for w in (1, 2) for k in (1, 2, 4, 8)]
    assert rows[0]["x one token"] == 1.0 and all(r["ms"] > 0 for r in rows)


def test_speculative_part_checks_every_method_against_plain_and_mlx_lm(tiny_model, tmp_path):
    """Each width: mlx-lm's peer and our methods, the ratios, and greedy text equal to plain decoding."""
    from tiny_models import untrained_head

    model = tiny_model("llama")
    head = untrained_head(load(model), tmp_path / "head")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x * {i}"}) + "\n" for i in range(6)))
    run.main(["--suite", "cpu", "--parts", "speculative", "--model", str(model), "--head", str(head), "--data", str(data),
              "--widths", "1,2", "--rows", "2", "--tokens", "6", "--repeats", "2", "--out", str(tmp_path)])
    (rows,) = tables(tmp_path, "speculative").values()
    assert [(r["width"], r["setting"]) for r in rows] == [
        (w, s) for w, peer in ((1, "generate_step"), (2, "batch_generate"))
        for s in (f"mlx-lm {peer}", "ours none", "ours ngram", "ours mtp")]
    assert [r["rows"] for r in rows] == [2] * 4 + [4] * 4  # width 2: a stream of 2 waves
    for r in rows:
        assert r["= plain"] == f"{r['rows']}/{r['rows']}", r  # greedy: every method writes plain's text
        assert r["x mlx-lm"] > 0 and r["x plain"] > 0
    assert all(r["x plain"] == 1.0 for r in rows if r["setting"] == "ours none")
    assert all(r["tokens/verify"] >= 1 for r in rows if r["setting"].startswith("ours"))


def test_jobs_part_runs_each_setting_and_the_peer_in_fresh_processes(tiny_model, tmp_path):
    from jobkit import job_dict, sample_rows, write_job, write_parquet

    data = write_parquet(tmp_path / "in.parquet", sample_rows(4))
    job = write_job(tmp_path / "job.yaml", job_dict(tiny_model("llama"), data, tmp_path / "run"))
    run.main(["--suite", "cpu", "--parts", "jobs", "--jobs", f"{job},{job}:speculative.method=ngram", "--rows", "3",
              "--tokens", "5", "--repeats", "1", "--out", str(tmp_path / "out")])
    (rows,) = tables(tmp_path / "out", "jobs").values()
    assert [r["setting"] for r in rows] == ["mlx-lm batch_generate", "job", "job speculative.method=ngram"]
    peer, plain, ngram = rows
    assert plain["rows"] == ngram["rows"] == 3 and plain["tokens"] == ngram["tokens"] <= 15  # greedy: the same text
    assert plain["x plain"] == 1.0 and ngram["x plain"] > 0 and plain["x mlx-lm"] > 0
    assert ngram["tokens/verify"] == "" or ngram["tokens/verify"] >= 1  # "": every round ran plain (depth 0)
    assert peer["tokens"] > 0 and "x plain" not in peer


def test_jobs_part_compares_each_setting_with_plain_decoding_of_the_same_width(tiny_model, tmp_path):
    """Settings at two widths, ours only (--peers 0): each `x plain` is against method none at its own
    width (each method-none row 1.0), never the first method-none setting's."""
    from jobkit import job_dict, sample_rows, write_job, write_parquet

    data = write_parquet(tmp_path / "in.parquet", sample_rows(4))
    job = write_job(tmp_path / "job.yaml", job_dict(tiny_model("llama"), data, tmp_path / "run"))
    jobs = ",".join(f"{job}:schedule.max_batch={w}{m}" for w in (1, 2) for m in (":speculative.method=none", ""))
    run.main(["--suite", "cpu", "--parts", "jobs", "--jobs", jobs, "--peers", "0", "--rows", "3", "--tokens", "5",
              "--repeats", "1", "--out", str(tmp_path / "out")])
    (rows,) = tables(tmp_path / "out", "jobs").values()
    assert len(rows) == 4 and not any(r["setting"].startswith("mlx-lm") for r in rows)
    assert [r["x plain"] for r in rows if r["setting"].endswith("method=none")] == [1.0, 1.0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dense_weights_reproduce_the_quantized_model(tiny_model, family):
    """The PyTorch peer gets dense weights: loaded into an unquantized twin, they give the same logits."""
    quantized = load(tiny_model(family)).model
    nn.quantize(quantized, group_size=32, bits=4)
    dense = dense_weights(quantized)
    assert not any(k.endswith((".scales", ".biases")) for k in dense)

    twin = load(tiny_model(family)).model  # same architecture, unquantized
    names = {k for k, _ in tree_flatten(twin.parameters())}
    assert set(dense) == names
    twin.update(tree_unflatten([(k, mx.array(v)) for k, v in dense.items()]))
    tokens = mx.array([[3, 17, 42, 99, 5, 8]])
    np.testing.assert_allclose(np.array(twin(tokens)), np.array(quantized(tokens)), rtol=1e-4, atol=1e-4)


def test_peer_config_keys_come_from_the_model_config(tiny_model):
    config = load(tiny_model("qwen3")).config
    assert {"model_type", "hidden_size", "num_hidden_layers", "vocab_size"} <= {k for k in HF_KEYS if k in config}


def test_torch_peer_uses_transformers_default_attention(tiny_model):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from benchmarks.torch_peer import attention, to_torch

    model = to_torch(load(tiny_model("llama")), dtype="float32", device="cpu")
    assert attention(model) == "sdpa"

