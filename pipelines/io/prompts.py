"""Turning an input row into prompt tokens: a column, a safe template (pipelines/job/template.py),
or chat messages.

Anything wrong with one row raises `RowError`; the runner turns it into an error row.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Union

from ..errors import JobError
from ..job.config import InputConfig
from ..job.template import Field, parse_template


class RowError(Exception):
    """A problem with one input row; `reason` goes into that row's `error` column."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def a_type(value: Any) -> str:
    """`value`'s type name with its article, for messages: "an int", "a list"."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def check_text(value: Any, what: str) -> str:
    """A usable piece of prompt text from a cell, or RowError."""
    if value is None:
        raise RowError(f"{what} is null")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError(f"{what} holds bytes that are not UTF-8 (at byte {e.start}); re-encode the input as UTF-8")
    if not isinstance(value, str):
        raise RowError(f"{what} is {a_type(value)}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RowError(f"{what} holds undecodable bytes or lone surrogates; re-encode the input as UTF-8")
    return value


def _template_value(row: Dict[str, Any], name: str) -> str:
    if name not in row:
        raise RowError(f"template field {{{name}}}: this row has no column {name!r}")
    v = row[name]
    what = f"template field {{{name}}}"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise RowError(f"{what} is {v}; fill or drop non-finite values in the input")
        return repr(v)
    if isinstance(v, (list, dict, tuple)):
        raise RowError(f"{what} is {a_type(v)}; templates take scalar columns only")
    return check_text(v, what)


class PromptRenderer:
    """Renders rows to token lists the way mlx-lm would for the same text."""

    def __init__(self, inp: InputConfig, tokenizer):
        self.inp = inp
        self.tokenizer = tokenizer
        self.template = parse_template(inp.template) if inp.template is not None else None
        has_template = bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))
        if inp.chat_template == "on" and not has_template:
            raise JobError("input.chat_template: on, but the model's tokenizer has no chat template; "
                           "set chat_template: off or auto")
        if inp.prompt_mode == "messages" and (inp.chat_template == "off" or not has_template):
            raise JobError(
                f"input.messages_column: {inp.messages_column!r} needs a chat template, but "
                + ("chat_template is off" if has_template else "the model's tokenizer has none")
                + "; use prompt_column or template instead"
            )
        self.use_chat = has_template and inp.chat_template != "off"
        if self.use_chat:
            self._check_chat_template_sandbox()
        bos = getattr(tokenizer, "bos_token", None)
        self._bos = bos if isinstance(bos, str) and bos else None

    def _check_chat_template_sandbox(self) -> None:
        """Chat templates come with the model and render in transformers' jinja2
        ImmutableSandboxedEnvironment; one that reaches for Python internals refuses the job."""
        try:
            from jinja2.exceptions import SecurityError
        except ImportError:  # pragma: no cover - jinja2 is a dependency
            return
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                               add_generation_prompt=True, tokenize=False)
        except SecurityError as e:
            raise JobError(f"model.path: the model's chat template does something the template sandbox "
                           f"forbids ({e}); fix the template, or set input.chat_template: off")
        except Exception:  # a template refusing this probe message is judged per row instead
            pass

    @property
    def columns(self) -> List[str]:
        """Input columns a prompt reads (checked against the input schema up front)."""
        if self.inp.prompt_mode == "messages":
            return [self.inp.messages_column]
        if self.template is not None:
            return list(dict.fromkeys(p.name for p in self.template if isinstance(p, Field)))
        return [self.inp.prompt_field]

    def text(self, row: Dict[str, Any]) -> Union[str, List[Dict[str, str]]]:
        """The prompt string, or the chat turns when the chat template will apply."""
        mode = self.inp.prompt_mode
        if mode == "messages":
            return self._messages(row)
        if mode == "template":
            text = "".join(p if isinstance(p, str) else _template_value(row, p.name) for p in self.template)
        else:
            col = self.inp.prompt_field
            if col not in row:
                raise RowError(f"this row has no column {col!r} (input.prompt_column)")
            text = check_text(row[col], f"prompt column {col!r}")
        if not text.strip():
            raise RowError("the prompt is empty; drop the row or fill the prompt column")
        return [{"role": "user", "content": text}] if self.use_chat else text

    def tokens(self, row: Dict[str, Any]) -> List[int]:
        out = PromptRenderer.tokens_many(self, [row])[0]  # this class's own, under any subclass
        if isinstance(out, RowError):
            raise out
        return out

    def tokens_many(self, rows: Sequence[Dict[str, Any]]) -> List[Union[List[int], RowError]]:
        """Each row's prompt tokens, or its RowError: rendered row by row, tokenized together
        (`encode_many` where the tokenizer has it: in parallel, a shared prefix once)."""
        out: List[Union[List[int], RowError]] = []
        texts, at = [], []
        for row in rows:
            try:
                out.append(self._prompt(row))
                texts.append(out[-1])
                at.append(len(out) - 1)
            except RowError as e:
                out.append(e)
        # Same rule as mlx_lm.generate: no second BOS when the text already starts with one.
        flags = [self._bos is None or not t.startswith(self._bos) for t in texts]
        tok = self.tokenizer
        if hasattr(tok, "encode_many"):
            encoded = tok.encode_many(texts, flags)
        else:
            encoded = [tok.encode(t, add_special_tokens=f) for t, f in zip(texts, flags)]
        for i, ids in zip(at, encoded):
            out[i] = list(ids) if len(ids) else RowError("the prompt tokenizes to nothing")
        return out

    def _prompt(self, row: Dict[str, Any]) -> str:
        """The text the tokenizer sees: the prompt, or the chat turns through the chat template."""
        prompt = self.text(row)
        if isinstance(prompt, list):
            try:
                prompt = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # jinja's raise_exception and friends: the row's fault
                raise RowError(f"chat template refused the messages: {e}")
        return prompt

    def _messages(self, row: Dict[str, Any]) -> List[Dict[str, str]]:
        col = self.inp.messages_column
        if col not in row:
            raise RowError(f"this row has no column {col!r} (input.messages_column)")
        msgs = row[col]
        if msgs is None:
            raise RowError(f"messages column {col!r} is null")
        if isinstance(msgs, str):
            raise RowError(f"messages column {col!r} is a string; it must be a list of {{role, content}} turns")
        if not isinstance(msgs, (list, tuple)) or not msgs:
            raise RowError(f"messages column {col!r} must be a non-empty list of {{role, content}} turns")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m.get("role"):
                raise RowError(f"messages[{i}] is not a {{role, content}} mapping with a string role")
            out.append({"role": m["role"], "content": check_text(m.get("content"), f"messages[{i}].content")})
        if not any(m["content"].strip() for m in out):
            raise RowError("all messages are empty")
        return out


def row_text_columns(renderer: PromptRenderer, id_column: Optional[str], keep: Sequence[str]) -> List[str]:
    """Every column a job reads from the input, in a stable order."""
    cols = list(renderer.columns) + ([id_column] if id_column else []) + list(keep)
    return list(dict.fromkeys(cols))
