"""Each setting's check beside its field (`setting(check, default)`), so a key, its default and its
check are written once. A check returns the normalized value or raises `Bad` with the form it wanted."""

from __future__ import annotations

import numbers
import re
from dataclasses import MISSING, field, fields
from typing import Any, Callable, Dict, Optional


class Bad(Exception):
    pass


Check = Callable[[Any], Any]


def setting(check: Check, default: Any = MISSING, *, default_factory: Any = MISSING, **metadata):
    return field(default=default, default_factory=default_factory, metadata={"check": check, **metadata})


def check_fields(obj, section: str) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        try:
            setattr(obj, f.name, f.metadata["check"](value))
        except Bad as bad:
            raise ValueError(f"{section}.{f.name}: expected {bad}, got {value!r}") from None


def checks_of(cls) -> Dict[str, Check]:
    return {f.name: f.metadata["check"] for f in fields(cls)}


def integer(lo: int, hi: Optional[int] = None) -> Check:
    form = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"

    def check(v):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo or (hi is not None and v > hi):
            raise Bad(form)
        return int(v)

    return check


def number(lo: float, hi: Optional[float] = None, lo_open: bool = False) -> Check:
    form = f"a number {'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")

    def check(v):
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v
                or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi)):
            raise Bad(form)
        return float(v)

    return check


def string(v):
    if not isinstance(v, str) or not v:
        raise Bad("a non-empty string")
    return v


def boolean(v):
    if not isinstance(v, bool):
        raise Bad("true or false")
    return v


def optional(check: Check) -> Check:
    def opt(v):
        if v is None:
            return None
        try:
            return check(v)
        except Bad as e:
            raise Bad(f"{e} or null")

    return opt


BOOL_VERIFY = {True: "on", False: "off"}


def one_of(*choices: str, aliases: Optional[Dict[Any, str]] = None) -> Check:
    # YAML 1.1 reads bare on/off/yes/no as booleans, so `compiled_verify: on` arrives as True.
    aliases = aliases or {}

    def check(v):
        if isinstance(v, bool) and v in aliases:
            return aliases[v]
        if v not in choices:
            raise Bad("one of " + " | ".join(choices))
        return v

    return check


def string_list(v):
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise Bad("a list of non-empty strings")
    return list(v)


def auto_or_int(v):
    if v == "auto":
        return v
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1:
        return int(v)
    raise Bad('"auto" or an integer >= 1')


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def auto_or_bytes(v):
    if isinstance(v, str) and (m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", v.lower())):
        return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])
    try:
        return auto_or_int(v)
    except Bad:
        raise Bad('"auto", a byte count, or a size such as "24GB"')
