"""The job file's schema: each key's check, and one pass that reports every problem at once.

A check takes a raw YAML value and returns the normalized value, or raises `_Bad` with the form
it expected; `check_job_dict` turns those into `section.key: expected ..., got ...` lines.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

from mtplx.config import GGUF_MODES, ORDERS, SPEC_METHODS, VERIFY_MODES

from ..errors import JobError

INPUT_FORMATS = ("parquet", "arrow", "jsonl", "csv", "hf", "openai-batch")


class _Bad(Exception):
    pass


Check = Callable[[Any], Any]


def integer(lo: Optional[int] = None, hi: Optional[int] = None) -> Check:
    form = "an integer" + (f" >= {lo}" if lo is not None and hi is None else "")
    if lo is not None and hi is not None:
        form = f"an integer in {lo}..{hi}"

    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Bad(form)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _Bad(form)
        return v

    return check


def number(lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False) -> Check:
    bounds = []
    if lo is not None:
        bounds.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        bounds.append(f"<= {hi}")
    form = "a number" + (" " + " and ".join(bounds) if bounds else "")

    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise _Bad(form)
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise _Bad(form)
        if hi is not None and v > hi:
            raise _Bad(form)
        return float(v)

    return check


def string(v):
    if not isinstance(v, str) or not v:
        raise _Bad("a non-empty string")
    return v


def boolean(v):
    if not isinstance(v, bool):
        raise _Bad("true or false")
    return v


def optional(check: Check) -> Check:
    def opt(v):
        if v is None:
            return None
        try:
            return check(v)
        except _Bad as e:
            raise _Bad(f"{e} or null")

    return opt


def one_of(*choices: str, aliases: Optional[Dict[Any, str]] = None) -> Check:
    # YAML 1.1 reads bare on/off/yes/no as booleans, so `compiled_verify: on` arrives as True.
    aliases = aliases or {}

    def check(v):
        if isinstance(v, bool) and v in aliases:
            return aliases[v]
        if v not in choices:
            raise _Bad("one of " + " | ".join(choices))
        return v

    return check


def string_list(v):
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _Bad("a list of non-empty strings")
    return list(v)


def auto_or_int(v):
    if v == "auto":
        return v
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return v
    raise _Bad('"auto" or an integer >= 1')


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def auto_or_bytes(v):
    if isinstance(v, str) and v != "auto":
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", v.lower())
        if m:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])
    try:
        return auto_or_int(v)
    except _Bad:
        raise _Bad('"auto", a byte count, or a size such as "24GB"')


BOOL_VERIFY = {True: "on", False: "off"}

SECTIONS: Dict[str, Dict[str, Check]] = {
    "model": {"path": string, "revision": optional(string), "trust_remote_code": boolean,
              "gguf_mode": one_of(*GGUF_MODES)},
    "speculative": {
        "method": one_of(*SPEC_METHODS, aliases={False: "none"}),
        "depth": integer(1, 16),
        "draft_model": optional(string),
        "mtp_head": optional(string),
        "compiled_verify": one_of(*VERIFY_MODES, aliases=BOOL_VERIFY),
        "adaptive_depth": boolean,
        "ngram_size": integer(1),
        "verify_max_len": optional(integer(1)),
    },
    "input": {
        "format": one_of(*INPUT_FORMATS),
        "path": string,
        "split": string,
        "id_column": optional(string),
        "prompt_column": optional(string),
        "messages_column": optional(string),
        "template": optional(string),
        "chat_template": one_of("auto", "on", "off", aliases=BOOL_VERIFY),
        "limit": optional(integer(1)),
    },
    "generation": {
        "max_tokens": integer(1),
        "temperature": number(0.0),
        "top_p": number(0.0, 1.0, lo_open=True),
        "top_k": integer(0),
        "seed": integer(0),
        "stop": string_list,
        "n": integer(1),
    },
    "schedule": {
        "order": one_of(*ORDERS),
        "max_batch": auto_or_int,
        "calibration": optional(string),
        "prefill_chunk": auto_or_int,
        "memory_budget": auto_or_bytes,
        "window_rows": integer(1),
        "min_prefix_tokens": integer(1),
    },
    "output": {"dir": string, "shard_rows": integer(1), "keep_columns": string_list},
    "executor": {
        "type": one_of("local", "ray"),
        "address": optional(string),
        "concurrency": integer(1),
        "num_gpus": number(0.0),
    },
}
SHORTHAND = {"model": "path", "executor": "type", "output": "dir"}  # `model: dir` == `model: {path: dir}`
TOP_LEVEL = ("name",) + tuple(SECTIONS)
REQUIRED = {"model": ("path",), "input": ("path",)}


def _unknown(path: str, key: Any, known: Sequence[str]) -> str:
    hint = difflib.get_close_matches(str(key), known, n=1)
    did = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"{path}{key}: unknown key{did}; known keys: {', '.join(known)}"


def check_job_dict(raw: Any, default_name: str = "job") -> Dict[str, Dict[str, Any]]:
    """Every problem in a raw job mapping at once; returns the checked sections."""
    if not isinstance(raw, dict):
        raise JobError(f"job file: expected a mapping of sections ({', '.join(TOP_LEVEL)}), got {raw!r}")
    problems: List[str] = []
    for key in raw:
        if key not in TOP_LEVEL:
            problems.append(_unknown("", key, TOP_LEVEL))
    name = raw.get("name", default_name)
    if not isinstance(name, str) or not name:
        problems.append(f"name: expected a non-empty string, got {name!r}")
    elif "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        # the default output.dir is runs/NAME: a name must not lead outside it
        problems.append(f"name: expected a plain name without path separators (it names runs/NAME), got {name!r}")
    checked: Dict[str, Dict[str, Any]] = {"name": name}
    for section, checks in SECTIONS.items():
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
            except _Bad as bad:
                problems.append(f"{section}.{key}: expected {bad}, got {v!r}")
        for key in REQUIRED.get(section, ()):
            if key not in value:
                problems.append(f"{section}.{key}: required, missing")
        checked[section] = out
    if problems:
        raise JobError("invalid job:\n  " + "\n  ".join(problems))
    return checked
