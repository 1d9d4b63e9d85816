"""The prompt template of `input.template`: literal text with `{name}` fields and `{{` / `}}` escapes.

A tiny parser rather than `str.format`, because `str.format` evaluates attribute and index lookups
(`{x.__class__}`, `{x[0]}`) on user data. Anything but plain fields and escapes is an invalid
job, refused when the job loads (config.py); pipelines/io/prompts.py fills the fields per row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Union


@dataclass(frozen=True)
class Field:
    name: str


# Column names may hold spaces or dashes, but never the characters str.format would interpret.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_ \-]*")


def parse_template(text: str) -> List[Union[str, Field]]:
    """Literal text and `Field`s; raises ValueError naming the offending piece."""
    parts: List[Union[str, Field]] = []
    literal: List[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "{" and text.startswith("{{", i):
            literal.append("{")
            i += 2
        elif ch == "}" and text.startswith("}}", i):
            literal.append("}")
            i += 2
        elif ch == "{":
            end = text.find("}", i)
            if end < 0:
                raise ValueError(f"unclosed '{{' at character {i}; write '{{{{' for a literal brace")
            name = text[i + 1 : end]
            if not _NAME.fullmatch(name) or name.startswith("_") or name != name.strip():
                raise ValueError(
                    f"field {{{name}}} is not allowed: only plain column names such as {{question}} "
                    "(no attributes, indexes, conversions or format specs)"
                )
            if literal:
                parts.append("".join(literal))
                literal = []
            parts.append(Field(name))
            i = end + 1
        elif ch == "}":
            raise ValueError(f"single '}}' at character {i}; write '}}}}' for a literal brace")
        else:
            literal.append(ch)
            i += 1
    if literal:
        parts.append("".join(literal))
    return parts
