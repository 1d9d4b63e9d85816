"""`mtplx-batch calibrate`: a real per-machine profile on a tiny model, `schedule.max_batch: auto`
and the depth controller starting from it, and the run recording which profile it used."""

import json

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, sample_rows, write_job, write_parquet
from mtplx.calibrate import (AUTO_FALLBACK, AUTO_ROW_TOKENS, PROFILE_FILE, calibrate, load_profile, profile_path,
                             save_profile)
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.depth import DepthController
from mtplx.generation import Engine
from mtplx.models.loading import load
from pipelines.cli import main
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cal") / "llama", "llama")


@pytest.fixture(scope="module")
def bundle(model):
    return load(model)


def test_profile_measures_every_width_that_fits_and_every_verify_length(bundle):
    engine = Engine(bundle, SpeculativeConfig(method="none", depth=3))
    per_row = engine.row_bytes(16, 4)
    engine.memory_budget = 5 * per_row  # widths 1 and 4 fit, 16 does not
    p = calibrate(engine, widths=(1, 4, 16), depth=3, context=16, repeats=1)
    assert sorted(p["verify_seconds"], key=int) == ["1", "4"] and p["skipped_widths"] == [16]
    for w, costs in p["verify_seconds"].items():
        assert len(costs) == 4 and all(c > 0 for c in costs)
        assert p["tokens_per_second"][w] == pytest.approx(int(w) / costs[0])
        assert 0 <= p["depth_that_pays"][w] <= 3
    assert str(p["best_width"]) == max(p["tokens_per_second"], key=p["tokens_per_second"].get)
    assert load_profile(save_profile(p, profile_path(bundle.path.parent / "x")), bundle.config) == p


def test_max_batch_auto_takes_the_best_width_capped_by_memory(bundle, tmp_path):
    engine = Engine(bundle, SpeculativeConfig(method="none"))
    p = calibrate(engine, widths=(1, 2, 8), depth=1, context=8, repeats=1)
    p["best_width"] = 8  # whatever this noisy CPU measured, the cap below is what is tested
    path = save_profile(p, tmp_path / "p.json")
    auto = Engine(bundle, schedule=ScheduleConfig(max_batch="auto", calibration=str(path)))
    assert auto.max_batch == 8 and auto.profile_file == str(path)
    row = auto.row_bytes(AUTO_ROW_TOKENS, 0)
    tight = Engine(bundle, schedule=ScheduleConfig(max_batch="auto", calibration=str(path),
                                                   memory_budget=3 * row + 1))
    assert tight.max_batch == 3  # three rows of AUTO_ROW_TOKENS fit, eight do not
    # a profile from another device is not used: the fallback width, still capped by memory
    p["device"] = "gpu elsewhere"
    other = save_profile(p, tmp_path / "other.json")
    with pytest.raises(ValueError, match="calibration.*another device"):
        Engine(bundle, schedule=ScheduleConfig(max_batch="auto", calibration=str(other)))
    fallback = Engine(bundle, schedule=ScheduleConfig(max_batch="auto", memory_budget=3 * row + 1))
    assert fallback.profile_file is None and fallback.max_batch == min(AUTO_FALLBACK, 3)


def test_depth_controller_starts_from_the_calibrated_cost_curve():
    # drafting 3 costs 4x a plain step (a CPU): with 0.7 acceptance not worth it
    steep = {1: [1.0, 2.0, 3.0, 4.0]}
    flat = {1: [1.0, 1.01, 1.02, 1.03]}  # a GPU: drafting is almost free
    for shapes, best in ((steep, 0), (flat, 3)):
        ctrl = DepthController(3, shapes=shapes)
        ctrl.explore = False  # (no first plain rounds)
        assert ctrl.choose(1) == best
    # a measured depth sets the scale, the curve the ratios
    ctrl = DepthController(3, shapes=steep)
    for _ in range(3):
        ctrl.record(1, 0, 0.01, 0, 0)
    assert ctrl._cost(1, 3) == pytest.approx(0.04)


def test_cli_calibrate_writes_beside_the_model_and_a_run_records_it(model, tmp_path):
    res = CliRunner().invoke(main, ["calibrate", str(model), "--widths", "1,2", "--depth", "1",
                                    "--context", "8", "--repeats", "1"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert (model / PROFILE_FILE).exists() and "best width" in res.output
    data = write_parquet(tmp_path / "in.parquet", sample_rows(6))
    outs = {}
    for mb in ("auto", 3):
        job = job_dict(model, data, tmp_path / f"run-{mb}", generation={"max_tokens": 6},
                       schedule={"max_batch": mb})
        res = CliRunner().invoke(main, ["run", str(write_job(tmp_path / f"{mb}.yaml", job)), "-q"],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        manifest = json.loads((tmp_path / f"run-{mb}" / "manifest.json").read_text())
        assert manifest["calibration"] == str(model / PROFILE_FILE)
        outs[mb] = {r["id"]: r["completion"] for r in read_output(tmp_path / f"run-{mb}")}
    assert outs["auto"] == outs[3]  # greedy text does not depend on the width


def test_cli_calibrate_refuses_bad_widths(model):
    res = CliRunner().invoke(main, ["calibrate", str(model), "--widths", "0,x"])
    assert res.exit_code == 2 and "--widths" in res.output


def test_one_row_plain_decoding_takes_the_calibrated_faster_path(bundle, tmp_path):
    """The profile times one-row plain decoding both ways; where it says eager was faster, a
    one-row job forwards eagerly (wider batches stay compiled), with the compiled path's tokens."""
    from mtplx.request import Request, SamplingParams

    p = calibrate(Engine(bundle, SpeculativeConfig(method="none")), widths=(1, 2), depth=1, context=8, repeats=1)
    single = p["one_stream"]
    assert single["compiled"] > 0 and single["eager"] > 0 and single["faster"] == max(("compiled", "eager"), key=single.get)
    reqs = [Request(key=i, prompt_tokens=[3 + i, 17, 9], params=SamplingParams(max_tokens=8)) for i in range(3)]

    def run(faster, width):
        path = save_profile({**p, "one_stream": {**single, "faster": faster}}, tmp_path / f"{faster}.json")
        eng = Engine(bundle, SpeculativeConfig(method="none"), ScheduleConfig(max_batch=width, calibration=str(path)))
        out = sorted(eng.generate(reqs), key=lambda r: r.key)
        return [r.tokens for r in out], sum(r.stats.eager_verify_calls for r in out), sum(r.stats.compiled_verify_calls for r in out)

    compiled_tokens, eager_calls, compiled_calls = run("compiled", 1)
    assert eager_calls == 0 and compiled_calls > 0
    tokens, eager_calls, compiled_calls = run("eager", 1)
    assert tokens == compiled_tokens and eager_calls > 0 and compiled_calls == 0
    tokens, eager_calls, compiled_calls = run("eager", 2)
    assert tokens == compiled_tokens and compiled_calls > 0
