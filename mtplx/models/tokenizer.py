"""A tokenizer that loads in milliseconds: tokenizer.json through `tokenizers`, the chat template
through jinja2. For a plain tokenizer.json and template it gives mlx-lm's wrapper's ids, text and
prompts without importing transformers (seconds); `load_fast_tokenizer` returns None otherwise."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
NEEDS_WRAPPER = ("thinking", "{% generation", "{%- generation")  # words in a template that need mlx-lm's wrapper
WRAPPER_KEYS = ("chat_template_type", "tool_parser_type", "legacy")  # tokenizer_config.json keys that do
LINE_LOCAL_PRE_TOKENIZERS = ("ByteLevel", "Digits")  # after these a line start always ends a piece
SHARED_PREFIX_MIN_CHARS = 256  # a shorter common prefix is not worth splitting off


def _token_text(value) -> Optional[str]:
    """A special token from tokenizer_config.json: a string, or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _template_env():
    """The sandboxed environment transformers renders chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class FastTokenizer:
    """The part of mlx-lm's TokenizerWrapper the engine and pipelines use."""

    def __init__(self, backend, config: dict, chat_template: Optional[str], eos_token_ids: Iterable[int]):
        self._backend = backend
        self.special_tokens_map = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(n)))}
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids: Set[int] = set(eos_token_ids) | ({self.eos_token_id} - {None})
        self.chat_template = chat_template
        self.has_chat_template = bool(chat_template)
        self._template = None
        self._line_split: Optional[bool] = None

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_many(self, texts: Sequence[str], add_special_tokens: Sequence[bool]) -> List[List[int]]:
        """`encode(text, add)` for each, in parallel; a long shared prefix (a few-shot preamble) is encoded
        once up to its last line start (`_splits_at_lines`), checked against the first text whole."""
        flags = list(add_special_tokens)
        cut = self._shared_cut(texts)
        if cut:
            head = {f: self.encode(texts[0][:cut], add_special_tokens=f) for f in set(flags)}
            tails = self._encode_batch([t[cut:] for t in texts], [False] * len(texts))
            ids = [head[f] + tail for f, tail in zip(flags, tails)]
            if ids[0] == self.encode(texts[0], add_special_tokens=flags[0]):
                return ids
            self._line_split = False
        return self._encode_batch(texts, flags)

    def _encode_batch(self, texts: Sequence[str], flags: Sequence[bool]) -> List[List[int]]:
        out: List[List[int]] = [[] for _ in texts]
        for flag in set(flags):
            at = [i for i, f in enumerate(flags) if f == flag]
            for i, enc in zip(at, self._backend.encode_batch([texts[i] for i in at], add_special_tokens=flag)):
                out[i] = enc.ids
        return out

    def _shared_cut(self, texts: Sequence[str]) -> int:
        """Just after the common prefix's last "\n" before printable ASCII; 0 where none is worth it."""
        if len(texts) < 2 or not self._splits_at_lines():
            return 0
        prefix = os.path.commonprefix(list(texts))
        end = len(prefix) - 1  # the character after the cut must be in the prefix
        while end >= SHARED_PREFIX_MIN_CHARS and (cut := prefix.rfind("\n", 0, end) + 1) >= SHARED_PREFIX_MIN_CHARS:
            if "!" <= prefix[cut] <= "~":
                return cut
            end = cut - 1
        return 0

    def _splits_at_lines(self) -> bool:
        """Whether every piece ends at a line start (BPE, line-local pre-tokenizers, NFC at most)."""
        if self._line_split is None:
            spec = json.loads(self._backend.to_str())
            pre = spec.get("pre_tokenizer") or {}
            steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
            local = all(p.get("type") in LINE_LOCAL_PRE_TOKENIZERS and not p.get("add_prefix_space")
                        and p.get("use_regex", True) for p in steps)
            normalizer = spec.get("normalizer")
            plain = normalizer is None or normalizer.get("type") == "NFC"
            added = any("\n" in t.get("content", "") for t in spec.get("added_tokens", []))
            bare, full = (self.encode("a\nb: 1\n", add_special_tokens=special) for special in (False, True))
            front_only = full[len(full) - len(bare):] == bare
            self._line_split = (local and plain and not added and front_only
                                and (spec.get("model") or {}).get("type") == "BPE")
        return self._line_split

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    def get_vocab(self) -> dict:  # mlx-lm's generate functions need it
        return self._backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _template_env().from_string(self.chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _chat_template(model_path: Path, config: dict):
    """The template, None without one, False for a form left to mlx-lm."""
    jinja_file = model_path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    if (model_path / "chat_template.json").exists():
        return False
    template = config.get("chat_template")
    return template if template is None or isinstance(template, str) else False  # a list: named templates


def _prefix_space_agrees(tok_file: Path, want: bool) -> bool:
    found, nodes = [], [json.loads(tok_file.read_text(encoding="utf-8")).get("pre_tokenizer")]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            if "add_prefix_space" in node:
                found.append(bool(node["add_prefix_space"]))
            if "prepend_scheme" in node:
                found.append(node["prepend_scheme"] != "never")
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
    return bool(found) and all(f == want for f in found)


def load_fast_tokenizer(model_path: Path, eos_token_ids=None) -> Optional[FastTokenizer]:
    model_path = Path(model_path)
    tok_file, cfg_file = model_path / "tokenizer.json", model_path / "tokenizer_config.json"
    if not tok_file.exists():
        return None
    config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.exists() else {}
    if any(config.get(k) for k in WRAPPER_KEYS) or config.get("clean_up_tokenization_spaces"):
        return None
    if "add_prefix_space" in config and not _prefix_space_agrees(tok_file, bool(config["add_prefix_space"])):
        return None
    template = _chat_template(model_path, config)
    if template is False or (template and any(w in template for w in NEEDS_WRAPPER)):
        return None
    from tokenizers import Tokenizer
    backend = Tokenizer.from_file(str(tok_file))
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    tok = FastTokenizer(backend, config, template, eos_token_ids or [])
    for flag, token_id, pos in (("add_bos_token", tok.bos_token_id, 0), ("add_eos_token", tok.eos_token_id, -1)):
        if flag in config and token_id is not None:
            ids = tok.encode("a", add_special_tokens=True)
            if bool(config[flag]) != (bool(ids) and ids[pos] == token_id):
                return None  # transformers would rebuild the post-processor
    return tok
