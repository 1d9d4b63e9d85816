"""The benchmark harness's own machinery: what it hands a peer, and what its profiler changes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from benchmarks import phase_profile
from benchmarks.torch_peer import HF_KEYS, dense_weights
from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.loading import load
from mtplx.request import Request, SamplingParams


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


def test_phase_profile_times_phases_without_changing_output(tiny_model):
    bundle = load(tiny_model("llama"))
    prompts = [[1, 5, 9, 12, 7, 5, 9, 12], [4, 4, 8, 15, 16, 23, 42], [2, 3]]

    def run(instrumented: bool):
        eng = Engine(bundle, SpeculativeConfig(method="ngram", depth=3, adaptive_depth=False), ScheduleConfig(max_batch=2))
        if instrumented:
            phase_profile.instrument(eng)
        reqs = [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)]
        return {r.key: r.tokens for r in eng.generate(reqs)}

    phase_profile.TIMES.clear()
    plain = run(False)
    assert run(True) == plain
    phases = set(phase_profile.TIMES)
    # the verify is timed alone, or folded with the acceptance (Engine.fold_accept, graphbank.verify_round)
    assert phases & {"verify (incl. compiles)", "verify + acceptance (incl. compiles)"}
    assert any(p.startswith("prefill") for p in phases)
    assert phase_profile.CALLS["verify program compile (first call)"] >= 1


def test_per_row_peer_warms_up_with_the_whole_run(tiny_model):
    """mlx-lm's per-row generators get the warm-up our engine gets: the same whole run, untimed
    (it used to be 4 tokens of the first prompt)."""
    from mlx_lm.generate import generate_step

    from benchmarks.real_models import _rows_one_at_a_time

    model = load(tiny_model("llama")).model
    calls = []

    def steps(prompt, n):
        calls.append((tuple(np.array(prompt).tolist()), n))
        return ((tok, False) for tok, _ in generate_step(prompt, model, max_tokens=n))

    prompts = [[1, 5, 9, 12], [4, 4, 8, 15, 16, 23, 42], [2, 3]]
    r = _rows_one_at_a_time(steps, prompts, 6, set())
    timed = [(tuple(p), 6) for p in prompts]
    assert calls == timed + timed
    assert r["tokens"] == 18 and r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"])


def test_jobs_vs_peer_compares_tokens_per_second(tiny_model, tmp_path, monkeypatch):
    """A sampled job: the two sides may generate different token counts, so the ratio is of
    tokens/s, and a wall-time ratio is claimed only when the counts are equal."""
    import json
    import sys

    from benchmarks import jobs_vs_peer
    from jobkit import job_dict, sample_rows, write_job, write_parquet

    data = write_parquet(tmp_path / "in.parquet", sample_rows(6))
    job = write_job(tmp_path / "job.yaml", job_dict(tiny_model("llama"), data, tmp_path / "run",
                                                  generation={"max_tokens": 12, "temperature": 1.0, "seed": 3}))
    monkeypatch.setattr(sys, "argv", ["jobs_vs_peer", str(job), "--out", str(tmp_path / "out")])
    jobs_vs_peer.main()
    (row,) = json.loads((tmp_path / "out" / "jobs_vs_peer-job-none-w4.json").read_text())["rows"]
    ours, peer = row["ours tokens"] / row["ours s"], row["mlx-lm tokens"] / row["mlx-lm s"]
    assert row["ours tok/s"] == pytest.approx(ours) and row["mlx-lm tok/s"] == pytest.approx(peer)
    assert row["ours / mlx-lm (tok/s)"] == pytest.approx(ours / peer)
    if row["ours tokens"] != row["mlx-lm tokens"]:
        assert row["ours / mlx-lm (wall)"] == "n/a: token counts differ"
    else:
        assert row["ours / mlx-lm (wall)"] == pytest.approx(row["mlx-lm s"] / row["ours s"])


def test_jobs_vs_peer_runs_settings_in_one_process_and_prints_phases(tiny_model, tmp_path, monkeypatch, capsys):
    """Several settings of one job: the peer runs once, each setting gets its own engine, and every
    phase prints as it ends (so a run cut by a time limit still says where its time went)."""
    import json
    import sys

    from benchmarks import jobs_vs_peer, real_models
    from jobkit import job_dict, sample_rows, write_job, write_parquet

    data = write_parquet(tmp_path / "in.parquet", sample_rows(3))
    job = write_job(tmp_path / "job.yaml", job_dict(tiny_model("llama"), data, tmp_path / "run", generation={"max_tokens": 6}))
    peer_runs = []
    real = real_models.mlx_batch
    monkeypatch.setattr(jobs_vs_peer, "mlx_batch", lambda *a, **k: peer_runs.append(1) or real(*a, **k))
    monkeypatch.setattr(sys, "argv", ["jobs_vs_peer", str(job), "--methods", "none,ngram", "--out", str(tmp_path / "out")])
    jobs_vs_peer.main()
    printed = capsys.readouterr().out
    for phase in ("load:", "prepare rows:", "peer batch_generate: warm-up", "method=none: warm-up run",
                  "method=ngram: engine setup", "method=ngram: timed run"):
        assert phase in printed, phase
    assert "new verify programs" in printed
    rows = json.loads((tmp_path / "out" / "jobs_vs_peer-job-settings-w4.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["method=none", "method=ngram"] and len(peer_runs) == 1
    assert rows[0]["mlx-lm s"] == rows[1]["mlx-lm s"] and all(r["ours tokens"] == 18 for r in rows)
    # --budget: no setting starts past it, and the peer still runs
    monkeypatch.setattr(sys, "argv", ["jobs_vs_peer", str(job), "--methods", "none", "--budget", "1e-9", "--out", str(tmp_path / "b")])
    jobs_vs_peer.main()
    printed = capsys.readouterr().out
    assert "method=none: skipped (past --budget" in printed and "peer batch_generate: timed" in printed
    assert len(peer_runs) == 2


def test_speed_ratio_claims_a_wall_ratio_only_for_equal_work():
    from benchmarks.common import speed_ratio

    r = speed_ratio(200, 2.0, 100, 2.0, "peer")
    assert r["ours / peer (tok/s)"] == 2.0 and r["ours / peer (wall)"] == "n/a: token counts differ"
    assert speed_ratio(100, 1.0, 100, 2.0)["ours / peer (wall)"] == 2.0


def test_torch_peer_uses_transformers_default_attention(tiny_model):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from benchmarks.torch_peer import attention, to_torch

    model = to_torch(load(tiny_model("llama")), dtype="float32", device="cpu")
    assert attention(model) == "sdpa"


def test_job_widths_runs_every_width_and_method_on_the_same_rows(tiny_model, tmp_path, monkeypatch):
    """benchmarks/job_widths: one row per width, each side over rows_per_width x width rows, our
    greedy plain and prompt-lookup runs making the same number of tokens (lossless), and the
    width set on both sides."""
    import json
    import sys

    from benchmarks import job_widths
    from jobkit import job_dict, sample_rows, write_job, write_parquet

    data = write_parquet(tmp_path / "in.parquet", sample_rows(8))
    job = write_job(tmp_path / "job.yaml", job_dict(tiny_model("llama"), data, tmp_path / "run", generation={"max_tokens": 6}))
    import mtplx.kernels.fusion as fusion

    # as on CUDA: the engine stacks projections, the peer unstacks them, our next run stacks again
    monkeypatch.setattr(fusion, "stacking_pays", lambda: True)
    monkeypatch.setattr(job_widths, "stacking_pays", lambda: True)
    seen = []
    real_peer = job_widths.peer
    monkeypatch.setattr(job_widths, "peer", lambda b, p, t, w: seen.append((len(p), w)) or real_peer(b, p, t, w))
    monkeypatch.setattr(sys, "argv", ["job_widths", str(job), "--widths", "2,4", "--tokens", "5", "--out", str(tmp_path / "out")])
    job_widths.main()
    rows = json.loads((tmp_path / "out" / "job_widths.json").read_text())["rows"]
    assert [(r["width"], r["rows"]) for r in rows] == [(2, 4), (4, 8)]
    assert (4, 2) in seen and (8, 4) in seen  # the timed peer runs: 2 x width rows at that width
    for r in rows:
        assert r["none tokens"] == r["ngram tokens"] and 0 < r["none tokens"] <= 5 * r["rows"]
        assert r["none / mlx-lm"] == pytest.approx(r["ours none tok/s"] / r["mlx-lm tok/s"])


def test_decode_anatomy_matrix_names_known_variants():
    from benchmarks import decode_anatomy

    assert [v[0] for v in decode_anatomy.pick_variants("matrix")] == decode_anatomy.MATRIX
    assert decode_anatomy.pick_variants("engine eager,bare+KVCache")[1][0] == "bare+KVCache"
    with pytest.raises(SystemExit, match="unknown"):
        decode_anatomy.pick_variants("engine warp speed")


def test_round_graph_counts_primitives_and_programs(tiny_model):
    """round_graph counts what each evaluation hands the device (each primitive once, views apart)
    and every compiled verify call: plain decoding is one verify program per round."""
    from benchmarks.round_graph import VIEWS, GraphCounter, graph_primitives

    a = mx.ones((4, 4))
    counted = graph_primitives([mx.exp(a) @ a.T + 1])
    assert counted["Exp"] == 1 and counted["Matmul"] == 1 and set(counted) & VIEWS
    eng = Engine(load(tiny_model("llama")), SpeculativeConfig(method="none"), ScheduleConfig(max_batch=2))
    reqs = [Request(key=i, prompt_tokens=[3 + i, 17, 9], params=SamplingParams(max_tokens=6)) for i in range(2)]
    list(eng.generate(reqs))
    rounds = eng.counters["rounds"]
    with GraphCounter(eng) as g:
        list(eng.generate(reqs))
    summary = g.summary(eng.counters["rounds"] - rounds)
    assert summary["programs/round"] == 1.0 and summary["kernels/round"] > 20


def test_draft_rounds_counts_k_draft_forwards_or_one_program_a_round(tiny_model):
    from benchmarks.draft_rounds import measure

    bundle = load(tiny_model("llama"))
    draft = str(tiny_model("llama", seed=1))
    for depth in (2, 3):
        eager, compiled = (measure(bundle, draft, depth, c, tokens=12) for c in ("off", "on"))
        prefills = 2 / eager["rounds"]  # one draft prefill per row; rounds near max_tokens may draft less
        assert depth / 2 < eager["eager draft forwards / round"] <= depth + prefills + 1e-9, eager
        assert 0.5 < compiled["compiled proposals / round"] <= 1, compiled
        assert compiled["eager draft forwards / round"] * compiled["rounds"] == 2, compiled
    measured = measure(bundle, draft, 2, "measured", tokens=12)  # the engine's default: both chains timed
    assert measured["chain ms compiled / eager"].startswith("width 1 depth 2: "), measured


def test_round_graph_counts_the_draft_models_programs(tiny_model):
    """A draft-model round at fixed depth, compiled: one verify program and one draft-chain program."""
    from benchmarks.round_graph import GraphCounter

    path = tiny_model("llama")
    spec = SpeculativeConfig(method="draft", draft_model=str(path), depth=2, adaptive_depth=False, compiled_verify="on")
    eng = Engine(load(path), spec, ScheduleConfig(max_batch=1))
    eng.drafter.measure = False
    reqs = [Request(key=0, prompt_tokens=[3, 17, 9], params=SamplingParams(max_tokens=10))]
    list(eng.generate(reqs))
    rounds = eng.counters["rounds"]
    with GraphCounter(eng) as g:
        list(eng.generate(reqs))
    rounds = eng.counters["rounds"] - rounds
    assert g.programs["verify"] == rounds and 0 < g.programs["draft"] <= rounds, (dict(g.programs), rounds)


def test_round_cost_rows_are_one_wave_then_larger_streams():
    from benchmarks.round_cost import row_counts

    assert row_counts("4,2x", 1) == [4]  # 2 x 1 rows is not more than the 4 already run
    assert row_counts("4,2x", 8) == [8, 16]
    assert row_counts("32,64", 32) == [32, 64]
    with pytest.raises(SystemExit, match="not N or Nx"):
        row_counts("4,y", 8)


def test_round_cost_full_columns_stop_where_the_last_row_is_admitted(tiny_model):
    """The `full` rate counts tokens only until the last row enters: with 6 rows of 5 tokens at width
    2 (three waves in step), the first two waves and the third's first tokens (from its prefill)."""
    from benchmarks.round_cost import run

    bundle = load(tiny_model("llama"))
    prompts = [[3 + i, 17, 9, 40 + i] for i in range(6)]
    r = run(bundle, prompts, SpeculativeConfig(method="none"), width=2, rows=6, tokens=5)
    assert r["tokens"] == 30
    assert r["full tokens"] == 2 * 10 + 2
    assert r["full tok/s"] > 0 and r["full tok/round"] > 0
    assert r["admissions"] == 3 and r["drains"] == 3  # a wave each; plain rounds empty the pipeline for each
    assert r["tail s"] > 0
    assert r["rounds by width"] == f"2:{r['rounds']}"  # every round counted, at the batch's width


def test_round_cost_full_columns_are_empty_for_one_wave(tiny_model):
    from benchmarks.round_cost import run

    bundle = load(tiny_model("llama"))
    r = run(bundle, [[3 + i, 17, 9] for i in range(2)], SpeculativeConfig(method="none"), width=2, rows=2, tokens=4)
    assert r["full tok/s"] == "-" and r["full tok/round"] == "-"


def test_admission_counts_carried_rounds_drain_less(tmp_path):
    from benchmarks.admission_counts import counts
    from benchmarks.round_cost import tiny_setup
    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from mtplx.generation import Engine
    from mtplx.request import Request, SamplingParams

    bundle, head, prompts = tiny_setup(tmp_path, layers=2)
    reqs = [Request(key=i, prompt_tokens=prompts[i], params=SamplingParams(max_tokens=3 + (i * 5) % 11)) for i in range(16)]
    eng = Engine(bundle, SpeculativeConfig(method="mtp", depth=3, adaptive_depth=False, mtp_head=head),
                 ScheduleConfig(max_batch=4, order="input"))
    before_text, before = counts(eng, reqs, carry=False)
    after_text, after = counts(eng, reqs, carry=True)
    assert after_text == before_text
    assert before["drains"] >= before["admissions"] - 1 > after["drains"], (before, after)


def test_round_cost_interleaved_pairs_each_run_with_plains_of_its_round(tmp_path):
    """--repeats: every setting runs once a round, the order rotated; x plain is the median of the
    ratios to plain's run in the same round (not a ratio of medians), and every run's text is checked."""
    from benchmarks.round_cost import PLAIN, interleaved, setting, summarize, tiny_setup

    head = "h"
    fake = lambda tok_s: {"tok/s": tok_s, "full tok/s": "-", "ms/round": 1.0, "wait ms/round": "-", "rounds": 3, "tok/round": 2.0,
                          "admissions": 1, "drains": 1, "prefill s": 0.1, "tail s": "-", "tokens/verify": 1.0,
                          "new programs": 0, "texts": {0: [1, 2]}}
    mtp = setting("3n", head)
    assert mtp.tail_width == 1 and mtp.carry and mtp.spec.depth == 3
    rows = summarize([PLAIN, mtp], [[fake(100.0), fake(200.0), fake(100.0)], [fake(150.0), fake(220.0), fake(90.0)]],
                     [0.0, 0.0])
    assert rows[1]["x plain tok/s"] == pytest.approx(1.1)  # ratios 1.5, 1.1, 0.9 (ratio of medians: 1.0)
    assert rows[1]["x plain spread"] == "0.9..1.5" and rows[1]["runs >= 1.2x"] == "1/3"
    assert rows[1]["tok/s"] == 150.0 and rows[1]["runs = plain"] == "3/3"

    bundle, head, prompts = tiny_setup(tmp_path, layers=2)
    seen = []
    out = interleaved(bundle, prompts, [setting("3", head), setting("3d", head)], width=2, rows=5, tokens=4,
                      repeats=3, report=lambda summary, done: seen.append(done))
    assert seen == [1, 2, 3]
    assert [r["method"] for r in out] == ["plain", "mtp depth 3", "mtp depth 3 (drained at admissions)"]
    assert all(r["runs"] == 3 and r["runs = plain"] == "3/3" for r in out)
    assert out[1]["new programs"] == 0  # warmed up before the first round


def test_round_cost_sets_a_module_switch_for_its_setting_alone():
    """`@mtplx.MODULE.NAME=V` holds while that setting's engine is made, warmed and timed, then is put back;
    a plain setting with one sums no programs (plain decoding has none)."""
    from benchmarks.round_cost import PLAIN, module_attrs, setting, summarize
    from mtplx.kernels import rows_attention

    s = setting("plain@mtplx.kernels.rows_attention.MAX_QUERIES=3", "h")
    assert s.attrs == (("mtplx.kernels.rows_attention.MAX_QUERIES", 3),) and s.spec.method == "none"
    before = rows_attention.MAX_QUERIES
    with module_attrs(s.attrs + (("refill_at", 3),)):  # engine attributes are the engine's (prepare)
        assert rows_attention.MAX_QUERIES == 3
    assert rows_attention.MAX_QUERIES == before
    with pytest.raises(SystemExit, match="no such attribute"):
        with module_attrs((("mtplx.kernels.rows_attention.NO_SUCH", 1),)):
            pass
    fake = {"tok/s": 1.0, "full tok/s": "-", "ms/round": 1.0, "wait ms/round": "-", "rounds": 3, "tok/round": 2.0,
            "admissions": 1, "drains": 1, "prefill s": 0.1, "tail s": "-", "tokens/verify": 1.0, "new programs": "-",
            "texts": {0: [1]}}
    assert summarize([PLAIN, s], [[fake], [fake]], [0.0, 0.0])[1]["new programs"] == "-"


def test_write_destinations_tell_a_copy_from_an_in_place_write():
    """A scatter into an array another node of the graph reads is counted as a copy (MLX copies the whole
    destination first), one into an evaluated array nothing else reads as `evaluated`, one into a fresh
    intermediate as `in place`."""
    import mlx.core as mx

    from benchmarks.round_graph import write_destinations

    cache = mx.zeros((1, 2, 8, 4))
    mx.eval(cache)
    pos = mx.zeros((1, 2, 1, 4), mx.int32)
    new = mx.ones((1, 2, 1, 4))
    written = mx.put_along_axis(cache, pos, new, axis=2)  # into the evaluated cache
    read = (written * 2).sum()  # the written cache is read ...
    again = mx.put_along_axis(written, pos + 1, new, axis=2)  # ... and written again: a copy
    fresh = mx.put_along_axis(mx.zeros((1, 2, 8, 4)) + 1, pos, new, axis=2)  # into an intermediate
    assert write_destinations([read, again, fresh]) == {"evaluated": 1, "copy": 1, "in place": 1}
