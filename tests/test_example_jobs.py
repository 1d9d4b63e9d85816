"""Every job file in jobs/ is a valid job: each key known and each value passing its check (the
checks `validate` runs before anything is read or loaded)."""

from pathlib import Path

import pytest
import yaml

from pipelines.job.config import build_job

JOBS = sorted((Path(__file__).resolve().parent.parent / "jobs").glob("*.yaml"))


def test_the_examples_are_there():
    assert {"eval.yaml", "eval-mtp.yaml", "coder-draft.yaml"} <= {p.name for p in JOBS}


@pytest.mark.parametrize("path", JOBS, ids=[p.name for p in JOBS])
def test_an_example_job_passes_the_schema(path):
    job = build_job(yaml.safe_load(path.read_text()))
    assert job.name.startswith(path.stem)
