"""Job file loading: typed sections, refusals that name key/value/expected form, --set, fingerprint."""

import os

import pytest
import yaml

from mtplx.config import ScheduleConfig, SpeculativeConfig
from pipelines.job.config import JobConfig, apply_overrides, build_job, load_job, parse_override
from pipelines.errors import JobError
from pipelines.job.fingerprint import diff_fingerprint_parts, fingerprint, fingerprint_parts

DESIGN_JOB = """
name: eval
model: {path: models/demo, revision: null}
speculative:
  method: mtp
  depth: 3
  draft_model: null
  mtp_head: null
  compiled_verify: on
input:
  format: parquet
  path: data/eval.parquet
  split: train
  id_column: id
  prompt_column: prompt
  template: null
  chat_template: auto
generation: {max_tokens: 256, temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, stop: [], n: 1}
schedule:
  order: prefix
  max_batch: 32
  prefill_chunk: auto
  memory_budget: auto
output: {dir: runs/eval, shard_rows: 1000, keep_columns: []}
executor: local
"""


def raw(text=DESIGN_JOB):
    return yaml.safe_load(text)


def refused(data, *fragments):
    with pytest.raises(JobError) as e:
        build_job(data)
    for f in fragments:
        assert f in str(e.value), str(e.value)
    return str(e.value)


def test_design_job_loads_into_typed_sections():
    job = build_job(raw())
    assert isinstance(job, JobConfig)
    assert isinstance(job.speculative, SpeculativeConfig) and isinstance(job.schedule, ScheduleConfig)
    assert job.speculative.compiled_verify == "on"  # YAML reads bare `on` as True
    assert job.speculative.method == "mtp" and job.speculative.depth == 3
    assert job.generation.max_tokens == 256 and job.generation.stop == []
    assert job.generation.sampling_params().greedy
    assert job.schedule.order == "prefix" and job.ordering.window_rows == 4096
    assert job.executor.type == "local"
    assert os.path.isabs(job.output.dir) and job.output.dir.endswith("runs/eval")
    assert job.input.prompt_mode == "column" and job.input.prompt_field == "prompt"


def test_minimal_job_gets_defaults():
    job = build_job({"model": "m", "input": {"path": "x.parquet"}}, default_name="myjob")
    assert job.name == "myjob" and job.model.path == "m"
    assert job.output.dir.endswith(os.path.join("runs", "myjob"))
    assert job.speculative.method == "none" and job.generation.n == 1


def test_to_yaml_round_trips():
    job = build_job(raw())
    again = build_job(yaml.safe_load(job.to_yaml()))
    assert again == job


def test_wrong_type_names_key_value_and_form():
    data = raw()
    data["generation"]["max_tokens"] = "abc"
    refused(data, "generation.max_tokens: expected an integer >= 1, got 'abc'")
    data = raw()
    data["generation"]["max_tokens"] = True  # a bool is not an integer here
    refused(data, "generation.max_tokens: expected an integer >= 1, got True")
    data = raw()
    data["generation"]["top_p"] = 0
    refused(data, "generation.top_p: expected a number > 0.0 and <= 1.0, got 0")
    data = raw()
    data["speculative"]["depth"] = 40
    refused(data, "speculative.depth: expected an integer in 1..16, got 40")
    data = raw()
    data["schedule"]["order"] = "random"
    refused(data, "schedule.order: expected one of prefix | length | input, got 'random'")
    data = raw()
    data["input"]["format"] = "xml"
    refused(data, "input.format: expected one of parquet | arrow | jsonl | csv | hf")


def test_every_problem_reported_at_once():
    data = raw()
    data["generation"]["temperature"] = "hot"
    data["output"]["shard_rows"] = 0
    msg = refused(data, "generation.temperature", "output.shard_rows: expected an integer >= 1, got 0")
    assert msg.count("\n") >= 2


def test_unknown_keys_refused_with_suggestion():
    data = raw()
    data["generation"]["max_token"] = 5
    refused(data, "generation.max_token: unknown key (did you mean 'max_tokens'?)")
    data = raw()
    data["outptu"] = {}
    refused(data, "outptu: unknown key (did you mean 'output'?)")


def test_required_keys():
    refused({"input": {"path": "x"}}, "model.path: required, missing")
    refused({"model": "m", "input": {"format": "csv"}}, "input.path: required, missing")
    refused(["not", "a", "mapping"], "expected a mapping")


def test_memory_budget_sizes():
    data = raw()
    data["schedule"]["memory_budget"] = "2GiB"
    assert build_job(data).schedule.memory_budget == 2 * 2**30
    data["schedule"]["memory_budget"] = "lots"
    refused(data, "schedule.memory_budget")


def test_executor_forms():
    assert build_job({**raw(), "executor": "ray"}).executor.type == "ray"
    job = build_job({**raw(), "executor": {"type": "ray", "address": "auto", "concurrency": 2, "num_gpus": 1}})
    assert job.executor.concurrency == 2 and job.executor.num_gpus == 1.0
    refused({**raw(), "executor": "slurm"}, "executor.type: expected one of local | ray, got 'slurm'")
    refused({**raw(), "executor": {"type": "ray", "workers": 3}}, "executor.workers: unknown key")


@pytest.mark.parametrize("template", ["{x.__class__}", "{x[0]}", "{x:>10}", "{x!r}", "{}", "{_private}",
                                      "open { brace", "close } brace"])
def test_unsafe_or_malformed_templates_are_invalid_jobs(template):
    data = raw()
    data["input"].pop("prompt_column")
    data["input"]["template"] = template
    refused(data, "input.template:")


def test_prompt_sources_are_exclusive():
    data = raw()
    data["input"]["template"] = "{q}"
    refused(data, "give only one of template and prompt_column")
    data = raw()
    data["input"]["messages_column"] = "messages"
    refused(data, "input.messages_column")


def test_keep_column_may_not_shadow_output_column():
    data = raw()
    data["output"]["keep_columns"] = ["completion"]
    refused(data, "output.keep_columns: 'completion' clashes")


PREDICTOR_REFUSALS = [
    (dict(generation={"n": 0}), "generation.n: expected an integer >= 1, got 0"),
    (dict(generation={"top_p": 0}), "generation.top_p: expected a number > 0.0 and <= 1.0, got 0"),
    (dict(generation={"max_token": 3}), "generation.max_token: unknown key (did you mean 'max_tokens'?)"),
    (dict(speculative={"depth": 0}), "speculative.depth: expected an integer in 1..16, got 0"),
    (dict(schedule={"order": "fastest"}), "schedule.order: expected one of prefix | length | input, got 'fastest'"),
    (dict(template="{q}", prompt_column="q"), "input.template: give only one of template and prompt_column"),
    (dict(chat_template="maybe"), "input.chat_template: expected one of auto | on | off, got 'maybe'"),
]


@pytest.mark.parametrize("settings,message", PREDICTOR_REFUSALS, ids=[m.split(":")[0] for _, m in PREDICTOR_REFUSALS])
def test_the_predictor_refuses_what_a_job_file_refuses(settings, message):
    """MTPLXPredictor's settings go through the job file's checks (before any weights load), with
    the same message a job file gets."""
    from pipelines.execution.ray_engine import MTPLXPredictor

    with pytest.raises((JobError, ValueError)) as got:
        MTPLXPredictor("models/none", **settings)
    assert message in str(got.value)
    data = raw()
    for key, value in settings.items():
        if isinstance(value, dict):
            data[key] = {**(data.get(key) or {}), **value}
        else:
            data["input"][key] = value
    refused(data, message)


def test_a_config_changed_after_construction_is_checked_again():
    from pipelines.execution.ray_engine import MTPLXPredictor
    from pipelines.job.config import GenerationConfig

    with pytest.raises(ValueError, match="generation.n: expected an integer >= 1, got 0"):
        GenerationConfig(n=0)
    gen = GenerationConfig()
    gen.top_p = 0.0
    with pytest.raises(ValueError, match="generation.top_p"):
        MTPLXPredictor("models/none", generation=gen)


def test_overrides_parse_as_yaml_and_go_through_checks(tmp_path):
    assert parse_override('generation.stop=["\\n", "."]') == (["generation", "stop"], ["\n", "."])
    assert parse_override("generation.temperature=0.7")[1] == 0.7
    assert parse_override("input.id_column=")[1] is None
    data = apply_overrides(raw(), ["generation.max_tokens=12", "model.revision=abc", "executor.type=ray"])
    job = build_job(data)
    assert job.generation.max_tokens == 12 and job.model.revision == "abc" and job.executor.type == "ray"
    # a shorthand section expands into a mapping when a sub-key is set
    data = apply_overrides({"model": "m", "input": {"path": "p"}}, ["model.trust_remote_code=true"])
    assert data["model"] == {"path": "m", "trust_remote_code": True}
    with pytest.raises(JobError, match="expected key.path=value"):
        parse_override("generation.max_tokens")
    with pytest.raises(JobError, match="not a mapping"):
        apply_overrides(raw(), ["name.x=1"])
    job_file = tmp_path / "j.yaml"
    job_file.write_text(DESIGN_JOB)
    with pytest.raises(JobError, match="generation.max_tokens: expected an integer >= 1, got 'abc'"):
        load_job(job_file, ["generation.max_tokens=abc"])
    with pytest.raises(JobError, match="generation.max_tokenz: unknown key"):
        load_job(job_file, ["generation.max_tokenz=3"])


def test_yaml_errors_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ninput: {path: [unclosed\n")
    with pytest.raises(JobError, match="not valid YAML at line"):
        load_job(bad)
    with pytest.raises(JobError, match="cannot read"):
        load_job(tmp_path / "missing.yaml")
    bad.write_text("!!python/object:os.system ls")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(bad)  # the safe loader refuses object tags


def _parts(tmp_path, **changes):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    if not (model / "config.json").exists():
        (model / "config.json").write_text('{"model_type": "llama"}')
        (model / "tokenizer.json").write_text("{}")
    data_file = tmp_path / "in.jsonl"
    if not data_file.exists():
        data_file.write_text('{"prompt": "hi"}\n')
    data = raw()
    data["input"].update(path=str(data_file), format="jsonl")
    data["model"]["path"] = str(model)
    for key, value in changes.items():
        section, name = key.split("__")
        data[section][name] = value
    job = build_job(data)
    return fingerprint_parts(job, str(model), [str(data_file)])


def test_fingerprint_names_what_changed(tmp_path):
    base = _parts(tmp_path)
    assert fingerprint(base) == fingerprint(_parts(tmp_path))
    # speed-only settings do not change the fingerprint
    assert fingerprint(base) == fingerprint(_parts(tmp_path, speculative__method="ngram", schedule__max_batch=4,
                                                   output__shard_rows=7))
    changed = _parts(tmp_path, generation__max_tokens=10, input__chat_template="off")
    assert diff_fingerprint_parts(base, changed) == ["generation.max_tokens", "input.chat_template"]
    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n')
    assert diff_fingerprint_parts(base, _parts(tmp_path)) == ["input.files"]
    (tmp_path / "model" / "tokenizer.json").write_text('{"x": 1}')
    assert "model.tokenizer_sha256" in diff_fingerprint_parts(base, _parts(tmp_path))
