"""Opening a job's model before any weights load: its files, its tokenizer, its context length
(the input opens in pipelines/io/job_input.py). Every problem found here is a JobError (exit 2), so
`run` and `validate` refuse the same jobs with the same messages. `load_engine` is the one place
weights load."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..errors import JobError, RunError
from ..job.config import JobConfig, path_note


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


def _read_config(model_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # a missing or broken config.json is reported by the loader
    return config if isinstance(config, dict) else None


def check_remote_code(key: str, model_dir: str, trust: bool) -> None:
    """Refuse (before anything loads) a model whose config.json names a Python file to run
    (`model_file`, which mlx-lm would import), unless the job sets model.trust_remote_code."""
    config = _read_config(model_dir)
    if trust or config is None or config.get("model_file") is None:
        return
    raise JobError(
        f"{key}: {os.path.join(model_dir, 'config.json')} sets model_file: {config['model_file']!r}, Python code "
        "shipped with the model that would run on load; running it is off by default. If you trust this "
        "model, set model.trust_remote_code: true in the job"
    )


def check_model_type(key: str, model_dir: str) -> None:
    """Refuse a model type mlx-lm has no module for, from config.json alone."""
    from mtplx.models.loading import check_model_type as check

    config = _read_config(model_dir)
    if config is None:
        return
    try:
        check(config)
    except ValueError as e:
        raise JobError(f"{key}: {model_dir}: {e} (docs/models.md lists the architectures that run)")


def check_model(job: JobConfig) -> None:
    """What the model itself must offer, from its files alone: no code to run unless trusted, a
    model type mlx-lm knows, and a calibration profile where the job names one."""
    model_dir = resolve_model_dir(job)
    check_remote_code("model.path", model_dir, job.model.trust_remote_code)
    check_model_type("model.path", model_dir)
    named = job.schedule.calibration
    if named and not os.path.isfile(named):
        raise JobError(f"schedule.calibration: {path_note(named)} does not exist; make one with "
                       f"`mtplx-batch calibrate {job.model.path} --out {named}`, or remove the key")


def check_speculative(job: JobConfig, tokenizer) -> None:
    """What `speculative.method` needs, checked before weights load: mtp, a sidecar head that exists
    and fits this model, or the model's own head; draft, a draft model that exists, runs, and shares
    the model's tokenizer (`tokenizer`)."""
    spec = job.speculative
    if spec.method == "mtp":
        from mtplx.models.mtp import check_native_head, check_sidecar

        if spec.mtp_head and not os.path.isdir(spec.mtp_head):
            raise JobError(f"speculative.mtp_head: {path_note(spec.mtp_head)} does not exist; give the "
                           "directory `mtplx-batch train-head MODEL --out DIR` wrote")
        try:
            if spec.mtp_head:
                check_sidecar(spec.mtp_head, _model_config(job))
            else:
                check_native_head(resolve_model_dir(job))
        except ValueError as e:
            raise JobError(f"speculative.mtp_head: {e}" if spec.mtp_head else f"speculative.method: mtp: {e}")
        except OSError:
            return  # unreadable files are reported by the loader
    elif spec.method == "draft":
        from mtplx.drafting.draft_model import check_draft_vocab
        from mtplx.models.loading import load_tokenizer_only, resolve_model_path

        try:
            draft_dir = str(resolve_model_path(spec.draft_model, job.model.gguf_mode))
        except FileNotFoundError:
            raise JobError(f"speculative.draft_model: {path_note(spec.draft_model)} does not exist; give an "
                           "mlx-lm model directory, a .gguf file, or a known name (`mtplx-batch fetch --list`)")
        except Exception as e:
            raise JobError(f"speculative.draft_model: {e}")
        check_remote_code("speculative.draft_model", draft_dir, trust=False)  # the loader runs no draft code
        check_model_type("speculative.draft_model", draft_dir)
        try:
            draft_tokenizer = load_tokenizer_only(draft_dir)
        except Exception as e:
            raise JobError(f"speculative.draft_model: cannot load a tokenizer from {draft_dir}: {e}")
        try:
            check_draft_vocab(spec.draft_model, draft_tokenizer, tokenizer)
        except ValueError as e:
            raise JobError(f"speculative.draft_model: {e}; use a draft model of the model's family")


def _model_config(job: JobConfig) -> dict:
    from mtplx.models.loading import load_config

    return load_config(Path(resolve_model_dir(job)))


def load_tokenizer(job: JobConfig):
    """The model's tokenizer, once everything the job's model and method need is checked (no weights load)."""
    from mtplx.models.loading import load_tokenizer_only

    check_model(job)
    try:
        tokenizer = load_tokenizer_only(job.model.path, job.model.gguf_mode)
    except Exception as e:  # missing dir, bad tokenizer files: all mean the job cannot run
        raise JobError(f"model.path: cannot load a tokenizer from {job.model.path!r}: {e}")
    check_speculative(job, tokenizer)
    return tokenizer


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
