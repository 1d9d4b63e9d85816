"""The job file's schema: one pass over a raw job mapping that reports every problem at once.

Each key's check is declared beside its field (`setting(check, default)` in mtplx/config.py and
pipelines/job/config.py, whose SECTIONS reads them off); a check returns the normalized value or
raises `Bad` with the form it expected, and `check_job_dict` turns those into
`section.key: expected ..., got ...` lines.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, List, Sequence

from mtplx.checks import Bad, Check

from ..errors import JobError

INPUT_FORMATS = ("parquet", "arrow", "jsonl", "csv", "hf", "openai-batch")


SHORTHAND = {"model": "path", "executor": "type", "output": "dir"}  # `model: dir` == `model: {path: dir}`
REQUIRED = {"model": ("path",), "input": ("path",)}


def _unknown(path: str, key: Any, known: Sequence[str]) -> str:
    hint = difflib.get_close_matches(str(key), known, n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"{path}{key}: unknown key{did}; known keys: {', '.join(known)}"


def check_job_dict(raw: Any, sections: Dict[str, Dict[str, Check]], default_name: str = "job") -> Dict[str, Dict[str, Any]]:
    """Every problem in a raw job mapping at once; returns the checked sections. `sections`:
    {section: {key: check}} (pipelines/job/config.py: SECTIONS)."""
    top_level = ("name",) + tuple(sections)
    if not isinstance(raw, dict):
        raise JobError(f"job file: expected a mapping of sections ({', '.join(top_level)}), got {raw!r}")
    problems: List[str] = []
    for key in raw:
        if key not in top_level:
            problems.append(_unknown("", key, top_level))
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name:
        problems.append(f"name: expected a non-empty string, got {name!r}")
    elif "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        # the default output.dir is runs/NAME: a name must not lead outside it
        problems.append(f"name: expected a plain name without path separators (it names runs/NAME), got {name!r}")
    checked: Dict[str, Dict[str, Any]] = {"name": name}
    for section, checks in sections.items():
        value = raw.get(section)
        if value is None:
            value = {}
        if not isinstance(value, dict) and section in SHORTHAND:
            value = {SHORTHAND[section]: value}
        if not isinstance(value, dict):
            problems.append(f"{section}: expected a mapping with keys {', '.join(checks)}, got {value!r}")
            continue
        out = {}
        for key, v in value.items():
            if key not in checks:
                problems.append(_unknown(f"{section}.", key, list(checks)))
                continue
            try:
                out[key] = checks[key](v)
            except Bad as bad:
                problems.append(f"{section}.{key}: expected {bad}, got {v!r}")
        for key in REQUIRED.get(section, ()):
            if key not in value:
                problems.append(f"{section}.{key}: required, missing")
        checked[section] = out
    if problems:
        raise JobError("invalid job:\n  " + "\n  ".join(problems))
    return checked
