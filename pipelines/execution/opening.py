"""Opening a job's model before any weights load: its files, its tokenizer, its context length
(the input opens in pipelines/io/job_input.py). Every problem found here is a JobError (exit 2), so
`run` and `validate` refuse the same jobs with the same messages. `load_engine` is the one place
weights load."""

from __future__ import annotations

import json
import os
from typing import Optional

from ..errors import JobError, RunError
from ..job.config import JobConfig


def load_engine(job: JobConfig, tokenizer=None):
    """The job's engine; `tokenizer`: the model's, already loaded by `load_tokenizer` (not loaded again)."""
    from mtplx.process import prepare_process

    prepare_process()  # in a Ray actor, the first code of the job's to run (the CLI has run it already)
    try:
        from mtplx.generation import Engine
    except ImportError as e:
        raise RunError(f"the generation engine is not available ({e})")
    return Engine.load(job.model.path, job.speculative, job.schedule,
                       trust_remote_code=job.model.trust_remote_code, gguf_mode=job.model.gguf_mode,
                       tokenizer=tokenizer)


def check_remote_code(job: JobConfig) -> None:
    """Refuse (before anything loads) a model whose config.json names a Python file to run
    (`model_file`, which mlx-lm would import), unless the job sets model.trust_remote_code."""
    if job.model.trust_remote_code:
        return
    path = os.path.join(resolve_model_dir(job), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # a missing or broken config.json is reported by the loader
    if isinstance(config, dict) and config.get("model_file") is not None:
        raise JobError(
            f"model.path: {path} sets model_file: {config['model_file']!r}, Python code shipped with the "
            "model that would run on load; running it is off by default. If you trust this model, set "
            "model.trust_remote_code: true in the job"
        )


def check_mtp_head(job: JobConfig) -> None:
    """`method: mtp` without `mtp_head` needs the model's own head: refuse, before weights load, a
    checkpoint that has none (its safetensors headers name no MTP weights)."""
    if job.speculative.method != "mtp" or job.speculative.mtp_head:
        return
    from mtplx.models.mtp import check_native_head

    try:
        check_native_head(resolve_model_dir(job))
    except ValueError as e:
        raise JobError(f"speculative.method: mtp: {e}")
    except OSError:
        return  # unreadable files are reported by the loader


def load_tokenizer(job: JobConfig):
    from mtplx.models.loading import load_tokenizer_only

    check_remote_code(job)
    check_mtp_head(job)
    try:
        return load_tokenizer_only(job.model.path, job.model.gguf_mode)
    except Exception as e:  # missing dir, bad tokenizer files: all mean the job cannot run
        raise JobError(f"model.path: cannot load a tokenizer from {job.model.path!r}: {e}")


def resolve_model_dir(job: JobConfig) -> str:
    from mtplx.models.loading import resolve_model_path

    try:
        return str(resolve_model_path(job.model.path, job.model.gguf_mode))
    except Exception as e:
        raise JobError(f"model.path: {e}")


def model_max_context(job: JobConfig) -> Optional[int]:
    """The context length the engine will use for this model, from its config.json alone (the
    engine's own rule), so prompts can be checked against it before weights load."""
    from mtplx.models.loading import context_length, model_config

    try:
        return context_length(model_config(job.model.path, job.model.gguf_mode))
    except Exception as e:
        raise JobError(f"model.path: cannot read config.json of {job.model.path!r}: {e}")
