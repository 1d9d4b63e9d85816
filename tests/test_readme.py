"""Every command and snippet in README.md runs after the README's install line.

The README's code blocks are extracted and run in order, in a scratch directory whose
jobs/eval.yaml is the bundled job pointed at a tiny local model and a local copy-shaped input
(no package index needed): bash lines as shell commands (`pip install` is what CI did before
this test; `pytest` is this suite), python blocks with the interpreter, yaml blocks as job files.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobkit import write_jsonl

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def code_blocks(text: str):
    """(language, body) of every fenced block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def shell_commands(body: str):
    """The commands of a bash block, comments dropped, `a && b` split, installs and pytest left out."""
    out = []
    for line in body.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for cmd in filter(None, (c.strip() for c in line.split("&&"))):
            if re.match(r"(python -m )?pip install\b", cmd) or re.match(r"python -m pytest\b", cmd):
                continue
            out.append(cmd)
    return out


def test_readme_blocks_are_found():
    blocks = code_blocks(README.read_text())
    langs = [lang for lang, _ in blocks]
    assert langs.count("bash") >= 3 and "python" in langs and "yaml" in langs, langs
    cmds = [c for lang, body in blocks if lang == "bash" for c in shell_commands(body)]
    assert "mtplx-batch run jobs/eval.yaml" in cmds
    assert any(c.startswith("mtplx-batch export") for c in cmds)


def test_readme_install_line_has_what_the_snippets_need():
    """pandas (to_pandas()), matplotlib (report), datasets (format: hf) are core dependencies."""
    tomllib = pytest.importorskip("tomllib")

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in meta["dependencies"]}
    assert {"pandas", "matplotlib", "datasets", "pyarrow"} <= names, names


@pytest.mark.slow
def test_readme_commands_and_snippets_run(tiny_model, tmp_path, monkeypatch):
    model = tiny_model("llama")
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    rows = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    return x + {i}\n", "entry_point": f"f{i}"}
            for i in range(10)]
    data = write_jsonl(tmp_path / "humaneval.jsonl", [dict(r, id=r["task_id"]) for r in rows])
    job = yaml.safe_load((ROOT / "jobs" / "eval.yaml").read_text())
    job["model"]["path"] = str(model)
    job["input"]["path"] = str(data)
    job["generation"]["max_tokens"] = 6
    (work / "jobs" / "eval.yaml").write_text(yaml.safe_dump(job, sort_keys=False))

    # `mtplx-batch` is this checkout's CLI, whatever is installed
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "mtplx-batch"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pipelines.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(ROOT),
               MPLBACKEND="Agg")

    ran = []
    for lang, body in code_blocks(README.read_text()):
        if lang == "bash":
            for cmd in shell_commands(body):
                out = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True,
                                     timeout=600)
                assert out.returncode == 0, f"README command failed: {cmd}\n{out.stdout}\n{out.stderr}"
                ran.append((cmd, out.stdout + out.stderr))
        elif lang == "python":
            out = subprocess.run([sys.executable, "-c", body], cwd=work, env=env, capture_output=True, text=True,
                                 timeout=300)
            assert out.returncode == 0, f"README snippet failed:\n{body}\n{out.stderr}"
            ran.append(("python", out.stdout))
        elif lang == "yaml":
            from pipelines.job.config import load_job

            path = tmp_path / "readme-job.yaml"
            path.write_text(body)
            with monkeypatch.context() as m:
                m.chdir(ROOT)  # the example names heads/ relative to a checkout
                load_job(str(path))
            ran.append(("yaml", ""))
    cmds = [c for c, _ in ran]
    assert "mtplx-batch run jobs/eval.yaml" in cmds and "python" in cmds and "yaml" in cmds
    first = next(o for c, o in ran if c == "mtplx-batch run jobs/eval.yaml")
    assert "done: 8 rows written" in first, first
    exported = (work / "runs" / "eval" / "export" / "results.jsonl").read_text().splitlines()
    assert len(exported) == 8 and json.loads(exported[0])["id"] == "HumanEval/0"
    assert (work / "runs" / "eval" / "report" / "index.html").exists()
