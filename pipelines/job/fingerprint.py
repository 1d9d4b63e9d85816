"""The job fingerprint: what must not change between a run and its resume.

It covers everything that decides *which rows exist and what text each one gets*:
- the model: resolved path, a hash of config.json and of the tokenizer files (weights are not
  hashed: too large to read on every start; the path and config pin them well enough);
- generation settings (max_tokens, temperature, top_p, top_k, seed, stop, n);
- prompt rendering (prompt/messages column, template, chat template mode, id column);
- the input: format, path, split, and each file's path, size and content hash; for Hugging Face
  inputs (`input.format: hf`) also the revision `datasets` resolved (`input.revision`: the Hub
  commit, or a saved dataset's own fingerprint), so a dataset that moved is refused by name;
- output.keep_columns (they change the shard schema).
- for sampled jobs only, the speculative settings that decide the text (`SAMPLED_SPECULATIVE`).
Speed-only settings (schedule, shard size, executor; speculative settings of a greedy job) are left
out: greedy output is the same under all of them, so a resume may change them. Sampled output
follows the same distribution under every method, but not the same text: each method and depth
consumes the row's random draws differently, so a resumed sampled job keeps its speculative
settings (or starts over with --restart). Each part is kept by name in the manifest so a
refusal can say what changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from typing import Dict, List, Optional, Sequence

from .config import JobConfig

SCHEMA_VERSION = "1"  # bump when the output columns change
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def sha256_file(path: str) -> str:
    """A file's content hash: the fingerprint pins input and tokenizer files with it, the manifest shards."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_parts(model_dir: str) -> Dict[str, str]:
    parts = {"model.path": os.path.abspath(model_dir)}
    cfg = os.path.join(model_dir, "config.json")
    parts["model.config_sha256"] = sha256_file(cfg) if os.path.exists(cfg) else "missing"
    tok = {name: sha256_file(os.path.join(model_dir, name))
           for name in TOKENIZER_FILES if os.path.exists(os.path.join(model_dir, name))}
    parts["model.tokenizer_sha256"] = _digest(tok)
    return parts


def input_files_digest(files: Sequence[str]) -> str:
    return _digest([(os.path.abspath(f), os.path.getsize(f), sha256_file(f)) for f in files])


def fingerprint_parts(job: JobConfig, model_dir: str, input_files: Sequence[str],
                      input_revision: Optional[str] = None) -> Dict[str, str]:
    """Named parts, each a short string, in a stable order. `input_revision`: the revision the
    input source resolved (Source.revision), pinned when there is one."""
    parts = {"schema_version": SCHEMA_VERSION}
    parts.update(model_parts(model_dir))
    parts["model.revision"] = str(job.model.revision)
    for section in ("generation", "input", "output"):
        cfg = getattr(job, section)
        for f in fields(cfg):
            if f.metadata.get("pinned"):  # marked beside each field in config.py
                parts[f"{section}.{f.name}"] = json.dumps(getattr(cfg, f.name))
    parts["input.files"] = input_files_digest(input_files)
    if input_revision is not None:
        parts["input.revision"] = input_revision
    if sampled(job):
        spec = job.speculative
        keys = ("method",) + SAMPLED_SPECULATIVE[spec.method]
        if spec.method == "mtp" and spec.mtp_lookup:  # the fallback drafts from the context too
            keys += ("mtp_lookup", "ngram_size")
        for key in keys:
            parts[f"speculative.{key}"] = json.dumps(getattr(spec, key))
    return parts


# The speculative keys a sampled row's text depends on, by method (`method` itself always).
SAMPLED_SPECULATIVE = {"none": (), "ngram": ("depth", "ngram_size"), "draft": ("depth", "draft_model"),
                       "mtp": ("depth", "mtp_head")}
SAMPLED_SPECULATIVE_NOTE = (
    "A sampled job's text depends on its speculative settings: the target distribution is the same "
    "under every method and depth, but each consumes the row's random draws differently, so the text "
    "of the remaining rows cannot be made identical to what the run wrote so far"
)


def sampled(job: JobConfig) -> bool:
    """Whether rows may be sampled: temperature > 0, or an OpenAI batch file (rows carry their own)."""
    return job.generation.temperature > 0 or job.input.format == "openai-batch"


def refusal_note(changed: Sequence[str]) -> str:
    """An explanation to add to a refusal, for changes whose reason is not obvious from the key."""
    return f" ({SAMPLED_SPECULATIVE_NOTE})" if any(k.startswith("speculative.") for k in changed) else ""


def fingerprint(parts: Dict[str, str]) -> str:
    return _digest(parts)


def diff_fingerprint_parts(old: Dict[str, str], new: Dict[str, str]) -> List[str]:
    """Names of the parts that differ (added, removed or changed), sorted."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


SHOWN_PARTS = ("input.revision",)  # parts whose values a refusal shows: what moved, from what to what


def describe_changes(old: Dict[str, str], new: Dict[str, str], changed: Sequence[str]) -> str:
    """The changed parts for a refusal, with the old and new values of SHOWN_PARTS."""
    return ", ".join(f"{k} (was {old.get(k, 'not recorded')}, now {new.get(k, 'none')})" if k in SHOWN_PARTS else k
                     for k in changed)
