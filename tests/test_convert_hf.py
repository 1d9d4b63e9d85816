"""`mtplx-batch convert HF_DIR OUT_DIR [--quantize 4|8] [--head-bf16]`: an MLX copy that keeps the head.

- `--quantize 4` of a fixture (the hybrid qwen3_5, and the 2-module mimo head): the head is kept
  and quantized like the trunk, plain `mlx_lm.load` still loads the directory, and the converted
  model runs `method: mtp` token-identical to its own plain decoding, the head drafting.
- Without quantization the built head is the head built from the raw checkpoint, bit for bit;
  `--head-bf16` keeps it in bfloat16; config.json records what the copy was made from.
- The CLI takes a GGUF file or an HF directory and refuses options that do not apply.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from mtplx.config import ScheduleConfig, SpeculativeConfig
from mtplx.generation import Engine
from mtplx.models.convert import HEAD_META, HEAD_WEIGHTS
from mtplx.models.loading import load
from mtplx.models.mtp import load_head
from mtplx.request import Request, SamplingParams
from pipelines.cli.commands import main as cli

from mtp_fixtures import make_mtp_model
from tiny_models import reference_tokens

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "import os", "the quick brown fox jumps over the lazy dog. the",
           "class Stack:\n    def push(self, x):\n"]


def _convert(src, out, *args):
    res = CliRunner().invoke(cli, ["convert", str(src), str(out), *args])
    assert res.exit_code == 0, res.output
    return out


def _mtp_matches_plain(path, depth=3):
    bundle = load(path)
    model, _ = mlx_lm.load(str(path))  # plain mlx-lm: the trunk alone
    tok = bundle.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    refs = [reference_tokens(model, p, 8, set(tok.eos_token_ids)) for p in prompts]
    for compiled in ("off", "on"):
        eng = Engine(bundle, SpeculativeConfig(method="mtp", depth=depth, adaptive_depth=False, compiled_verify=compiled),
                     ScheduleConfig(max_batch=4))
        out = {r.key: r for r in eng.generate(
            [Request(key=i, prompt_tokens=p, params=SamplingParams(max_tokens=8)) for i, p in enumerate(prompts)])}
        assert [out[i].tokens for i in range(len(prompts))] == refs, compiled
        assert sum(out[i].stats.drafted_tokens for i in range(len(prompts))) > 0
    return bundle


@pytest.mark.parametrize("family,kw", [("qwen3_5", {}), ("mimo", {"mtp_layers": 2})])
def test_quantized_copy_keeps_the_head_and_stays_lossless(tmp_path, family, kw):
    src = make_mtp_model(tmp_path / "src", family, **kw)
    out = _convert(src, tmp_path / "q4", "--quantize", "4", "--group-size", "32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 32
    keys = mx.load(str(out / HEAD_WEIGHTS))
    assert any(k.endswith("fc.scales") for k in keys), sorted(keys)[:10]
    assert not any("mtp" in k for f in out.glob("model*.safetensors") for k in mx.load(str(f)))
    bundle = _mtp_matches_plain(out)
    head = load_head(bundle)
    fcs = [m.fc for m in getattr(head, "depths", [head])]
    assert len(fcs) == kw.get("mtp_layers", 1) and all(isinstance(fc, nn.QuantizedLinear) for fc in fcs)
    rec = cfg["mtplx_convert"]
    assert rec["source"] == str(src.resolve()) and rec["quantize"] == 4 and rec["head"] == "4-bit"
    assert rec["source_files"] == {"model.safetensors": (src / "model.safetensors").stat().st_size}


def test_float_copy_holds_the_same_head_and_bf16_keeps_it_in_bfloat16(tmp_path):
    src = make_mtp_model(tmp_path / "src", "qwen3_5", shards=2)  # a sharded checkpoint too
    raw = dict(tree_flatten(load_head(load(src)).parameters()))
    out = _convert(src, tmp_path / "f")
    built = dict(tree_flatten(load_head(load(out)).parameters()))
    assert raw.keys() == built.keys() and all(mx.array_equal(raw[k], built[k]).item() for k in raw)
    bf = _convert(src, tmp_path / "bf", "--quantize", "8", "--head-bf16")
    assert {v.dtype for v in mx.load(str(bf / HEAD_WEIGHTS)).values()} == {mx.bfloat16}
    assert json.loads((bf / HEAD_META).read_text())["quantization"] is None
    _mtp_matches_plain(bf, depth=2)


def test_a_checkpoint_without_head_converts_and_says_so(tmp_path):
    src = make_mtp_model(tmp_path / "src", "glm4_moe", with_mtp=False)
    out = _convert(src, tmp_path / "o")
    assert not (out / HEAD_META).exists()
    assert json.loads((out / "config.json").read_text())["mtplx_convert"]["head"] is None


def test_convert_refuses_what_does_not_apply(tmp_path):
    src = make_mtp_model(tmp_path / "src", "mimo")
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "o"), "--dequantize"])
    assert res.exit_code == 2 and "--quantize" in res.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "full")])
    assert res.exit_code == 2 and "not empty" in res.output
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "full"), str(tmp_path / "o2")])
    assert res.exit_code == 2 and "config.json" in res.output
