"""The config surface: which job fields a resume must keep is marked beside each field
(`pinned` in pipelines/job/config.py), and the fingerprint's parts are derived from those marks."""

from dataclasses import fields

from pipelines.job.config import build_job
from pipelines.job.fingerprint import fingerprint, fingerprint_parts

def test_fingerprint_parts_are_the_pinned_fields(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "x"}\n')
    raw = {"name": "x", "model": {"path": str(tmp_path)}, "input": {"path": str(data), "format": "jsonl"},
           "output": {"dir": str(tmp_path / "out")}}
    job = build_job(raw)
    parts = fingerprint_parts(job, str(tmp_path), [str(data)])
    for section in ("generation", "input", "output"):
        pinned = {f"{section}.{f.name}" for f in fields(getattr(job, section)) if f.metadata.get("pinned")}
        assert pinned == {k for k in parts if k.startswith(section + ".")} - {"input.files"}
    assert "generation.max_tokens" in parts and "input.limit" not in parts and "output.shard_rows" not in parts
    base = fingerprint(parts)
    for section, key, value in (("generation", "top_k", 5), ("input", "split", "test"), ("output", "keep_columns", ["a"])):
        changed = build_job({**raw, section: {**raw.get(section, {}), key: value}})
        assert fingerprint(fingerprint_parts(changed, str(tmp_path), [str(data)])) != base, key
    same = build_job({**raw, "input": {**raw["input"], "limit": 3}, "output": {**raw["output"], "shard_rows": 7}})
    assert fingerprint(fingerprint_parts(same, str(tmp_path), [str(data)])) == base


def test_each_job_key_is_a_field_with_its_check_beside_it():
    """The job file's keys are the config dataclasses' fields, each checked by the `setting` it
    declares: a key exists exactly where a field does, and the field's own check refuses."""
    import pytest

    from mtplx.config import ScheduleConfig, SpeculativeConfig
    from pipelines.errors import JobError
    from pipelines.job import config as jc

    owners = {"model": [jc.ModelConfig], "speculative": [SpeculativeConfig], "input": [jc.InputConfig],
              "generation": [jc.GenerationConfig], "schedule": [ScheduleConfig, jc.OrderingConfig],
              "output": [jc.OutputConfig], "executor": [jc.ExecutorConfig]}
    assert set(jc.SECTIONS) == set(owners)
    for section, classes in owners.items():
        declared = {f.name: f.metadata["check"] for cls in classes for f in fields(cls)}
        assert jc.SECTIONS[section] == declared, section
    base = {"name": "x", "model": {"path": "m"}, "input": {"path": "in.jsonl"}}
    for section, key, bad, expected in (("speculative", "depth", 17, "an integer in 1..16"),
                                        ("schedule", "memory_budget", "lots", '"auto", a byte count'),
                                        ("schedule", "window_rows", 0, "an integer >= 1"),
                                        ("model", "gguf_mode", "q4", "one of auto | dequantize | quantized")):
        with pytest.raises(JobError, match=rf"{section}\.{key}: expected {expected}"):
            jc.build_job({**base, section: {**base.get(section, {}), key: bad}})


def test_engine_settings_built_in_python_get_the_same_field_checks():
    import numpy as np
    import pytest

    from mtplx.config import ScheduleConfig, SpeculativeConfig

    with pytest.raises(ValueError, match=r"speculative\.depth: expected an integer in 1\.\.16, got 17"):
        SpeculativeConfig(depth=17)
    with pytest.raises(ValueError, match=r"schedule\.order: expected one of prefix \| length \| input"):
        ScheduleConfig(order="random")
    assert ScheduleConfig(memory_budget="2GiB", max_batch=np.int64(4)).memory_budget == 2 * 2**30
    assert SpeculativeConfig(compiled_verify=False).compiled_verify == "off"
