"""Startup: the fast tokenizer and weight loader match mlx-lm's, and a run reaches its first token
without importing transformers or pandas, printing its startup phases with --log-json."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from jobkit import job_dict, write_job, write_jsonl
from tiny_models import CHAT_TEMPLATE, build_tokenizer, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent

TEXTS = ["def add(a, b):\n    return a + b\n", "  leading spaces and\ttabs", "unicode: héllo wörld ✓", "x" * 50, ""]
CHATS = [
    [{"role": "user", "content": "Write a function."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
]


def _mlx_lm_tokenizer(path: Path, eos=None):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(path, eos_token_ids=eos)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_fast_tokenizer_matches_mlx_lm(tok_dir):
    from mtplx.models.tokenizer import FastTokenizer, load_fast_tokenizer

    fast, ref = load_fast_tokenizer(tok_dir, eos_token_ids=[3]), _mlx_lm_tokenizer(tok_dir, [3])
    assert isinstance(fast, FastTokenizer)
    assert fast.chat_template == CHAT_TEMPLATE
    for text in TEXTS:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special)
            assert fast.decode(ids) == ref.decode(ids)
    for chat in CHATS:
        for gen in (True, False):
            text = fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert fast.apply_chat_template(chat, add_generation_prompt=gen) == fast.encode(text, add_special_tokens=False)
    assert fast.eos_token_ids == set(ref.eos_token_ids)
    assert fast.vocab_size == ref.vocab_size
    assert fast.bos_token == ref.bos_token


def _edit_config(path: Path, **changes):
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes", [
    {"clean_up_tokenization_spaces": True},  # decode would clean text up
    {"chat_template": "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"},
    {"chat_template_type": "deepseek_v32"},  # mlx-lm's own renderer
    {"add_prefix_space": True},  # transformers would rebuild the pre-tokenizer
    {"add_bos_token": True, "bos_token": "<|im_start|>"},  # the post-processor adds none
])
def test_fast_tokenizer_leaves_what_it_cannot_match_to_mlx_lm(tmp_path, changes):
    from mtplx.models.tokenizer import load_fast_tokenizer

    path = build_tokenizer(tmp_path / "t")
    assert load_fast_tokenizer(path) is not None
    _edit_config(path, **changes)
    assert load_fast_tokenizer(path) is None


def test_loader_matches_mlx_lm_load_model(tmp_path):
    """Same weights (plain and affine-quantized, mixed bits) and so the same logits."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mtplx.models.loading import _classes_without_mtp, load

    plain = make_tiny_model(tmp_path / "plain", "qwen3")
    model, _ = load_model(plain)
    quant = tmp_path / "quant"
    quant.mkdir()
    for f in plain.iterdir():
        if f.name != "model.safetensors":
            (quant / f.name).write_bytes(f.read_bytes())
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear) and "mlp" in p)
    nn.quantize(model, group_size=64, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear) and "self_attn" in p)
    mx.save_safetensors(str(quant / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    (quant / "config.json").write_text(json.dumps(cfg))
    x = mx.array([[1, 5, 9, 200, 33]])
    for path in (plain, quant):
        ref, _ = load_model(path, get_model_classes=_classes_without_mtp)
        ours = load(path)
        assert set(ours.phases) == {"config", "tokenizer", "weights"}
        a, b = dict(tree_flatten(ref.parameters())), dict(tree_flatten(ours.model.parameters()))
        assert a.keys() == b.keys()
        assert all(mx.array_equal(a[k], b[k]).item() for k in a)
        assert mx.array_equal(ref(x), ours.model(x)).item()


def _python(code: str):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr


def test_engine_loads_without_transformers(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    out, _ = _python(
        "import sys, mtplx.generation as g\n"
        f"e = g.Engine.load({str(path)!r})\n"
        "print(type(e.tokenizer).__name__, 'transformers' in sys.modules, 'pandas' in sys.modules)\n"
        "from mlx_lm import batch_generate, generate\n"  # mlx-lm's own API still works afterwards
        "import mlx_lm\n"
        "print(callable(generate), mlx_lm.generate is generate, bool(mlx_lm.__version__))\n"
    )
    assert out.split() == ["FastTokenizer", "False", "False", "True", "True", "True"]


# Seconds of imports each (torch with transformers on a GPU host) that nothing needs before the first token.
HEAVY = ("torch", "matplotlib", "datasets", "ray", "pyarrow.dataset", "mlx_lm.generate", "mlx_lm.utils",
         "mlx_lm.tokenizer_utils")


def test_run_reports_startup_phases_without_transformers_or_pandas(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama")
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"def f{i}(x):", "tag": f"t{i}"}
                                               for i in range(3)])
    job = job_dict(model, data, tmp_path / "run", fmt="jsonl", generation={"max_tokens": 4},
                   output={"dir": str(tmp_path / "run"), "keep_columns": ["tag"]})
    job_file = write_job(tmp_path / "job.yaml", job)
    out, err = _python(
        "import sys, pipelines.execution.startup as s\n"
        f"HEAVY = {HEAVY!r}\n"
        "real = s.Startup.report\n"
        "def report(self, emit):\n"
        "    if not self.reported:\n"
        "        print('transformers' in sys.modules, 'pandas' in sys.modules,\n"
        "              sorted(m for m in HEAVY if m in sys.modules))\n"
        "    real(self, emit)\n"
        "s.Startup.report = report\n"
        "from pipelines.cli import main\n"
        f"main(['run', {str(job_file)!r}, '--log-json'], standalone_mode=False)\n"
    )
    assert out.split() == ["False", "False", "[]"]  # at the first token
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    startup = [e for e in events if e["event"] == "startup"]
    assert len(startup) == 1
    phases = startup[0]
    for name in ("import", "config", "tokenizer", "weights", "engine", "first_token", "total"):
        assert phases[name] >= 0, name
    parts = sum(phases[n] for n in ("import", "config", "tokenizer", "weights", "engine", "first_token"))
    assert abs(parts - phases["total"]) < 0.05


def test_architecture_probe_is_remembered_only_beside_a_converted_model(tmp_path, monkeypatch):
    """A passed probe is not run again for a model under the cache directory (a converted one),
    while any other model directory is probed on every load; a changed config probes again."""
    import mtplx.architectures as arch
    from mtplx.generation import Engine
    from mtplx.models.loading import cache_dir, load

    calls = []
    real = arch._probe
    monkeypatch.setattr(arch, "_probe", lambda *a: (calls.append(a[1]), real(*a)))
    elsewhere = make_tiny_model(tmp_path / "m", "llama")
    converted = make_tiny_model(cache_dir() / "converted" / f"tiny-{tmp_path.name}", "llama")
    for _ in range(2):
        Engine(load(elsewhere))
    assert len(calls) == 2 and not (elsewhere / arch.PASSED_FILE).exists()
    for _ in range(2):
        Engine(load(converted))
    assert len(calls) == 3 and (converted / arch.PASSED_FILE).exists()
    cfg = json.loads((converted / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 2
    (converted / "config.json").write_text(json.dumps(cfg))
    Engine(load(converted))
    assert len(calls) == 4


def test_mixed_packings_the_loader_cannot_infer_go_to_mlx_lm(tmp_path):
    """Affine by default, but some layers packed as mxfp4 (uint8 scales): left to mlx-lm's loader,
    which infers their mode, so the model is still the same."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mtplx.models.loading import _classes_without_mtp, load

    path = make_tiny_model(tmp_path / "m", "qwen3")
    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: isinstance(m, nn.Linear) and "mlp" in p)
    nn.quantize(model, group_size=64, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear) and "self_attn" in p)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 8, "mode": "affine"}
    (path / "config.json").write_text(json.dumps(cfg))
    ref, _ = load_model(path, get_model_classes=_classes_without_mtp)
    ours = load(path).model
    x = mx.array([[1, 5, 9, 200, 33]])
    assert mx.array_equal(ref(x), ours(x)).item()


def test_a_run_loads_the_tokenizer_once(tmp_path, monkeypatch):
    """The session loads the tokenizer before any weights (to render and check rows); the engine
    takes that one instead of loading it again."""
    from mtplx.models import loading
    from pipelines.execution.session import run_job
    from pipelines.job.config import load_job

    model = make_tiny_model(tmp_path / "m", "llama")
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"def f{i}(x):"} for i in range(2)])
    job_file = write_job(tmp_path / "job.yaml", job_dict(model, data, tmp_path / "run", fmt="jsonl",
                                                         generation={"max_tokens": 3}))
    loads = []
    real = loading._load_tokenizer
    monkeypatch.setattr(loading, "_load_tokenizer", lambda *a: loads.append(a) or real(*a))
    summary = run_job(load_job(str(job_file)))
    assert summary.outputs == 2 and len(loads) == 1
