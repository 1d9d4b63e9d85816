"""Security: nothing in a job file, an input row, a model directory or a run directory can run
code, reach Python internals, or make the pipeline write outside its run directory.

- job files (and --set values, and RUN_DIR/job.yaml) load with yaml.safe_load: python tags refused;
- input.template is parsed by our own tiny parser: only {column}, no attributes / indexes /
  conversions / format specs; data is never re-interpreted as a template;
- chat templates render in jinja2's ImmutableSandboxedEnvironment (transformers'
  apply_chat_template, which mlx-lm's TokenizerWrapper calls); a template reaching for Python
  internals refuses the job (or, when only some rows trigger it, errors those rows);
- a model whose config.json names a `model_file` (Python shipped with the weights) is refused
  unless model.trust_remote_code: true;
- row ids never reach a path; the job name cannot leave runs/; a shard record cannot lead
  outside RUN_DIR/shards (`..`, an absolute path, a link), for any command that reads it; a run
  directory of another job (or not a run directory) is refused and left untouched; --restart
  moves aside, rather than deleting, only a run, and a failed move loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobkit import job_dict, read_output, sample_rows, write_job, write_jsonl, write_parquet
from pipelines.cli.commands import main


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def data(tmp_path):
    return write_parquet(tmp_path / "in.parquet", sample_rows(4))


def tree(root: Path):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*")) if p.name != ".lock"}


def model_copy(llama: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(llama, dst)
    return dst


# ---------------------------------------------------------------------------- YAML


EVIL_TAGS = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
    "!!python/name:os.system",
    "!!python/object:pipelines.job.config.JobConfig {{name: x}}",
]


@pytest.mark.parametrize("tag", EVIL_TAGS)
def test_job_file_python_tags_are_refused(tmp_path, llama, data, tag):
    marker = tmp_path / "pwned"
    job = job_dict(llama, data, tmp_path / "run")
    text = write_job(tmp_path / "job.yaml", job).read_text()
    evil = tmp_path / "evil.yaml"
    evil.write_text(text.replace("name: test", "name: " + tag.format(marker=marker)))
    for cmd in ("run", "validate"):
        out = cli(cmd, evil)
        assert out.exit_code == 2 and "not valid YAML" in out.output, out.output
    # through --set, and through a tampered RUN_DIR/job.yaml
    out = cli("run", tmp_path / "job.yaml", "--set", "input.split=" + tag.format(marker=marker))
    assert out.exit_code == 2 and "--set" in out.output, out.output
    assert cli("run", tmp_path / "job.yaml", "-q", "--limit", "1").exit_code == 0
    stored = tmp_path / "run" / "job.yaml"
    stored.write_text(stored.read_text().replace("name: test", "name: " + tag.format(marker=marker)))
    out = cli("resume", tmp_path / "run")
    assert out.exit_code == 2 and "not valid YAML" in out.output, out.output
    assert not marker.exists()


# ---------------------------------------------------------------------------- input.template


@pytest.mark.parametrize("template", [
    "{prompt.__class__}", "{prompt.__init__.__globals__}", "{prompt.__class__.__mro__[1].__subclasses__}",
    "{prompt[0]}", "{prompt!r}", "{prompt:>{width}}", "{prompt()}", "{}", "{_private}", "{ prompt}",
    "{prompt.upper}", "{__import__}",
])
def test_template_cannot_reach_attributes(tmp_path, llama, data, template):
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run",
                                                    input={"template": template, "prompt_column": None}))
    out = cli("run", job)
    assert out.exit_code == 2, out.output
    assert "input.template:" in out.output and "is not allowed" in out.output or "unclosed" in out.output
    assert not (tmp_path / "run").exists()


def test_template_data_is_never_reinterpreted(tmp_path, llama):
    from mtplx.models.loading import load_tokenizer_only
    from pipelines.job.config import InputConfig
    from pipelines.io.prompts import PromptRenderer

    tok = load_tokenizer_only(llama)
    r = PromptRenderer(InputConfig(path="x", template="Q: {q}", chat_template="off"), tok)
    value = "{q.__class__} {{7*7}} {% raw %}{{ cycler.__init__.__globals__ }}"
    assert r.text({"q": value}) == "Q: " + value
    chat = PromptRenderer(InputConfig(path="x", prompt_column="p", chat_template="on"), tok)
    rendered = tok.apply_chat_template(chat.text({"p": value}), add_generation_prompt=True, tokenize=False)
    assert value in rendered  # message content is data, not template source


# ---------------------------------------------------------------------------- chat templates


def _set_chat_template(model: Path, template: str) -> None:
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (model / extra).unlink(missing_ok=True)


EVIL_CHAT = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch {marker}') }}",
    "{{ raise_exception.__globals__['__builtins__']['exec']('open(\"{marker}\", \"w\")') }}",
    "{% set x = messages.append({{'role': 'user', 'content': 'injected'}}) %}{{ messages }}",
    "{{ namespace.__init__.__globals__ }}",
]


@pytest.mark.parametrize("template", EVIL_CHAT)
def test_malicious_chat_template_refuses_the_job(tmp_path, llama, data, template):
    marker = tmp_path / "pwned"
    model = model_copy(llama, tmp_path)
    _set_chat_template(model, template.replace("{marker}", str(marker)).replace("{{'", "{'").replace("'}}", "'}"))
    job = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run"))
    for cmd in ("run", "validate"):
        out = cli(cmd, job)
        assert out.exit_code == 2, out.output
        assert "chat template does something the template sandbox forbids" in out.output, out.output
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_chat_template_attack_hidden_behind_row_content_errors_only_those_rows(tmp_path, llama):
    marker = tmp_path / "pwned"
    model = model_copy(llama, tmp_path)
    _set_chat_template(model, (
        "{%- for m in messages %}{%- if 'attack' in m['content'] %}"
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"))
    rows = [{"id": "a", "prompt": "hello"}, {"id": "b", "prompt": "attack now"}, {"id": "c", "prompt": "bye"}]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    job = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run", fmt="jsonl",
                                                    generation={"max_tokens": 2}))
    out = cli("run", job, "-q")
    assert out.exit_code == 0, out.output
    got = read_output(tmp_path / "run")
    assert [r["finish_reason"] == "error" for r in got] == [False, True, False]
    assert "unsafe" in got[1]["error"] and got[1]["error"].startswith("chat template refused the messages")
    assert not marker.exists()


def test_chat_templates_compile_in_an_immutable_sandbox():
    """What renders the tokenizer's chat template: transformers, into ImmutableSandboxedEnvironment."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    if not hasattr(chat_utils, "_compile_jinja_template"):
        pytest.skip("transformers moved its template compiler; the behaviour tests above still hold")
    compiled = chat_utils._compile_jinja_template("{{ messages }}")
    assert isinstance(compiled.environment, ImmutableSandboxedEnvironment)


# ---------------------------------------------------------------------------- trust_remote_code


def test_model_file_is_refused_unless_trusted(tmp_path, llama, data):
    marker = tmp_path / "pwned"
    model = model_copy(llama, tmp_path)
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_file"] = "evil.py"
    (model / "config.json").write_text(json.dumps(cfg))
    job = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run"))
    for cmd in ("run", "validate"):
        out = cli(cmd, job)
        assert out.exit_code == 2, out.output
        assert "sets model_file: 'evil.py'" in out.output and "model.trust_remote_code: true" in out.output
    assert not marker.exists() and not (tmp_path / "run").exists()
    # the job's explicit opt-in is what lets it through (this evil.py builds no model, so the run fails)
    out = cli("run", job, "-q", "--set", "model.trust_remote_code=true")
    assert marker.exists() and out.exit_code == 1


def test_tokenizer_auto_map_code_is_not_run(tmp_path, llama, data):
    marker = tmp_path / "pwned"
    model = model_copy(llama, tmp_path)
    (model / "evil_tok.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]}
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    job = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run", generation={"max_tokens": 2}))
    out = cli("run", job, "-q")
    assert out.exit_code in (0, 2), out.output
    assert not marker.exists()


# ---------------------------------------------------------------------------- paths


EVIL_IDS = ["../../etc/passwd", "/etc/passwd", "..\\..\\windows\\system32", "shards/../../x", "a/b/c", ".lock",
            "manifest.json", "../run/manifest.json", "~/x", "$(touch pwned)", "part-00000.parquet", "\x00nul"]


def test_ids_never_become_paths(tmp_path, llama):
    rows = [{"id": i, "prompt": f"Say hello number {n}"} for n, i in enumerate(EVIL_IDS)]
    data = write_parquet(tmp_path / "in.parquet", rows)
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run", generation={"max_tokens": 2},
                                                    output={"shard_rows": 3}))
    before = tree(tmp_path)
    out = cli("run", job, "-q")
    assert out.exit_code == 0, out.output
    after = tree(tmp_path)
    new = sorted(set(after) - set(before))
    assert all(p == "run" or p.startswith("run/") for p in new), new
    inside = sorted(p for p in new if p != "run")
    assert inside == ["run/commits.jsonl", "run/job.yaml", "run/manifest.json", "run/progress.jsonl", "run/shards"] + [
        f"run/shards/part-{i:05d}.parquet" for i in range(4)]
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted(r["id"] for r in read_output(tmp_path / "run")) == sorted(EVIL_IDS)


@pytest.mark.parametrize("name", ["../escape", "/abs", "..", "a/../../b", "x\\y"])
def test_job_name_cannot_leave_runs(tmp_path, llama, data, name):
    job = job_dict(llama, data, tmp_path / "run", name=name)
    del job["output"]["dir"]
    out = cli("run", write_job(tmp_path / "job.yaml", job))
    assert out.exit_code == 2 and "name: expected a plain name" in out.output, out.output


def test_run_dir_of_another_job_is_never_overwritten(tmp_path, llama, data):
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, tmp_path / "run", generation={"max_tokens": 3}))
    assert cli("run", job, "-q").exit_code == 0
    before = tree(tmp_path / "run")
    for change in ("generation.temperature=0.5", "generation.seed=9", "input.prompt_column=topic"):
        for cmd in ("run", "validate"):
            out = cli(cmd, job, "--set", change)
            assert out.exit_code == 2 and "a different job" in out.output, out.output
            assert change.split("=")[0] in out.output
        assert tree(tmp_path / "run") == before
    # --restart moves it aside, byte for byte, and never deletes it
    assert cli("run", job, "-q", "--set", "generation.seed=9", "--restart").exit_code == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and tree(aside[0]) == before


def test_directory_that_is_not_a_run_is_never_touched(tmp_path, llama, data):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    (run / "shards").mkdir()
    (run / "shards" / "keep.bin").write_bytes(b"\x00" * 10)
    before = tree(run)
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, run))
    out = cli("run", job)
    assert out.exit_code == 2 and "is not a run directory" in out.output, out.output
    assert tree(run) == before
    assert "--restart" not in out.output  # it would be refused: see below


NOT_RUNS = {
    "a project": {"src/code.py": "print('precious')", "README.md": "# project"},
    "a folder of inputs": {"in.parquet": "PAR1", "more/in2.jsonl": "{}"},
    "a web app's manifest": {"manifest.json": '{"name": "app", "start_url": "/"}', "index.html": "<html>"},
    "a torn manifest beside other files": {"manifest.json": '{"fingerprint": "ab', "notes.txt": "mine"},
}


@pytest.mark.parametrize("kind", list(NOT_RUNS))
def test_restart_moves_aside_only_a_run(tmp_path, llama, data, kind):
    """--restart renames output.dir only when it is a run (our manifest, or nothing but our own
    files); a project root, $HOME or a folder of inputs is refused (exit 2) and left as it is."""
    out_dir = tmp_path / "target"
    for name, text in NOT_RUNS[kind].items():
        (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(text)
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, out_dir))
    before = tree(tmp_path)
    for args in ((), ("--restart",)):
        out = cli("run", job, "-q", *args)
        assert out.exit_code == 2, out.output
        assert str(out_dir) in out.output and "point output.dir at a new or empty directory" in out.output.lower()
        assert "pass --restart" not in out.output, out.output
        assert tree(tmp_path) == before
    assert "--restart moves aside only a run directory" in out.output and "nothing was moved" in out.output


def test_restart_says_where_the_run_went_and_a_failed_move_loses_nothing(tmp_path, llama, data):
    run = tmp_path / ("r" * 240)  # the name with .old-STAMP appended is too long for the file system
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, run, generation={"max_tokens": 2}))
    assert cli("run", job, "-q").exit_code == 0
    before = tree(tmp_path)
    out = cli("run", job, "--restart")
    assert out.exit_code == 2, out.output
    assert f"--restart: cannot move {run} aside to {run}.old-" in out.output
    assert "nothing was moved or deleted" in out.output and "Traceback" not in out.output
    assert tree(tmp_path) == before
    short = tmp_path / "run"
    run.rename(short)
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, short, generation={"max_tokens": 2}))
    out = cli("run", job, "--restart")
    assert out.exit_code == 0, out.output
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and f"--restart: moved the previous run to {aside[0]}" in out.output


def _point_out(run: Path, outside: Path, how: str) -> str:
    manifest = json.loads((run / "manifest.json").read_text())  # a finished run lists its shards there
    recs = manifest["shards"]
    shard = run / recs[0]["file"]
    shutil.copy(shard, outside)  # the same bytes: only where the record leads is wrong
    if how == "link":
        shard.unlink()
        shard.symlink_to(outside)
        return "part-00000.parquet: a link to"
    recs[0]["file"] = "../outside.parquet" if how == "relative" else str(outside)
    (run / "manifest.json").write_text(json.dumps(manifest))
    return "is not a shard of this run directory"


@pytest.mark.parametrize("how", ["relative", "absolute", "link"])
def test_every_reader_refuses_a_shard_outside_the_run(tmp_path, llama, data, how):
    """run, validate, status, report and export read a shard only inside RUN_DIR/shards."""
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", job_dict(llama, data, run, generation={"max_tokens": 2},
                                                    output={"shard_rows": 2}))
    assert cli("run", job, "-q").exit_code == 0
    expected = _point_out(run, tmp_path / "outside.parquet", how)
    before = tree(tmp_path)
    for args in (("run", job, "-q"), ("validate", job), ("status", run), ("report", run, "--out", tmp_path / "rep"),
                 ("export", run, "--format", "jsonl", "--out", tmp_path / "out.jsonl")):
        out = cli(*args)
        assert out.exit_code == 2 and expected in out.output, (args, out.output)
        assert tree(tmp_path) == before
