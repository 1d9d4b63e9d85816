"""`train-head --prompts KIND:N`, `--gen-batch` and `--data-seconds`: general prompts from the
standard library, self-distilled by a real (tiny) trunk through the engine, for training only.

- stdlib-code prompts are real stdlib functions cut to signature + docstring; stdlib-chat prompts
  put a real docstring as a question; both are seeded and distinct;
- the job's rows and the general prompts are generated in one engine run: each general prompt
  gets its greedy continuation (= mlx-lm's greedy decoding of the rendered prompt) and one
  sampled one, they are never held out, and the source names them;
- `--data-seconds` stops generation that long after the first continuation finished and keeps
  exactly the continuations finished.
"""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest
from click.testing import CliRunner

from mtplx.models.loading import load
from mtplx.models.mtp import SIDECAR_META
from mtplx.training.head_data import self_distill
from mtplx.training.head_prompts import general_prompts, render, stdlib_prompts
from mtplx.training.train_head import TrainConfig, TrainData, TrainHeadError
from pipelines.cli.train_head import train_head as train_head_cmd

from test_train_head import _write_prompts


def test_stdlib_prompts_are_real_functions_and_docstrings():
    code = stdlib_prompts("stdlib-code", 12, seed=0)
    assert len(code) == 12 and len(set(code)) == 12
    assert code == stdlib_prompts("stdlib-code", 12, seed=0) and code != stdlib_prompts("stdlib-code", 12, seed=1)
    for src in code:
        fn = ast.parse(src).body[0]  # a signature and its docstring alone are a valid function
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(ast.get_docstring(fn)) >= 40
        assert len(fn.body) == 1  # the body is left to the trunk
    chat = stdlib_prompts("stdlib-chat", 8, seed=0)
    assert len(chat) == 8 and len(set(chat)) == 8
    assert not any(c.lstrip().startswith(("def ", "async def ")) for c in chat)
    assert all("\n\n" in c for c in chat)  # a request, then the docstring's prose


def test_unknown_prompt_kind_is_refused_with_the_kinds():
    try:
        TrainConfig(prompts=("wiki:10",)).check()
    except TrainHeadError as e:
        assert "stdlib-code" in str(e) and "stdlib-chat" in str(e) and "wiki:10" in str(e)
    else:
        raise AssertionError("an unknown --prompts kind was accepted")


def test_cli_prompts_are_self_distilled_for_training_only(tiny_model, tmp_path):
    from tiny_models import reference_tokens

    model = tiny_model("llama")
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 10, seed=3)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: th\nmodel: {{path: {model}}}\n"
        f"input: {{format: jsonl, path: {prompts}, id_column: id, prompt_column: prompt}}\n"
        f"generation: {{max_tokens: 8}}\noutput: {{dir: {tmp_path / 'runs'}}}\n"
    )
    out = tmp_path / "head"
    args = [str(model), "--data", str(job), "--out", str(out), "--prompts", "stdlib-code:3", "--prompts",
            "stdlib-chat:2", "--gen-batch", "4", "--steps", "4", "--batch-size", "4", "--seq-len", "512",
            "--heldout", "0.2", "--draft-vocab", "0", "--quiet"]
    res = CliRunner().invoke(train_head_cmd, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    meta = json.loads((out / SIDECAR_META).read_text())
    assert "prompts:stdlib-code:3,stdlib-chat:2" in meta["data"]
    data = TrainData.load(out / "checkpoint" / "data.npz")
    assert len(data.sequences) == 10 + 5 * 2  # the job's rows (greedy only), the prompts greedy + 1 sampled
    general = list(range(10, 20))
    assert not set(data.heldout) & set(general) and data.heldout  # held-out rows are the job's own
    bundle = load(model)
    # a prompt takes at most half a training sequence (--seq-len 512)
    tokens, kinds = general_prompts(bundle.tokenizer, ["stdlib-code:3", "stdlib-chat:2"], seed=0, max_tokens=256)
    assert kinds == ["stdlib-code", "stdlib-chat", "stdlib-code", "stdlib-chat", "stdlib-code"]
    fit = [t for t in render(bundle.tokenizer, stdlib_prompts("stdlib-code", 12, 0)) if len(t) <= 256]
    assert tokens[0] == fit[0] and tokens[2] == fit[1] and tokens[4] == fit[2]
    eos = set(bundle.tokenizer.eos_token_ids)
    for k, p in enumerate(tokens):
        greedy, sampled = data.sequences[10 + 2 * k], data.sequences[10 + 2 * k + 1]
        assert greedy[: len(p)] == p and sampled[: len(p)] == p
        assert data.starts[10 + 2 * k] == len(p) - 1  # scored from the trunk's first generated token
        assert greedy[len(p):] == reference_tokens(bundle.model, p, 256, eos)[: len(greedy) - len(p)]
        assert len(greedy) > len(p)
    assert any(data.sequences[10 + 2 * k] != data.sequences[11 + 2 * k] for k in range(5))  # sampled differ


def test_data_seconds_keeps_the_continuations_finished_in_time(tiny_model):
    from tiny_models import reference_tokens

    bundle = load(tiny_model("llama"))
    prompts = [np.random.default_rng(i).integers(5, 500, 6).tolist() for i in range(12)]
    full = self_distill(bundle, prompts, 6, max_batch=2)
    assert len(full.sequences) == 12
    lines = []
    cut = self_distill(bundle, prompts, 6, max_batch=2, seconds=1e-6, log=lines.append)
    # the clock starts at the first finished continuation (a fresh GPU's kernel builds do not count),
    # so even a limit of ~0 keeps more than that first one
    assert 2 <= len(cut.sequences) < 12 and any("time limit" in l for l in lines)
    assert any(l.startswith("first continuation after") for l in lines)
    eos = set(bundle.tokenizer.eos_token_ids)
    for seq, g in zip(cut.sequences, cut.groups):  # each kept continuation is complete and the trunk's own
        assert seq == prompts[g] + reference_tokens(bundle.model, prompts[g], 6, eos)


def test_a_deadline_ends_generation_however_long_the_warm_up(tiny_model, tmp_path):
    """A deadline already past (a fresh host's warm-up ate the data budget) keeps what finished at
    the first result and stops, where `seconds` alone would run on; train_head sets it at half of
    --max-seconds, so training keeps its share."""
    import time

    bundle = load(tiny_model("llama"))
    prompts = [np.random.default_rng(i).integers(5, 500, 6).tolist() for i in range(12)]
    lines = []
    cut = self_distill(bundle, prompts, 6, max_batch=2, seconds=1e6, log=lines.append, deadline=time.monotonic())
    assert 1 <= len(cut.sequences) <= 2 and any("the deadline (half of --max-seconds)" in l for l in lines)
    free = self_distill(bundle, prompts, 6, max_batch=2, seconds=1e6)
    assert len(free.sequences) == 12


def test_train_head_sets_the_generation_deadline_at_half_its_time_limit(tiny_model, tmp_path, monkeypatch):
    import time

    from mtplx.training import head_data
    from mtplx.training.head_data import ReadData
    from mtplx.training.train_head import TrainConfig, train_head

    seen = []
    real = head_data.self_distill

    def spy(*args, **kw):
        import inspect

        seen.append(inspect.signature(real).bind(*args, **kw).arguments.get("deadline"))
        return real(*args, **kw)

    monkeypatch.setattr(head_data, "self_distill", spy)
    bundle = load(tiny_model("llama"))
    prompts = [np.random.default_rng(i).integers(5, 500, 8).tolist() for i in range(6)]
    t0 = time.monotonic()
    train_head(bundle, ReadData("prompts", prompts=prompts, max_new_tokens=6), tmp_path / "h",
               TrainConfig(steps=2, batch_size=2, seq_len=32, max_seconds=100.0))
    assert len(seen) == 1 and t0 + 49 < seen[0] < time.monotonic() + 50


def test_general_samples_gives_each_general_prompt_more_sampled_continuations(tiny_model):
    """--general-samples N: each --prompts prompt gets its greedy and N sampled continuations (the
    job's rows keep --samples-per-prompt); N = 1 is the default."""
    from mtplx.training.head_data import ReadData, build_data

    bundle = load(tiny_model("llama"))
    rows = [np.random.default_rng(i).integers(5, 500, 8).tolist() for i in range(4)]
    read = ReadData("rows", prompts=rows, max_new_tokens=6)
    cfg = TrainConfig(prompts=("stdlib-code:2",), general_samples=3, seq_len=512, gen_batch=8)
    data = build_data(bundle, read, cfg)
    assert len(data.sequences) == 4 and len(data.extra.sequences) == 2 * 4
    general, _ = general_prompts(bundle.tokenizer, ["stdlib-code:2"], 0, max_tokens=256)  # half of seq_len
    for k, p in enumerate(general):
        four = data.extra.sequences[4 * k : 4 * k + 4]
        assert all(s[: len(p)] == p for s in four) and len({tuple(s) for s in four}) > 1
    assert len(build_data(bundle, read, TrainConfig(prompts=("stdlib-code:2",), seq_len=512)).extra.sequences) == 4
    with pytest.raises(TrainHeadError, match="general_samples must be >= 0"):
        TrainConfig(general_samples=-1).check()
