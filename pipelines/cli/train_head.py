"""`mtplx-batch train-head`: train a multi-token-prediction sidecar head for a model without one.

Registered in `pipelines/cli/commands.py` as `main.add_command(train_head)`; see docs/train-head.md.
"""

from __future__ import annotations

import sys
from typing import Optional

import click

from .assets import gguf_mode_option
from .interrupt import INTERRUPTED, stop_on_sigterm

EPILOG = """\b
Examples:
  mtplx-batch train-head models/smollm2 --data jobs/eval.yaml --out heads/smollm2
  mtplx-batch train-head models/smollm2 --data corpus.txt --out heads/smollm2 --steps 2000
  mtplx-batch train-head models/smollm2 --data prompts.jsonl --out heads/smollm2 --max-new-tokens 128
  # the general head (docs/train-head.md): broad prompts of seven kinds, generated 256 rows at a
  # time for at most 200 s, general text, five held-out datasets of other kinds; about 8 minutes
  mtplx-batch train-head smollm2-135m-instruct --prompts chat:2000 --prompts math:700 --prompts prose:2000 \
      --prompts writing:400 --prompts tools:800 --prompts stdlib-code:1200 --prompts stdlib-chat:800 \
      --max-new-tokens 192 --gen-batch 256 --data-seconds 200 --text stdlib --text-tokens 100000 \
      --heldout-data owt-1k --heldout-data wikipedia-1k --heldout-data truthfulqa-100 --heldout-data gsm8k-100 \
      --heldout-data humaneval --heldout-rows 32 --steps 12000 --fit-steps --batch-size 32 --seq-len 448 \
      --hidden-weight 0.1 --eval-every 500 --checkpoint-every 500 --max-seconds 440 \
      --out heads/smollm2-135m-instruct --restart

\b
--data is a job YAML (its prompts + this model's own greedy continuations: self-distillation),
a JSONL/Parquet/CSV file with a `prompt` (self-distilled) or `text` column, plain text, or a known
dataset (mtplx-batch fetch --list); without it the --prompts are the data (a share held out).
Interrupt with Ctrl-C and run the same command again to continue from HEAD_DIR/checkpoint/.
Use the head in a job with:  speculative: {method: mtp, mtp_head: HEAD_DIR}

\b
Exit codes: 0 success, 1 training failed, 2 invalid arguments or data, or a checkpoint made with
other settings (use --restart), 130 interrupted (the checkpoint is kept).
"""


@click.command("train-head", epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--data", default=None, metavar="JOB.yaml|PATH|DATASET",
              help="Job YAML (self-distill its prompts), JSONL/Parquet/CSV with a prompt or text column, text, or a "
                   "known dataset. Optional with --prompts (then they are the data).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), metavar="HEAD_DIR",
              help="Where the head (mtp_head.safetensors, mtp_head.json) and its checkpoint go.")
@click.option("--depth-layers", type=click.IntRange(1, 8), default=1, show_default=True,
              help="Decoder blocks in the head.")
@click.option("--draft-depths", type=click.IntRange(1, 8), default=3, show_default=True,
              help="Draft depths trained: depth k feeds the head its own depth k-1 output, as drafting does. "
                   "1 trains the next-but-one token only (cheaper; deeper drafts then rarely pass).")
@click.option("--steps", type=click.IntRange(min=0), default=1000, show_default=True, help="Optimizer steps.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Sequences per step.")
@click.option("--seq-len", type=click.IntRange(min=3), default=512, show_default=True,
              help="Longest training sequence in tokens (text is cut into windows of this).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True,
              help="Peak learning rate (linear warmup, cosine decay to 10%).")
@click.option("--heldout", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.1,
              show_default=True, help="Fraction of sequences held out (1..64 of them).")
@click.option("--max-rows", type=click.IntRange(min=1), default=None, help="Use at most N prompts / text windows.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Self-distillation: tokens generated per prompt (default: the job's generation.max_tokens, "
                   "or 256; given, it wins over the job's).")
@click.option("--sample", type=click.IntRange(min=1), default=None, metavar="N",
              help="Job or table data: train on a seeded random sample of N of its rows (their indices go to "
                   "mtp_head.json as sample_rows).")
@click.option("--samples-per-prompt", type=click.IntRange(min=0), default=0, show_default=True,
              help="Self-distillation: sampled continuations per prompt besides the greedy one.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=0.8, show_default=True,
              help="Self-distillation: temperature of the sampled continuations.")
@click.option("--prompts", multiple=True, metavar="KIND:N",
              help="General prompts self-distilled for training (repeatable), each with its greedy and "
                   "--general-samples sampled continuations. From this Python's stdlib: stdlib-code (functions "
                   "cut to signature + docstring), stdlib-chat (docstrings asked about). From datasets fetched "
                   "once: chat (instructions across the evals registry), math, writing (WritingBench requests), "
                   "tools (BFCL tool calls), prose (passage openings continued as raw text).")
@click.option("--general-samples", type=click.IntRange(min=0), default=1, show_default=True,
              help="Sampled continuations per --prompts prompt besides its greedy one (the stdlib holds ~2,100 "
                   "stdlib-code and ~2,300 stdlib-chat prompts: more per prompt is more data).")
@click.option("--gen-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Self-distillation: rows generated together (wider is faster on a GPU).")
@click.option("--data-seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Self-distillation stops this many seconds after its first continuation finished (a fresh "
                   "GPU's kernel builds do not count) and keeps the continuations finished by then (the job's "
                   "rows come first, --prompts after).")
@click.option("--text", multiple=True, metavar="PATH|stdlib",
              help="General text mixed into training (repeatable): a file, a directory of .py/.md/.rst/.txt, or "
                   "'stdlib' (this Python's standard library source). Scored against the trunk's own predictions.")
@click.option("--text-tokens", type=click.IntRange(min=1), default=200_000, show_default=True,
              help="Tokens of --text at most.")
@click.option("--heldout-data", multiple=True, metavar="JOB.yaml|PATH|DATASET",
              help="Another dataset, self-distilled and evaluated only (repeatable): a job, a table or a known "
                   "dataset such as owt-1k, wikipedia-1k, truthfulqa-100, gsm8k-100, humaneval. Its acceptance by "
                   "depth goes to mtp_head.json (heldout_other) beside the training data's own held-out split.")
@click.option("--heldout-rows", type=click.IntRange(min=1), default=32, show_default=True,
              help="Rows (sampled) of each --heldout-data set.")
@click.option("--loss", type=click.Choice(["kl", "argmax", "tokens"]), default="kl", show_default=True,
              help="kl: match the trunk's next-token distribution; argmax: its greedy token; tokens: the data's.")
@click.option("--hidden-weight", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Weight of a regression of the head's hidden state onto the trunk's (as EAGLE heads).")
@click.option("--draft-vocab", type=click.IntRange(min=0), default=8192, show_default=True,
              help="Draft among the N most frequent training tokens (mtp_draft_vocab.npy; exact either way); "
                   "0: the whole vocabulary.")
@click.option("--init", type=click.Choice(["random", "trunk"]), default="random", show_default=True,
              help="Start the head's blocks at random, or as copies of the trunk's last layer.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="Stored trunk hidden states (auto: float32 on CPU, bfloat16 on GPU).")
@click.option("--train-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="What a training step computes in (auto: bfloat16 on a GPU, float32 on a CPU). The head's "
                   "parameters, optimizer state and evaluations stay float32 either way.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps between held-out evaluations.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="Steps between checkpoints.")
@click.option("--max-seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop training after this much wall time (data and trunk passes included); the head is "
                   "evaluated and written as usual.")
@click.option("--fit-steps", is_flag=True,
              help="With --max-seconds: time steps 25-125, then shorten the schedule (warmup, cosine) to the steps "
                   "the time left holds, at most --steps, so the run ends on its schedule, not at the limit. "
                   "The plan is kept in the checkpoint (a resume follows it).")
@gguf_mode_option
@click.option("--restart", is_flag=True, help="Discard HEAD_DIR/checkpoint/ and start over.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars or messages; errors only.")
def train_head(model: str, data: Optional[str], out_dir: str, depth_layers: int, draft_depths: int, steps: int, batch_size: int, seq_len: int,
               lr: float, heldout: float, max_rows: Optional[int], max_new_tokens: Optional[int], sample: Optional[int],
               samples_per_prompt: int, temperature: float, prompts, general_samples: int, gen_batch: int, data_seconds: Optional[float],
               text, text_tokens: int, heldout_data,
               heldout_rows: int, loss: str, hidden_weight: float, draft_vocab: int, init: str,
               dtype: str, train_dtype: str, seed: int, eval_every: int, checkpoint_every: int, max_seconds: Optional[float], fit_steps: bool,
               gguf_mode: str,
               restart: bool, quiet: bool):
    """Train a multi-token-prediction head for MODEL (it predicts token t+2 from the trunk's hidden
    state at t and token t+1) and write it to HEAD_DIR as a sidecar for speculative decoding."""
    from mtplx.training.train_head import TrainConfig, TrainHeadError, checkpoint_step
    from mtplx.training.train_head import train_head as run_training

    from ..errors import JobError
    from ..io.train_data import read_train_data

    cfg = TrainConfig(depth_layers=depth_layers, draft_depths=draft_depths, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                      heldout=heldout, max_rows=max_rows, max_new_tokens=max_new_tokens, init=init, dtype=dtype, train_dtype=train_dtype,
                      seed=seed, eval_every=eval_every, checkpoint_every=checkpoint_every, sample=sample,
                      samples_per_prompt=samples_per_prompt, temperature=temperature, prompts=tuple(prompts), general_samples=general_samples,
                      gen_batch=gen_batch, data_seconds=data_seconds, text=tuple(text),
                      text_tokens=text_tokens, heldout_data=tuple(heldout_data), heldout_rows=heldout_rows, loss=loss,
                      hidden_weight=hidden_weight, draft_vocab=draft_vocab, max_seconds=max_seconds,
                      fit_steps=fit_steps)
    log = None if quiet else (lambda m: click.echo(m, err=True))
    stop_on_sigterm()
    try:
        res = run_training(model, data, out_dir, cfg, restart=restart, quiet=quiet, log=log, read=read_train_data,
                           gguf_mode=gguf_mode)
    except (TrainHeadError, JobError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except FileNotFoundError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        step = checkpoint_step(out_dir)
        where = f"checkpoint at step {step}" if step is not None else "no checkpoint yet"
        click.echo(f"interrupted ({where}): run the same command again to continue", err=True)
        sys.exit(INTERRUPTED)
    import json
    from pathlib import Path

    from mtplx.models.mtp import SIDECAR_META

    for line in acceptance_report(json.loads((Path(res.out_dir) / SIDECAR_META).read_text())):
        click.echo(line)
    if not quiet:
        click.echo(
            f"done: {res.steps} steps ({res.steps - res.resumed_from} this run) in {res.seconds:.1f}s; held-out loss "
            f"{res.initial_heldout_loss:.3f} -> {res.heldout_loss:.3f}, acceptance "
            f"{res.initial_heldout_acceptance:.3f} -> {res.heldout_acceptance:.3f} -> {res.out_dir}\n"
            f"use it with: speculative: {{method: mtp, mtp_head: {res.out_dir}}}",
            err=True,
        )


def acceptance_report(meta: dict) -> list:
    """Held-out acceptance by draft depth and the tokens per verify it implies, for the training
    data's own held-out split and each --heldout-data set: a Markdown table, as printed."""
    from mtplx.training.head_eval import tokens_per_verify

    def row(name, rep):
        by_depth, walked = rep["acceptance_by_depth"], rep.get("replayed") or {}
        tpv = " / ".join(f"{tokens_per_verify(by_depth, k):.2f}" for k in (1, 2, 3))
        if all(str(k) in walked for k in (1, 2, 3)):
            tpv += " (" + " / ".join(f"{walked[str(k)]:.2f}" for k in (1, 2, 3)) + ")"
        return f"| {name} | {rep['positions']:,} | {' / '.join(f'{a:.3f}' for a in by_depth)} | {tpv} |"

    vocab = f", drafting among {meta['draft_vocab']} tokens" if meta.get("draft_vocab") else ""
    depths = " / ".join(str(k) for k in range(1, len(meta["heldout_acceptance_by_depth"]) + 1))
    own = {"acceptance_by_depth": meta["heldout_acceptance_by_depth"], "positions": meta["heldout_positions"],
           "replayed": meta.get("heldout_replayed_tokens_per_verify")}
    return [f"| held-out data{vocab} | positions | acceptance by draft depth {depths} | tokens per verify at "
            "depth 1 / 2 / 3 (walked as the engine's rounds) |", "|---|---|---|---|",
            row(f"the training data's own held-out split ({meta['heldout_sequences']} sequences)", own),
            *(row(o["data"], dict(o, replayed=o.get("replayed_tokens_per_verify"))) for o in meta.get("heldout_other") or [])]
