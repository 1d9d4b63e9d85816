"""`input.format: openai-batch`: requests in, per-request settings honoured, results out."""

import json
import os

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, write_job, write_jsonl
from mtplx.request import SamplingParams, derive_seed
from pipelines.cli.commands import main
from pipelines.job.config import build_job
from pipelines.errors import JobError
from pipelines.io.export import export_run
from pipelines.io.openai_batch import RowParams, parse_request
from pipelines.io.prompts import RowError
from pipelines.execution.session import run_job
from pipelines.cli.validate import validate_job


def req(cid, content="Tell me a story about a cat.", url="/v1/chat/completions", **body):
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "gpt-4o-mini", "messages": messages, **body}}


# ------------------------------------------------------------------ request parsing


def parse(body, samples=1, **line):
    return parse_request({"method": "POST", "url": "/v1/chat/completions", "body": body, **line}, samples)


def test_body_fields_map_onto_sampling_params():
    p, ignored = parse({"model": "x", "messages": [], "max_completion_tokens": 7, "max_tokens": 99,
                        "temperature": 0.5, "top_p": 0.9, "stop": "END", "seed": 11, "n": 1, "user": "u",
                        "logprobs": False})
    assert p == RowParams(max_tokens=7, temperature=0.5, top_p=0.9, stop=("END",), seed=11)
    assert ignored == ["user", "logprobs"]
    base = SamplingParams(max_tokens=256, temperature=0.0, top_p=1.0, top_k=5, stop=("x",))
    assert p.apply(base) == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, stop=("END",))
    p, _ = parse({"messages": [], "max_tokens": 3, "stop": ["a", "b"]})
    assert p.apply(base) == SamplingParams(max_tokens=3, temperature=0.0, top_p=1.0, top_k=5, stop=("a", "b"))
    assert parse({"messages": []})[0].apply(base) is base  # nothing given: the job's settings


@pytest.mark.parametrize("body,line,match", [
    ({"tools": [{"type": "function"}]}, {}, "body.tools"),
    ({"response_format": {"type": "json_object"}}, {}, "body.response_format"),
    ({"logprobs": True}, {}, "body.logprobs"),
    ({"frequency_penalty": 0.5}, {}, "body.frequency_penalty"),
    ({"stream": True}, {}, "body.stream"),
    ({"n": 3}, {}, "set generation.n: 3"),
    ({"temperature": 2.5}, {}, "body.temperature must be a number >= 0.0 and <= 2.0"),
    ({"top_p": 0}, {}, "use temperature: 0 for greedy"),
    ({"max_tokens": 0}, {}, "body.max_tokens must be an integer >= 1"),
    ({"stop": [1]}, {}, "body.stop"),
    ({"seed": "7"}, {}, "body.seed must be an integer"),
    ({"audio": {}}, {}, "body.audio is not supported"),
    ({}, {"url": "/v1/embeddings"}, "only /v1/chat/completions"),
    ({}, {"method": "GET"}, "method must be POST"),
])
def test_unsupported_requests_are_row_errors(body, line, match):
    with pytest.raises(RowError, match=match):
        parse({"messages": [], **body}, **line)


def test_config_for_openai_batch(tmp_path):
    raw = {"model": "m", "input": {"format": "openai-batch", "path": "x.jsonl"}}
    inp = build_job(raw).input
    assert (inp.id_column, inp.messages_column) == ("custom_id", "messages")
    # the stored job (job.yaml) loads again unchanged
    assert build_job(build_job(raw).to_dict()).input == inp
    with pytest.raises(JobError, match="openai-batch takes the prompt from body.messages"):
        build_job({"model": "m", "input": {"format": "openai-batch", "path": "x", "prompt_column": "p"}})
    with pytest.raises(JobError, match="openai-batch reads custom_id as the id"):
        build_job({"model": "m", "input": {"format": "openai-batch", "path": "x", "id_column": "id"}})


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def batch_lines():
    story = "Tell me a story about a cat."
    return [
        req("short", story, max_tokens=3),                                    # 0 per-row max_tokens
        req("long", story, max_completion_tokens=12),                         # 1 same prompt, more tokens
        req("default", story),                                                # 2 job's max_tokens (10)
        req("hot-1", story, temperature=1.0, seed=1, max_tokens=8),           # 3 sampled, own seed
        req("hot-2", story, temperature=1.0, seed=2, max_tokens=8),           # 4
        req("parts", [{"role": "developer", "content": "Be brief."},          # 5 content parts, developer
                      {"role": "user", "content": [{"type": "text", "text": story}]}], max_tokens=4, user="abc"),
        req("tools", story, tools=[{"type": "function", "function": {"name": "f"}}]),   # 6 unsupported
        req("embed", story, url="/v1/embeddings"),                            # 7 unsupported url
        b'{"custom_id": "cut", "body": ',                                     # 8 not JSON
        req("short", "duplicate custom_id"),                                  # 9 duplicate
        req("image", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),  # 10
    ]


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("oai")
    data = write_jsonl(tmp / "batch.jsonl", batch_lines())
    raw = job_dict(model, data, tmp / "run", generation={"max_tokens": 10}, speculative={"method": "ngram"})
    raw["input"] = {"format": "openai-batch", "path": str(data)}
    job = build_job(raw)
    log = []
    run_job(job, log=log.append)
    return job, log


def test_requests_run_with_their_own_settings(batch_run):
    job, log = batch_run
    out = {r["row"]: r for r in read_output(job.output.dir)}
    assert len(out) == 11
    assert [out[i]["id"] for i in range(11)] == ["short", "long", "default", "hot-1", "hot-2", "parts", "tools",
                                                 "embed", None, "short", "image"]
    # per-row max_tokens (greedy: the shorter completion is a prefix of the longer one)
    assert (out[0]["completion_tokens"], out[0]["finish_reason"]) == (3, "length")
    assert (out[1]["completion_tokens"], out[1]["finish_reason"]) == (12, "length")
    assert (out[2]["completion_tokens"], out[2]["finish_reason"]) == (10, "length")
    assert out[1]["completion"].startswith(out[0]["completion"]) and out[2]["completion"].startswith(
        out[0]["completion"])
    # per-row seed: the sampling seed derives from (body.seed, custom_id, sample)
    assert out[3]["seed"] == derive_seed(1, "hot-1", 0) and out[4]["seed"] == derive_seed(2, "hot-2", 0)
    assert out[2]["seed"] == derive_seed(0, "default", 0)
    assert out[5]["completion_tokens"] == 4 and out[5]["error"] is None
    # unsupported or broken requests are error rows that keep their custom_id
    assert "body.tools" in out[6]["error"] and "only /v1/chat/completions" in out[7]["error"]
    assert "not valid JSON" in out[8]["error"]
    assert "duplicate id 'short'" in out[9]["error"]
    assert "a part of type 'image_url'" in out[10]["error"]
    # ignored fields are named once in the log
    assert any("body.model ('gpt-4o-mini') is ignored" in m for m in log)
    assert sum("body.user is ignored" in m for m in log) == 1


def test_openai_batch_round_trip(batch_run, tmp_path):
    job, _ = batch_run
    out = tmp_path / "results.jsonl"
    res = export_run(job.output.dir, "openai-batch", str(out))
    ok = [json.loads(line) for line in out.read_text().splitlines()]
    bad = [json.loads(line) for line in (tmp_path / "results_errors.jsonl").read_text().splitlines()]
    assert (res.written, res.failed) == (6, 5)
    assert [x["custom_id"] for x in ok] == ["short", "long", "default", "hot-1", "hot-2", "parts"]
    assert [x["custom_id"] for x in bad] == ["tools", "embed", None, "short", "image"]
    assert len({x["id"] for x in ok + bad}) == 10  # the duplicate "short" shares its id with the first
    rows = {r["row"]: r for r in read_output(job.output.dir)}
    for line, row in zip(ok, [rows[i] for i in range(6)]):
        body = line["response"]["body"]
        (choice,) = body["choices"]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == row["completion"]
        assert choice["finish_reason"] == row["finish_reason"]
        assert body["usage"] == {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
                                 "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
                                 "prompt_tokens_details": {"cached_tokens": row["cached_prompt_tokens"]}}
        assert body["object"] == "chat.completion" and body["model"] == os.path.basename(job.model.path)
    assert bad[0]["response"]["status_code"] == 400
    assert bad[0]["response"]["body"]["error"]["code"] == "unsupported_request"
    assert bad[2] == {"id": bad[2]["id"], "custom_id": None, "response": None,
                      "error": {"code": "unreadable_input_row", "message": rows[8]["error"]}}


def test_samples_become_choices_and_validate_lists_bad_requests(tmp_path, model):
    data = write_jsonl(tmp_path / "b.jsonl", [req("a", n=2, temperature=0.9, max_tokens=4), req("b", max_tokens=4),
                                              req("c", n=3), req("d", logit_bias={"1": 5})])
    raw = job_dict(model, data, tmp_path / "run", generation={"n": 2})
    raw["input"] = {"format": "openai-batch", "path": str(data)}
    jobfile = write_job(tmp_path / "job.yaml", raw)
    r = CliRunner().invoke(main, ["validate", str(jobfile)])
    assert r.exit_code == 1 and "2 ready, 2 would be error rows" in r.stdout
    assert "c: openai-batch: body.n=3" in r.stdout and "d: openai-batch: body.logit_bias" in r.stdout
    r = CliRunner().invoke(main, ["run", str(jobfile), "--quiet"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--format", "openai-batch",
                                  "--out", str(tmp_path / "res.jsonl")])
    assert r.exit_code == 0, r.output
    ok = [json.loads(x) for x in (tmp_path / "res.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in ok] == ["a", "b"]
    assert [[c["index"] for c in x["response"]["body"]["choices"]] for x in ok] == [[0, 1], [0, 1]]
    bad = [json.loads(x) for x in (tmp_path / "res_errors.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in bad] == ["c", "d"]


def test_validate_counts_without_weights(tmp_path, model, monkeypatch):
    import pipelines.execution.opening as opening

    monkeypatch.setattr(opening, "load_engine", lambda job, tokenizer=None: pytest.fail("validate must not load weights"))
    data = write_jsonl(tmp_path / "b.jsonl", batch_lines())
    raw = job_dict(model, data, tmp_path / "run")
    raw["input"] = {"format": "openai-batch", "path": str(data)}
    rep = validate_job(build_job(raw))
    assert rep.rows == 11 and rep.bad_rows == 5
    assert [e[1] for e in rep.examples] == ["tools", "embed", None, "short", "image"]
