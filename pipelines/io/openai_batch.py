"""OpenAI Batch API files: `input.format: openai-batch` in, `export --format openai-batch` out.

Input: JSONL, one request per line, as uploaded to the OpenAI Batch API (sources.py: OpenAIBatchSource):

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stop": ["\\n\\n"], "seed": 1}}

- `custom_id` becomes the row id (`input.id_column` is `custom_id`); ids must be unique.
- `body.messages` are rendered with the model's chat template (`input.messages_column` is
  `messages`). Text content parts (`[{"type": "text", "text": ...}]`) are joined with newlines;
  the `developer` role is passed to the template as `system`.
- Per-row settings: `max_completion_tokens` (or the older `max_tokens`), `temperature`, `top_p`,
  `stop` and `seed` override the job's `generation:` values for that row; a field left out takes
  the job's value (so `generation:` holds the defaults, not OpenAI's). `n` must equal the job's
  `generation.n` (the number of samples is fixed per job): set `generation.n` to match.
- Ignored, with one warning per field name in the run log: `model` (the job's model generates
  every row), and fields that do not change the text: user, metadata, store, service_tier,
  stream_options, parallel_tool_calls, prompt_cache_key, safety_identifier, reasoning_effort,
  and `logprobs: false`, `stream: false`, zero penalties, an empty `logit_bias`,
  `response_format: {"type": "text"}`.
- Everything else that would change the output (tools, function calling, JSON mode/schema,
  logprobs, penalties, logit_bias, audio/image input, streaming, other URLs than
  /v1/chat/completions, a method other than POST, out-of-range values) makes that row an error
  row whose `error` starts with `openai-batch:` and names the field. The row keeps its
  custom_id, so it lands in the error file of `export --format openai-batch`. `validate` lists
  these rows before anything runs.

Output (`export --format openai-batch`): one line per input row, in input order:

    {"id": "batch_req_...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "req_...",
                  "body": {"id": "chatcmpl-...", "object": "chat.completion", "created": ...,
                           "model": "<job model>", "choices": [{"index": 0,
                           "message": {"role": "assistant", "content": "..."},
                           "finish_reason": "stop", "logprobs": null}],
                           "usage": {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...}}},
     "error": null}

A row with n samples has n choices (index = sample). Failed rows go to a separate error file:
rows that could not be read at all (no custom_id) as `{"response": null, "error": {"code",
"message"}}`, other failures as an HTTP-style response, `status_code` 400 for problems with the
request (bad prompt, too long, unsupported field) and 500 for engine failures, with
`body.error = {message, type, param, code}` (code = the error kind of `mtplx-batch report`).
A row counts as failed if any of its samples failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, TextIO, Tuple

from mtplx.request import SamplingParams

from .prompts import PromptRenderer, RowError

ID_COLUMN = "custom_id"
MESSAGES_COLUMN = "messages"
CHAT_URLS = ("/v1/chat/completions", "/chat/completions", "v1/chat/completions")

# Ignored: they do not change the generated text. `model` gets its own warning.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls",
                  "prompt_cache_key", "safety_identifier", "reasoning_effort")
# Accepted only at their neutral value; anything else needs a feature this engine does not have.
NEUTRAL_VALUES: Dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "stream": lambda v: v is None or v is False,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "logit_bias": lambda v: v is None or v == {},
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "modalities": lambda v: v is None or v == ["text"],
    "tool_choice": lambda v: v is None or v == "none",
    "tools": lambda v: v is None or v == [],
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
}
PARAM_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "n", "seed",
                "model")


@dataclass(frozen=True)
class RowParams:
    """One request's own generation settings; None fields keep the job's value."""

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Tuple[str, ...]] = None
    seed: Optional[int] = None

    def apply(self, base: SamplingParams) -> SamplingParams:
        changes = {k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p", "stop")
                   if getattr(self, k) is not None}
        return dataclasses.replace(base, **changes) if changes else base


def _int(body: Dict[str, Any], key: str, lo: int) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise RowError(f"openai-batch: body.{key} must be an integer >= {lo}, got {v!r}")
    return v


def _num(body: Dict[str, Any], key: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
    if bad or v > hi or (v <= lo if lo_open else v < lo):
        rng = f"{'>' if lo_open else '>='} {lo} and <= {hi}"
        hint = " (use temperature: 0 for greedy decoding)" if key == "top_p" and v == 0 else ""
        raise RowError(f"openai-batch: body.{key} must be a number {rng}, got {v!r}{hint}")
    return float(v)


def parse_request(row: Dict[str, Any], samples: int = 1) -> Tuple[RowParams, List[str]]:
    """The request's own settings, and the names of ignored fields; RowError when the request
    asks for something this engine cannot do (the message names the field and the fix)."""
    method = row.get("method")
    if method is not None and (not isinstance(method, str) or method.upper() != "POST"):
        raise RowError(f"openai-batch: method must be POST, got {method!r}")
    url = row.get("url")
    if url is not None and url not in CHAT_URLS:
        raise RowError(f"openai-batch: url {url!r} is not supported; only /v1/chat/completions requests "
                       "can run here (embeddings, completions and responses requests cannot)")
    body = row.get("body")
    if not isinstance(body, dict):
        raise RowError(f"openai-batch: body must be a JSON object with messages, got {type(body).__name__}")
    ignored = [k for k in body if k in IGNORED_FIELDS]
    for key, ok in NEUTRAL_VALUES.items():
        if key in body and not ok(body[key]):
            raise RowError(f"openai-batch: body.{key}={json.dumps(body[key])[:80]} is not supported by this "
                           "engine (plain text generation only); drop the field or remove the row")
        if key in body:
            ignored.append(key)
    unknown = sorted(k for k in body if k not in PARAM_FIELDS and k not in IGNORED_FIELDS and k not in NEUTRAL_VALUES)
    if unknown:
        raise RowError(f"openai-batch: body.{unknown[0]} is not supported; supported fields: "
                       f"{', '.join(PARAM_FIELDS)} (and ignored: {', '.join(IGNORED_FIELDS)})")
    n = _int(body, "n", 1)
    if n is not None and n != samples:
        raise RowError(f"openai-batch: body.n={n} but the job makes {samples} sample(s) per row; the number "
                       f"of samples is per job: set generation.n: {n} (all rows) or drop body.n")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RowError(f"openai-batch: body.stop must be a non-empty string or a list of them, got {stop!r}")
        stop = tuple(stops)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RowError(f"openai-batch: body.seed must be an integer, got {seed!r}")
    params = RowParams(max_tokens=max_tokens, temperature=_num(body, "temperature", 0.0, 2.0),
                       top_p=_num(body, "top_p", 0.0, 1.0, lo_open=True), stop=stop, seed=seed)
    return params, ignored


def _content(value: Any, i: int) -> Any:
    """Text content parts joined; anything but text is refused."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RowError(f"openai-batch: messages[{i}].content has a part of type {kind!r}; only text parts are "
                           "supported")
    return "\n".join(texts)


class OpenAIBatchRenderer(PromptRenderer):
    """Checks each request, renders its messages with the chat template, and keeps the request's
    own settings for the runner (`row_params(id)`, taken once)."""

    def __init__(self, inp, tokenizer, samples: int = 1):
        super().__init__(inp, tokenizer)
        self.samples = samples
        self._params: Dict[str, RowParams] = {}
        self.warn: Optional[Callable[[str], None]] = None  # set by the runner to its log
        self._warned: set = set()

    @property
    def columns(self) -> List[str]:
        return [MESSAGES_COLUMN, "body", "method", "url"]

    def tokens(self, row: Dict[str, Any]) -> List[int]:
        params, ignored = parse_request(row, self.samples)
        msgs = row.get(MESSAGES_COLUMN)
        if isinstance(msgs, list):
            fixed = []
            for i, m in enumerate(msgs):
                if isinstance(m, dict):
                    m = dict(m, content=_content(m.get("content"), i))
                    if m.get("role") == "developer":
                        m["role"] = "system"
                fixed.append(m)
            row = dict(row, **{MESSAGES_COLUMN: fixed})
        toks = super().tokens(row)
        rid = row.get(ID_COLUMN)
        if rid is not None and params != RowParams():
            self._params[str(rid)] = params
        self._note_ignored(row, ignored)
        return toks

    def tokens_many(self, rows) -> list:
        """Row by row: each request's own settings are parsed with it."""
        out = []
        for row in rows:
            try:
                out.append(self.tokens(row))
            except RowError as e:
                out.append(e)
        return out

    def row_params(self, row_id: Optional[str]) -> Optional[RowParams]:
        return self._params.pop(row_id, None) if row_id is not None else None

    def _note_ignored(self, row: Dict[str, Any], ignored: Iterable[str]) -> None:
        if self.warn is None:
            return
        body = row.get("body") if isinstance(row.get("body"), dict) else {}
        model = body.get("model")
        if model is not None and "model" not in self._warned:
            self._warned.add("model")
            self.warn(f"openai-batch: body.model ({model!r}) is ignored: the job's model generates every row")
        for key in ignored:
            if key not in self._warned:
                self._warned.add(key)
                self.warn(f"openai-batch: body.{key} is ignored (it does not change the generated text); "
                          f"first seen in custom_id {row.get(ID_COLUMN)!r}")


# --------------------------------------------------------------------------------------- writing
SERVER_ERROR_KINDS = ("engine", "memory budget")


def _hid(*parts: Any) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()[:24]


def success_line(fp: str, custom_id: str, samples: List[Dict[str, Any]], model: str, created: int) -> Dict[str, Any]:
    """The output line for one input row whose samples all succeeded (sorted by sample)."""
    prompt = samples[0]["prompt_tokens"] or 0
    completion = sum(s["completion_tokens"] or 0 for s in samples)
    cached = samples[0].get("cached_prompt_tokens") or 0
    return {
        "id": "batch_req_" + _hid(fp, custom_id),
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": "req_" + _hid(fp, custom_id, "request"),
            "body": {
                "id": "chatcmpl-" + _hid(fp, custom_id, "completion"),
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": s["sample"], "message": {"role": "assistant", "content": s["completion"], "refusal": None},
                     "logprobs": None, "finish_reason": s["finish_reason"]}
                    for s in samples
                ],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion,
                          "prompt_tokens_details": {"cached_tokens": cached}},
                "system_fingerprint": "mtplx_" + fp[:12],
            },
        },
        "error": None,
    }


def error_line(fp: str, custom_id: Optional[str], row: int, failed: Dict[str, Any], kind: str) -> Dict[str, Any]:
    message = failed.get("error") or "generation failed"
    if custom_id is None:  # the line itself was unreadable: no request to answer
        return {"id": "batch_req_" + _hid(fp, "row", row), "custom_id": None, "response": None,
                "error": {"code": kind.replace(" ", "_"), "message": message}}
    server = kind in SERVER_ERROR_KINDS
    return {
        "id": "batch_req_" + _hid(fp, custom_id),
        "custom_id": custom_id,
        "response": {
            "status_code": 500 if server else 400,
            "request_id": "req_" + _hid(fp, custom_id, "request"),
            "body": {"error": {"message": message, "type": "server_error" if server else "invalid_request_error",
                               "param": None, "code": kind.replace(" ", "_")}},
        },
        "error": None,
    }


def write_lines(rows_by_input: Iterable[List[Dict[str, Any]]], out: TextIO, errors: TextIO, fp: str, model: str,
                created: int, kind_of: Callable[[Optional[str]], str]) -> Tuple[int, int]:
    """Writes one line per input row to `out` or `errors`; returns (ok, failed) counts."""
    ok = failed = 0
    for samples in rows_by_input:
        first = samples[0]
        bad = next((s for s in samples if s["finish_reason"] == "error"), None)
        if bad is None:
            line = success_line(fp, first["id"], samples, model, created)
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            ok += 1
        else:
            line = error_line(fp, first["id"], first["row"], bad, kind_of(bad.get("error")))
            errors.write(json.dumps(line, ensure_ascii=False) + "\n")
            failed += 1
    return ok, failed


def model_name(job: Dict[str, Any]) -> str:
    path = str((job.get("model") or {}).get("path") or "unknown")
    return os.path.basename(path.rstrip("/")) or path
