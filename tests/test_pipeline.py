"""Prompts, ordering and the runner end to end on a tiny real model with the real engine."""

import math

import pytest
import yaml

from jobkit import job_dict, read_output, sample_rows, write_jsonl, write_parquet
from mtplx.config import ScheduleConfig, SpeculativeConfig
from pipelines.job.config import InputConfig, build_job
from pipelines.errors import JobError, RunError
from pipelines.execution.ordering import common_prefix, length_order, ordered, prefix_groups
from pipelines.io.prompts import PromptRenderer, RowError
from pipelines.job.template import Field, parse_template
from pipelines.execution.session import run_job

try:
    from mtplx.generation import Engine
except ImportError:  # pragma: no cover - only while the engine module is being written
    Engine = None

needs_engine = pytest.mark.skipif(Engine is None, reason="mtplx.generation.Engine does not exist yet")


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer(llama):
    from mtplx.models.loading import load_tokenizer_only

    return load_tokenizer_only(llama)


# ------------------------------------------------------------------ prompts


def test_template_parser_and_escapes():
    assert parse_template("{{literal}} {question}\nAnswer:") == ["{literal} ", Field("question"), "\nAnswer:"]
    assert parse_template("{a b}-{c-d}") == [Field("a b"), "-", Field("c-d")]


def renderer(tokenizer, **kw):
    return PromptRenderer(InputConfig(path="x", **kw), tokenizer)


def test_template_rendering_and_row_errors(tokenizer):
    r = renderer(tokenizer, template="Q: {question} ({n}, {x}, {flag})", chat_template="off")
    assert r.text({"question": "why", "n": 3, "x": 0.5, "flag": True}) == "Q: why (3, 0.5, true)"
    assert r.columns == ["question", "n", "x", "flag"]
    for bad, reason in [
        ({"question": "q", "n": 1, "x": math.nan, "flag": 1}, "is nan"),
        ({"question": "q", "n": 1, "x": math.inf, "flag": 1}, "is inf"),
        ({"question": None, "n": 1, "x": 1.0, "flag": 1}, "is null"),
        ({"n": 1, "x": 1.0, "flag": 1}, "this row has no column 'question'"),
        ({"question": ["a"], "n": 1, "x": 1.0, "flag": 1}, "is a list"),
        ({"question": b"\xff\xfe", "n": 1, "x": 1.0, "flag": 1}, "not UTF-8"),
    ]:
        with pytest.raises(RowError, match=reason):
            r.text(bad)


def test_prompt_column_row_errors(tokenizer):
    r = renderer(tokenizer, prompt_column="p", chat_template="off")
    assert r.tokens({"p": "hi there"}) == tokenizer.encode("hi there")
    for value, reason in [(None, "is null"), (7, "is an int, not a string"), ("   ", "prompt is empty"),
                          ("bad \udcff", "undecodable"), (b"caf\xe9", "not UTF-8")]:
        with pytest.raises(RowError, match=reason):
            r.tokens({"p": value})


def test_chat_template_auto_wraps_plain_prompts(tokenizer):
    r = renderer(tokenizer, chat_template="auto")
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert r.tokens({"prompt": "hi"}) == tokenizer.encode(expected, add_special_tokens=False)
    assert renderer(tokenizer, chat_template="off").tokens({"prompt": "hi"}) == tokenizer.encode("hi")


def test_messages_column(tokenizer):
    r = renderer(tokenizer, messages_column="m")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r.tokens({"m": msgs}) == tokenizer.encode(text, add_special_tokens=False)
    for value, reason in [(None, "is null"), ("hi", "is a string"), ([], "non-empty list"),
                          ([{"content": "x"}], "string role"), ([{"role": "user", "content": 3}], "not a string"),
                          ([{"role": "user", "content": " "}], "all messages are empty")]:
        with pytest.raises(RowError, match=reason):
            r.tokens({"m": value})
    with pytest.raises(JobError, match="needs a chat template"):
        renderer(tokenizer, messages_column="m", chat_template="off")


# ------------------------------------------------------------------ ordering


def test_length_order_longest_first():
    toks = [[1] * 3, [1] * 9, [1] * 5, [1] * 9]
    assert length_order(toks) == [1, 3, 2, 0]


def test_prefix_groups_share_prefix_then_length():
    pre = list(range(100, 130))  # 30 shared tokens
    toks = [
        [1, 2, 3],  # 0: alone, short
        pre + [5, 6],  # 1: group A
        [9] * 40,  # 2: alone, longest
        pre + [7, 8, 9, 10],  # 3: group A
        pre[:10] + [4],  # 4: shares only 10 tokens: below the minimum
    ]
    order, plen = prefix_groups(toks, min_prefix=16)
    assert order == [2, 3, 1, 4, 0]
    assert plen == [0, 30, 0, 30, 0]
    assert common_prefix(toks[1], toks[3]) == 30
    # identical prompts: the edge stops one short so the last token is prefilled
    order, plen = prefix_groups([pre, pre], min_prefix=16)
    assert plen == [29, 29]
    # several samples of one row share the whole prompt
    assert prefix_groups([pre], min_prefix=16, samples=2)[1] == [29]
    assert prefix_groups([pre], min_prefix=16, samples=1)[1] == [0]


def test_ordering_is_windowed_and_errors_pass_through():
    class It:
        def __init__(self, i, toks):
            self.i, self.tokens = i, toks

    items = [It(i, [1] * (i + 1)) for i in range(10)] + [It(10, None)]
    got = [(it.i, p) for it, p in ordered(items, "length", lambda it: it.tokens, window_rows=4)]
    assert [i for i, _ in got] == [3, 2, 1, 0, 7, 6, 5, 4, 10, 9, 8]  # error row not held back
    assert [it.i for it, _ in ordered(items, "input", lambda it: it.tokens, window_rows=4)] == list(range(11))


# ------------------------------------------------------------------ runner


@pytest.fixture(scope="module")
def engine(llama):
    return Engine.load(llama, SpeculativeConfig(), ScheduleConfig(max_batch=4)) if Engine else None


def make_job(tmp_path, llama, rows=None, **sections):
    data = tmp_path / "in.parquet"
    write_parquet(data, rows if rows is not None else sample_rows())
    return build_job(job_dict(llama, data, tmp_path / "run", **sections))


def mlx_lm_greedy(model, tokenizer, tokens, max_tokens):
    import mlx_lm

    out = []
    for resp in mlx_lm.stream_generate(model, tokenizer, tokens, max_tokens=max_tokens):
        if resp.finish_reason == "stop" and resp.token in tokenizer.eos_token_ids:
            break
        out.append(resp.token)
    return tokenizer.decode(out)


@needs_engine
@pytest.mark.parametrize("order,method", [("input", "none"), ("length", "none"), ("prefix", "none"),
                                          ("prefix", "ngram")])
def test_greedy_matches_mlx_lm_for_each_order(tmp_path, llama, order, method):
    job = make_job(tmp_path, llama, schedule={"order": order, "max_batch": 4, "min_prefix_tokens": 8},
                   speculative={"method": method}, generation={"max_tokens": 10})
    eng = Engine.load(llama, job.speculative, job.schedule)
    summary = run_job(job, engine=eng)
    out = read_output(job.output.dir)
    assert summary.outputs == len(out) == 12 and summary.errors == 0
    r = PromptRenderer(job.input, eng.tokenizer)
    for row, src in zip(out, sample_rows()):
        assert row["id"] == src["id"] and row["error"] is None
        want = mlx_lm_greedy(eng.model, eng.tokenizer, r.tokens(src), 10)
        assert row["completion"] == want, (order, row["id"])
    if order == "prefix":  # grouped rows got a stable prefix, and the engine reused it
        assert sum(row["cached_prompt_tokens"] for row in out) > 0


@needs_engine
def test_every_row_and_sample_exactly_once_with_keep_columns(tmp_path, llama, engine):
    job = make_job(tmp_path, llama, generation={"max_tokens": 4, "n": 3, "temperature": 0.8, "seed": 5},
                   output={"shard_rows": 4, "keep_columns": ["topic", "weight"]})
    run_job(job, engine=engine)
    out = read_output(job.output.dir)
    assert [(r["row"], r["sample"]) for r in out] == [(i, s) for i in range(12) for s in range(3)]
    src = sample_rows()
    for r in out:
        assert r["topic"] == src[r["row"]]["topic"] and r["weight"] == src[r["row"]]["weight"]
        assert r["finish_reason"] in ("stop", "length") and r["prompt_tokens"] > 0
    # a second run of the same job has nothing left to do
    again = run_job(job, engine=engine)
    assert again.outputs == 0 and again.skipped == 36
    # sampled rows reproduce: the seed comes from (job seed, id, sample)
    first = {(r["row"], r["sample"]): (r["completion"], r["seed"]) for r in out}
    run_job(job, engine=engine, restart=True)
    assert {(r["row"], r["sample"]): (r["completion"], r["seed"]) for r in read_output(job.output.dir)} == first


@needs_engine
def test_each_bad_row_kind_becomes_an_error_row(tmp_path, tiny_model):
    model = tiny_model("llama", max_position_embeddings=64)
    long_prompt = " ".join(["word"] * 200)
    lines = [
        {"id": "ok", "prompt": "What is two plus two?", "x": 1.0},
        {"id": "null", "prompt": None},
        {"id": "int", "prompt": 42},
        {"id": "empty", "prompt": ""},
        {"id": "long", "prompt": long_prompt},
        {"id": "ok", "prompt": "duplicate id"},
        b'{"id": "trunc", "prompt": ',
        b'{"id": "latin", "prompt": "caf\xe9"}',
        {"id": "surrogate", "prompt": "bad \udcff text"},
        {"prompt": "no id here"},
        {"id": "ok2", "prompt": "What is three plus four?"},
    ]
    data = write_jsonl(tmp_path / "in.jsonl", lines)
    job = build_job(job_dict(model, data, tmp_path / "run", fmt="jsonl", input={"chat_template": "off"}))
    summary = run_job(job)
    out = read_output(job.output.dir)
    assert len(out) == len(lines) and summary.errors == len(lines) - 2
    by_row = {r["row"]: r for r in out}
    assert by_row[0]["finish_reason"] != "error" and by_row[10]["finish_reason"] != "error"
    expected = {1: "is null", 2: "is an int", 3: "prompt is empty", 4: "context holds 64",
                5: "duplicate id 'ok'", 6: "not valid JSON", 7: "not UTF-8", 8: "undecodable",
                9: "no id column 'id'"}
    for row, reason in expected.items():
        r = by_row[row]
        assert r["finish_reason"] == "error" and r["completion"] is None and reason in r["error"], r


@needs_engine
def test_template_job_with_hash_ids(tmp_path, llama, engine):
    rows = [{"question": "Why is the sky blue?", "score": 1.5}, {"question": "Why?", "score": math.nan},
            {"question": "Why is the sky blue?", "score": 1.5}]
    job = make_job(tmp_path, llama, rows=rows,
                   input={"id_column": None, "prompt_column": None, "template": "{question} (score {score})\nAnswer:"})
    run_job(job, engine=engine)
    out = read_output(job.output.dir)
    assert out[0]["finish_reason"] != "error" and len(out[0]["id"]) == 20
    assert "is nan" in out[1]["error"]
    assert "identical to an earlier row" in out[2]["error"] and out[2]["id"] == out[0]["id"]


class FailingEngine:
    """The real engine, but it raises after `after` results (a crash mid-run)."""

    def __init__(self, engine, after):
        self.engine, self.after = engine, after
        self.tokenizer, self.max_context = engine.tokenizer, engine.max_context

    def generate(self, requests):
        for i, result in enumerate(self.engine.generate(requests)):
            if i == self.after:
                raise RuntimeError("device lost")
            yield result


@needs_engine
def test_engine_crash_keeps_finished_rows_and_resume_completes(tmp_path, llama, engine):
    job = make_job(tmp_path, llama, output={"shard_rows": 100})
    with pytest.raises(RuntimeError, match="device lost"):
        run_job(job, engine=FailingEngine(engine, after=5))
    assert len(read_output(job.output.dir)) >= 5  # finished rows were flushed, not lost
    summary = run_job(job, engine=engine)
    out = read_output(job.output.dir)
    assert [r["row"] for r in out] == list(range(12)) and summary.skipped >= 5


@needs_engine
def test_engine_error_results_become_error_rows(tmp_path, llama):
    job = make_job(tmp_path, llama, schedule={"memory_budget": 4096})
    eng = Engine.load(llama, job.speculative, job.schedule)
    with pytest.raises(RunError, match="every one of the 12 output rows is an error row"):  # committed, and a failure
        run_job(job, engine=eng)
    out = read_output(job.output.dir)
    assert len(out) == 12 and all(r["finish_reason"] == "error" and "memory_budget" in r["error"] for r in out)


@needs_engine
def test_a_tight_memory_budget_runs_every_row(tmp_path, llama):
    """A budget of two rows' worth: rows wait for a slot instead of being dropped (the run used to
    end with 'the engine stopped with N requests unanswered')."""
    from mtplx.request import Request, SamplingParams

    probe = make_job(tmp_path, llama)
    eng = Engine.load(llama, probe.speculative, probe.schedule)
    row, _ = eng.scheduler.new_row(Request(key=0, prompt_tokens=[5] * 128, params=SamplingParams(max_tokens=probe.generation.max_tokens)))
    budget = 2 * eng.scheduler.alone(row)  # (no prompt of the job is longer)
    job = make_job(tmp_path, llama, schedule={"memory_budget": budget, "max_batch": 8})
    run_job(job, engine=Engine(eng.bundle, job.speculative, job.schedule))
    out = read_output(job.output.dir)
    assert [r["row"] for r in out] == list(range(12)) and all(r["error"] is None for r in out)


@needs_engine
def test_limit_then_continue(tmp_path, llama, engine):
    job = make_job(tmp_path, llama)
    assert run_job(job, engine=engine, limit=5).outputs == 5
    assert [r["row"] for r in read_output(job.output.dir)] == list(range(5))
    assert run_job(job, engine=engine).outputs == 7
    assert [r["row"] for r in read_output(job.output.dir)] == list(range(12))


def test_invalid_input_refused_before_weights_load(tmp_path, llama, monkeypatch):
    import pipelines.execution.opening as opening

    def boom(job, tokenizer=None):
        raise AssertionError("weights must not load for an invalid job")

    monkeypatch.setattr(opening, "load_engine", boom)
    with pytest.raises(JobError, match="no column 'question'"):
        run_job(make_job(tmp_path, llama, input={"prompt_column": "question"}))
    with pytest.raises(JobError, match="in.parquet: no column 'nope'"):
        run_job(make_job(tmp_path, llama, output={"keep_columns": ["nope"]}))
    bad_model = make_job(tmp_path, llama)
    bad_model.model.path = str(tmp_path / "no-model")
    with pytest.raises(JobError, match="model.path"):
        run_job(bad_model)


def test_job_yaml_in_run_dir_is_the_resolved_job(tmp_path, llama, monkeypatch):
    import pipelines.execution.opening as opening

    monkeypatch.setattr(opening, "load_engine", lambda job, tokenizer=None: (_ for _ in ()).throw(RunError("no engine here")))
    job = make_job(tmp_path, llama)
    with pytest.raises(RunError):
        run_job(job)
    stored = yaml.safe_load((tmp_path / "run" / "job.yaml").read_text())
    assert build_job(stored) == job


@needs_engine
def test_one_engine_loop_serves_callers_without_draining_between_them(llama):
    """EngineLoop (the Ray actors' engine): a second caller's rows join the generate() the first
    caller's rows run in, so the first caller's odd last row shares its rounds with the second
    caller's first row instead of running alone; every caller gets exactly its own rows."""
    import threading

    from mtplx.request import SamplingParams
    from pipelines.execution.ray_engine import EngineLoop
    from pipelines.execution.work import Work
    from pipelines.io.rows import Item

    gate = threading.Event()
    engine = Engine.load(llama, SpeculativeConfig(), ScheduleConfig(max_batch=2))
    loop = EngineLoop(lambda: gate.wait() and engine, SamplingParams(max_tokens=10), seed=0)

    def work(tag, n):
        return [Work(Item(index=i, id=f"{tag}{i}", tokens=[5 + i, 7, 9, 11 + i]), [0]) for i in range(n)]

    first, second = loop.rows(work("a", 3)), loop.rows(work("b", 3))  # both queued before the engine is up
    gate.set()
    assert loop.ready() is engine
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("b", [r for chunk in second for r in chunk]))
    reader.start()
    got["a"] = [r for chunk in first for r in chunk]
    reader.join()
    for tag in "ab":
        assert sorted((r["row"], r["id"]) for r in got[tag]) == [(i, f"{tag}{i}") for i in range(3)]
    width = {r["id"]: r["batch_width"] for r in got["a"] + got["b"]}
    assert width["a2"] == 2, width  # drained between callers, a2 would have run alone (width 1)
