"""Where mtplx keeps files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and fetched assets live (MTPLX_CACHE overrides)."""
    root = os.environ.get("MTPLX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mtplx"
    )
    return Path(root)
