"""Tokenizing many prompts at once (`FastTokenizer.encode_many`): a shared few-shot prefix is
encoded once and only each prompt's rest per prompt, and the ids are exactly those of encoding
every prompt whole."""

import json
import random

import pytest

from mtplx.models.tokenizer import load_fast_tokenizer
from tiny_models import build_tokenizer

PREFIX = ("The following are multiple choice questions (with answers).\n\n"
          "Which of 12345 is  prime?\nA. 2\nB. 4 \nC.  6\n\tD. 8\nAnswer: A\n\n"
          "<|im_start|>user\nWhat is héllo wörld ✓ in 1,000 words?\n<|im_end|>\n"
          "def f(x):\n    return x  # spaces   \n\n\n   \n"
          + "Some more worked text, line by line.\n" * 12)
PIECES = [" ", "  ", "\n", "\n\n", " \n", "\t", "a", "B", "cat", " dog", "7", "42", "1000", ".", "?", "é", "✓",
          "<|im_end|>", "<|im_start|>", "Answer:", "  x", "'s", "—"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_fast_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def _texts(n, seed=0, prefix=PREFIX):
    rng = random.Random(seed)
    return [prefix + "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_shared_prefix_encoded_once_gives_the_ids_of_whole_prompts(tok, seed):
    texts = _texts(64, seed)
    flags = [bool(i % 3) for i in range(len(texts))]
    assert tok._shared_cut(texts) > 256  # the split is taken: a line start inside the shared prefix
    assert tok.encode_many(texts, flags) == [tok.encode(t, add_special_tokens=f) for t, f in zip(texts, flags)]
    assert tok._line_split  # and it was not turned off by the whole-text check


class Spy:
    """The tokenizers backend, recording the length of every text given to encode_batch."""

    def __init__(self, backend):
        self.backend, self.lengths = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def encode_batch(self, texts, add_special_tokens):
        self.lengths += [len(t) for t in texts]
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)


def test_only_the_rest_is_encoded_per_prompt(tok, monkeypatch):
    texts = _texts(16, 7)
    whole = [tok.encode(t) for t in texts]
    spy = Spy(tok._backend)
    monkeypatch.setattr(tok, "_backend", spy)
    assert tok.encode_many(texts, [True] * len(texts)) == whole
    assert len(spy.lengths) == len(texts) and max(spy.lengths) < len(PREFIX) // 2  # not the preamble


@pytest.mark.parametrize("prefix", ["", "short shared\n", "no line start anywhere " * 40])
def test_without_a_usable_prefix_every_prompt_is_encoded_whole(tok, prefix):
    texts = _texts(20, 3, prefix)
    assert tok._shared_cut(texts) == 0 or prefix == ""
    assert tok.encode_many(texts, [True] * len(texts)) == [tok.encode(t) for t in texts]


def test_a_tokenizer_whose_pieces_may_cross_lines_is_never_split(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()  # "▁" is prepended at the start of what it sees
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator([PREFIX * 3] + _texts(50, 1), trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    tok = load_fast_tokenizer(tmp_path)
    texts = _texts(20, 2)
    assert tok.encode_many(texts, [False] * len(texts)) == [tok.encode(t, add_special_tokens=False) for t in texts]
    assert tok._line_split is False


def test_a_wrong_split_is_caught_and_turned_off(tok, monkeypatch):
    texts = _texts(8, 5)
    real = tok.encode
    calls = {"n": 0}

    def encode(text, add_special_tokens=True):  # a tokenizer that would disagree on the whole text
        calls["n"] += 1
        ids = real(text, add_special_tokens=add_special_tokens)
        return ids + [0] if text == texts[0] else ids

    monkeypatch.setattr(tok, "encode", encode)
    monkeypatch.setattr(tok, "_line_split", True)
    out = tok.encode_many(texts, [True] * len(texts))
    assert tok._line_split is False
    assert out == [real(t) for t in texts]  # the whole texts, encoded in one batch
