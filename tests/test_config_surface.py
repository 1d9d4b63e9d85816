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
