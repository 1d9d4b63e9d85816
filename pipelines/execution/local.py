"""`executor: local`: one engine in this process generates the job's rows."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

from . import opening
from .work import engine_rows, plan


def local_rows(session, engine=None) -> Iterator[Tuple[Dict[str, Any], bool]]:
    """The session's output rows from `engine` (loaded here, after the run directory opened,
    when none is given), each with whether it reached the engine."""
    job = session.job
    if engine is None:
        session.log(f"loading {job.model.path}")
        engine = opening.load_engine(job, session.prep.tokenizer)  # the tokenizer the rows were rendered with
        session.startup.engine_loaded(engine)
    else:
        session.startup.engine = engine
    if hasattr(engine, "profile_file"):  # which calibration this run used, in the manifest
        session.run.update(calibration=engine.profile_file, max_batch=engine.max_batch)
        if engine.profile_file or str(job.schedule.max_batch) == "auto":
            session.log(f"calibration: {engine.profile_file or 'none (mtplx-batch calibrate MODEL makes one)'}; "
                        f"max_batch {engine.max_batch}")
    session.begin()
    work = plan(job, session.prep, session.committed, session.limit, engine.max_context)
    hook = hasattr(engine, "on_progress")  # the mtplx Engine: live tokens from every round
    if hook:
        engine.on_progress = session.progress.engine_event
        total = session.progress.total  # the rows left: what its adaptive depth prices a program's build against
        engine.expected_requests = None if total is None else total - session.progress.initial
    try:
        yield from engine_rows(engine, work, job.generation.sampling_params(), job.generation.seed,
                               on_submit=session.progress.submitted)
        bank = getattr(engine, "bank", None)
        if bank is not None:  # this session's compiled-verify figures (capture backend, budget, restored tokens)
            session.run.update(compiled_verify={k: v for k, v in bank.stats.items() if k != "fallback_reasons"})
        drafts = getattr(getattr(engine, "drafter", None), "bank", None)
        if drafts is not None:  # the drafter's compiled programs (an MTP head's, a draft model's)
            session.run.update(compiled_drafts={k: v for k, v in drafts.stats.items()
                                                if isinstance(v, (int, float))})
    finally:
        if hook:
            engine.on_progress = None
