"""Bad input: every kind becomes an error row (the job goes on), a refused job (exit 2 naming the
file or key, before any weights load), or is read correctly; never a crash, never a lost row.

One table, one test: each case writes its input, runs `mtplx-batch run` and `validate` in-process
(one engine shared by all cases), and checks the outcome. For row outcomes the output holds
exactly one row per input row (indices 0..N-1, each once), the bad rows are error rows whose
`error` names the problem, and every other row generated normally.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipelines.execution.opening
from jobkit import job_dict, read_output, write_job
from pipelines.cli.commands import main

GOOD_A = {"id": "a", "prompt": "What is the capital of France?", "q": "two plus two", "price": 3.5, "n": 1,
          "messages": [{"role": "user", "content": "Hello"}]}
GOOD_B = {"id": "b", "prompt": "Name a prime number.", "q": "a prime", "price": 2, "n": 2,
          "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
TEMPLATE = {"template": "Q: {q} (costs {price})", "prompt_column": None}
MESSAGES = {"messages_column": "messages", "prompt_column": None}


def row(**changes) -> Dict[str, Any]:
    out = {**GOOD_A, "id": "x", **changes}
    return {k: v for k, v in out.items() if v is not DROP}


DROP = object()


def jsonl(*items) -> bytes:
    """Lines from dicts (JSON-encoded) or raw bytes (written as they are)."""
    return b"".join((it if isinstance(it, bytes) else json.dumps(it).encode()) + b"\n" for it in items)


def parquet(rows: List[Dict[str, Any]], schema: Optional[pa.Schema] = None) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink)
    return sink.getvalue().to_pybytes()


@dataclass
class Case:
    kind: str
    files: Dict[str, bytes]  # name -> content; the input path is the file, or the dir for several
    expect: str  # "row": error rows at `bad`; "refused": exit 2; "ok": all rows generated; "failed": all errors, exit 1
    message: str = ""  # in each bad row's error, or in the refusal
    bad: Sequence[int] = (1,)
    rows: Optional[int] = None  # input rows (default: lines/records in the files)
    input: Dict[str, Any] = field(default_factory=dict)
    output: Dict[str, Any] = field(default_factory=dict)
    fmt: str = "jsonl"


HUGE = "word " * 90_000  # ~450 KB: far over the tiny model's 4096-token context

CASES = [
    # ---- prompts
    Case("null prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt=None), GOOD_B)}, "row", "prompt column 'prompt' is null"),
    Case("empty prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt=""), GOOD_B)}, "row", "the prompt is empty"),
    Case("whitespace-only prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt=" \n\t "), GOOD_B)}, "row",
         "the prompt is empty"),
    Case("integer prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt=42), GOOD_B)}, "row", "is an int, not a string"),
    Case("boolean prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt=True), GOOD_B)}, "row", "is a bool, not a string"),
    Case("list prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt=["a", "b"]), GOOD_B)}, "row", "is a list, not a string"),
    Case("object prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt={"text": "hi"}), GOOD_B)}, "row",
         "is a dict, not a string"),
    Case("prompt column missing in a row", {"in.jsonl": jsonl(GOOD_A, row(prompt=DROP), GOOD_B)}, "row",
         "this row has no column 'prompt'"),
    Case("lone surrogate in prompt", {"in.jsonl": jsonl(GOOD_A, b'{"id": "x", "prompt": "bad \\udcff"}', GOOD_B)},
         "row", "lone surrogates"),
    Case("over-context prompt", {"in.jsonl": jsonl(GOOD_A, row(prompt="Why? " * 4000), GOOD_B)}, "row",
         "the model's context holds 4096"),
    Case("huge row (450 KB prompt)", {"in.jsonl": jsonl(GOOD_A, row(prompt=HUGE), GOOD_B)}, "row",
         "the model's context holds 4096"),
    Case("binary prompt, not UTF-8 (parquet)",
         {"in.parquet": parquet([{"id": "a", "prompt": b"hello"}, {"id": "x", "prompt": b"caf\xe9 \xff"},
                                 {"id": "b", "prompt": b"world"}])}, "row", "holds bytes that are not UTF-8",
         fmt="parquet"),
    Case("NUL and control characters (fine)", {"in.jsonl": jsonl(GOOD_A, row(prompt="a\x00b\x07c\x1b[31m"), GOOD_B)},
         "ok"),
    # ---- ids
    Case("duplicate id", {"in.jsonl": jsonl(GOOD_A, GOOD_B, {**GOOD_A, "prompt": "again"})}, "row",
         "duplicate id 'a'", bad=(2,)),
    Case("null id", {"in.jsonl": jsonl(GOOD_A, row(id=None), GOOD_B)}, "row", "id column 'id' is null"),
    Case("empty id", {"in.jsonl": jsonl(GOOD_A, row(id=""), GOOD_B)}, "row", "id column 'id' is empty"),
    Case("missing id", {"in.jsonl": jsonl(GOOD_A, row(id=DROP), GOOD_B)}, "row", "has no id column 'id'"),
    Case("float id", {"in.jsonl": jsonl(GOOD_A, row(id=1.5), GOOD_B)}, "row", "ids must be strings or integers"),
    Case("null id (parquet)", {"in.parquet": parquet([GOOD_A, row(id=None), GOOD_B])}, "row",
         "id column 'id' is null", fmt="parquet"),
    # ---- the file itself
    Case("invalid UTF-8 line", {"in.jsonl": jsonl(GOOD_A, b'{"id": "x", "prompt": "caf\xe9"}', GOOD_B)}, "row",
         "in.jsonl line 2 is not UTF-8"),
    Case("invalid JSON line", {"in.jsonl": jsonl(GOOD_A, b'{"id": "x", "prompt": "unclosed', GOOD_B)}, "row",
         "in.jsonl line 2 is not valid JSON"),
    Case("JSON line that is not an object", {"in.jsonl": jsonl(GOOD_A, [1, 2, 3], GOOD_B)}, "row",
         "in.jsonl line 2 is a JSON list, not an object"),
    Case("truncated last line", {"in.jsonl": jsonl(GOOD_A, GOOD_B)[:-1] + b'\n{"id": "c", "pro'}, "row",
         "in.jsonl line 3 is not valid JSON", bad=(2,)),
    Case("blank lines (skipped, not rows)", {"in.jsonl": b"\n" + jsonl(GOOD_A) + b"\n  \n" + jsonl(GOOD_B)}, "ok",
         rows=2),
    Case("byte order mark, jsonl", {"in.jsonl": b"\xef\xbb\xbf" + jsonl(GOOD_A, GOOD_B)}, "ok"),
    Case("CRLF line ends, jsonl", {"in.jsonl": jsonl(GOOD_A, GOOD_B).replace(b"\n", b"\r\n")}, "ok"),
    Case("byte order mark, csv", {"in.csv": b"\xef\xbb\xbfid,prompt\r\na,hello there\r\nb,good night\r\n"}, "ok",
         fmt="csv"),
    Case("CRLF and quoted newlines, csv", {"in.csv": b'id,prompt\r\na,"line one\r\nline two"\r\nb,hi\r\n'}, "ok",
         fmt="csv", rows=2),
    Case("csv record with too many fields", {"in.csv": b"id,prompt\na,hello\nx,one,two\nb,bye\n"}, "row",
         "in.csv line 3 has 3 fields, the header has 2", fmt="csv"),
    Case("csv field not UTF-8", {"in.csv": b"id,prompt\na,hello\nx,caf\xe9\nb,bye\n"}, "row",
         "column 'prompt' is not UTF-8", fmt="csv"),
    Case("schema changes between jsonl files (per row)",
         {"a.jsonl": jsonl(GOOD_A), "b.jsonl": jsonl(row(prompt=7), GOOD_B)}, "row", "is an int, not a string"),
    Case("keep column changes type (jsonl)", {"in.jsonl": jsonl(GOOD_A, row(n="seven"), GOOD_B)}, "refused",
         "output.keep_columns: column 'n' mixes value types", output={"keep_columns": ["n"]}),
    # ---- templates over columns
    Case("NaN in a template field", {"in.jsonl": jsonl(GOOD_A, b'{"id": "x", "q": "q", "price": NaN}', GOOD_B)},
         "row", "template field {price} is nan", input=TEMPLATE),
    Case("infinity in a template field",
         {"in.jsonl": jsonl(GOOD_A, b'{"id": "x", "q": "q", "price": -Infinity}', GOOD_B)}, "row",
         "template field {price} is -inf", input=TEMPLATE),
    Case("nested type in a template field", {"in.jsonl": jsonl(GOOD_A, row(price={"usd": 3}), GOOD_B)}, "row",
         "template field {price} is a dict; templates take scalar columns only", input=TEMPLATE),
    Case("template field missing in a row", {"in.jsonl": jsonl(GOOD_A, row(price=DROP), GOOD_B)}, "row",
         "template field {price}: this row has no column 'price'", input=TEMPLATE),
    Case("NaN in a template field (parquet)",
         {"in.parquet": parquet([GOOD_A, row(price=float("nan")), GOOD_B])}, "row", "template field {price} is nan",
         input=TEMPLATE, fmt="parquet"),
    # ---- chat messages
    Case("messages is a string", {"in.jsonl": jsonl(GOOD_A, row(messages="hello"), GOOD_B)}, "row",
         "messages column 'messages' is a string", input=MESSAGES),
    Case("messages empty list", {"in.jsonl": jsonl(GOOD_A, row(messages=[]), GOOD_B)}, "row",
         "must be a non-empty list", input=MESSAGES),
    Case("message not a mapping", {"in.jsonl": jsonl(GOOD_A, row(messages=["hi"]), GOOD_B)}, "row",
         "messages[0] is not a {role, content} mapping", input=MESSAGES),
    Case("message without a role", {"in.jsonl": jsonl(GOOD_A, row(messages=[{"content": "hi"}]), GOOD_B)}, "row",
         "with a string role", input=MESSAGES),
    Case("message content null", {"in.jsonl": jsonl(GOOD_A, row(messages=[{"role": "user", "content": None}]),
                                                    GOOD_B)}, "row", "messages[0].content is null", input=MESSAGES),
    Case("all message contents blank", {"in.jsonl": jsonl(GOOD_A, row(messages=[{"role": "user", "content": " "}]),
                                                          GOOD_B)}, "row", "all messages are empty", input=MESSAGES),
    Case("messages null", {"in.jsonl": jsonl(GOOD_A, row(messages=None), GOOD_B)}, "row",
         "messages column 'messages' is null", input=MESSAGES),
    # ---- refused jobs (exit 2, before weights load)
    Case("empty csv file", {"in.csv": b""}, "refused", "in.csv: empty, no header line", fmt="csv"),
    Case("unreadable parquet (garbage bytes)", {"in.parquet": b"PAR1 this is not parquet"}, "refused",
         "in.parquet: not a readable parquet file", fmt="parquet"),
    Case("corrupt gzip", {"in.jsonl.gz": b"\x1f\x8b\x08\x00 not really gzip"}, "refused",
         "in.jsonl.gz: cannot read it"),
    Case("truncated gzip", {"in.jsonl.gz": gzip.compress(jsonl(GOOD_A, GOOD_B) * 50)[:-30]}, "refused",
         "in.jsonl.gz: cannot read it to the end"),
    Case("schema changes between parquet files",
         {"a.parquet": parquet([GOOD_A]), "b.parquet": parquet([{**GOOD_B, "prompt": 5}])}, "refused",
         "b.parquet: column 'prompt' is int64, but string in", fmt="parquet"),
    Case("prompt column missing (parquet)", {"in.parquet": parquet([{"id": "a", "text": "hi"}])}, "refused",
         "in.parquet: no column 'prompt'", fmt="parquet"),
    Case("id column missing (csv)", {"in.csv": b"key,prompt\na,hi\n"}, "refused", "in.csv: no column 'id'", fmt="csv"),
    Case("csv header changes between files", {"a.csv": b"id,prompt\na,hi\n", "b.csv": b"id,text\nb,yo\n"},
         "refused", "b.csv: no column 'prompt'", fmt="csv"),
    Case("keep column absent", {"in.parquet": parquet([GOOD_A])}, "refused",
         "in.parquet: no column 'nope'", fmt="parquet", output={"keep_columns": ["nope"]}),
    Case("keep column clashes with an output column", {"in.jsonl": jsonl(GOOD_A)}, "refused",
         "output.keep_columns: 'completion' clashes", output={"keep_columns": ["completion"]}),
    Case("input path missing", {}, "refused", "does not exist"),
    # ---- a source that cannot be read at all (exit 2), or rows that all fail (exit 1)
    Case("parquet file given as jsonl", {"in.jsonl": parquet([GOOD_A, GOOD_B])}, "refused",
         "in.jsonl: is a Parquet file (input.format: parquet), not jsonl text"),
    Case("parquet file given as csv", {"in.csv": parquet([GOOD_A, GOOD_B])}, "refused",
         "in.csv: is a Parquet file (input.format: parquet), not csv text", fmt="csv"),
    Case("a JSON array, not JSON lines", {"in.jsonl": json.dumps([GOOD_A, GOOD_B], indent=1).encode()}, "refused",
         "in.jsonl: none of its 32 lines is a JSON object"),
    Case("prompt column missing, rows keyed by content (parquet)", {"in.parquet": parquet([{"text": "hi"}])},
         "refused", "input.prompt_column: the input has no column 'prompt' (has: text)", fmt="parquet",
         input={"id_column": None}),
    Case("every row an error row", {"in.jsonl": jsonl(row(prompt=None), row(id="y", prompt=""))}, "failed",
         "every one of the 2 output rows is an error row (row 0: prompt column 'prompt' is null)"),
]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shared_engine():
    return {}


@pytest.fixture
def one_engine(monkeypatch, shared_engine):
    real = pipelines.execution.opening.load_engine

    def load(job, tokenizer=None):
        if "engine" not in shared_engine:
            shared_engine["engine"] = real(job, tokenizer)
        return shared_engine["engine"]

    monkeypatch.setattr(pipelines.execution.opening, "load_engine", load)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_the_table_covers_enough_kinds():
    assert len({c.kind for c in CASES}) == len(CASES) >= 40
    assert {c.expect for c in CASES} == {"row", "refused", "ok", "failed"}


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_bad_input(case: Case, tmp_path, model, one_engine):
    data = tmp_path / "data"
    data.mkdir()
    for name, content in case.files.items():
        (data / name).write_bytes(content)
    path = data / next(iter(case.files)) if len(case.files) == 1 else data / "missing.jsonl" if not case.files else data
    job = job_dict(model, path, tmp_path / "run", fmt=case.fmt, generation={"max_tokens": 2},
                   input=case.input, output={"shard_rows": 2, **case.output})
    job_file = write_job(tmp_path / "job.yaml", job)

    out = cli("run", job_file, "-q")
    checked = cli("validate", job_file)
    if case.expect == "refused":
        assert out.exit_code == 2, out.output
        assert case.message in out.output, out.output
        assert not (tmp_path / "run" / "manifest.json").exists()
        assert checked.exit_code == 2 and case.message in checked.output, checked.output
        return
    if case.expect == "failed":  # the error rows are committed, and the run says it failed
        assert out.exit_code == 1 and case.message in out.output, out.output
        assert all(r["finish_reason"] == "error" for r in read_output(tmp_path / "run"))
        assert cli("run", job_file, "-q").exit_code == 1  # and says so again, with nothing left to do
        assert checked.exit_code == 1, checked.output
        return
    assert out.exit_code == 0, out.output
    rows = read_output(tmp_path / "run")
    n = case.rows if case.rows is not None else _count_rows(case)
    assert [r["row"] for r in rows] == list(range(n)), "a row was lost or duplicated"
    bad = set(case.bad) if case.expect == "row" else set()
    for r in rows:
        if r["row"] in bad:
            assert r["finish_reason"] == "error" and r["completion"] is None
            assert case.message in r["error"], r["error"]
        else:
            assert r["finish_reason"] in ("stop", "length") and r["error"] is None, r
            assert r["completion_tokens"] > 0
    if bad:
        assert checked.exit_code == 1 and case.message in checked.output, checked.output
    else:
        assert checked.exit_code == 0, checked.output


def _count_rows(case: Case) -> int:
    n = 0
    for name, content in case.files.items():
        if name.endswith(".parquet"):
            n += pq.read_metadata(pa.BufferReader(content)).num_rows
        elif name.endswith(".csv"):
            n += content.count(b"\n") - 1
        else:
            n += sum(1 for line in content.splitlines() if line.strip())
    return n
