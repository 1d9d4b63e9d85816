"""Shared pytest fixtures: tiny local models (see tests/tiny_models.py) and an isolated cache."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
# `import tiny_models` works whatever pytest's import mode, and `import mtplx` works from a checkout
# that is not pip-installed.
for _p in (str(_TESTS), str(_TESTS.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from mtplx.process import prepare_process  # noqa: E402

prepare_process()  # before mlx.core: the tests run on OpenBLAS too (mtplx/process.py)

from tiny_models import make_small_vocab_model, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _isolated_mtplx_cache(tmp_path_factory):
    """MTPLX_CACHE points at a session tmp dir, so no test writes into the user's cache."""
    cache = tmp_path_factory.mktemp("mtplx_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("MTPLX_CACHE", str(cache))
    yield cache
    mp.undo()


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    """One directory per session holding every tiny model built by `tiny_model`."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_model(tiny_models_dir):
    """Factory: ``tiny_model(family, **kwargs) -> Path``, built once per session per arguments.

    ``family`` is one of llama, qwen3, qwen3_next, deepseek_v3 (kwargs go to
    ``tiny_models.make_tiny_model``), or ``"small_vocab"`` (kwargs go to
    ``tiny_models.make_small_vocab_model``). Treat the directory as read-only: it is shared.
    """
    built = {}

    def factory(family: str, **kwargs) -> Path:
        key = json.dumps([family, kwargs], sort_keys=True, default=repr)
        if key not in built:
            tag = hashlib.sha256(key.encode()).hexdigest()[:10]
            out = tiny_models_dir / f"{family}-{tag}"
            if family == "small_vocab":
                built[key] = make_small_vocab_model(out, **kwargs)
            else:
                built[key] = make_tiny_model(out, family, **kwargs)
        return built[key]

    return factory


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if anything loads model weights."""
    import mtplx.models.loading
    import pipelines.execution.opening

    def boom(*a, **k):
        raise AssertionError("model weights were loaded")

    monkeypatch.setattr(mtplx.models.loading, "load", boom)
    monkeypatch.setattr(pipelines.execution.opening, "load_engine", boom)
