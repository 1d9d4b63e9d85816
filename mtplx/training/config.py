"""What `train-head` is asked to do: its settings, their checks, and its one error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


class TrainHeadError(Exception):
    """The request cannot be carried out as given (exit 2)."""

    exit_code = 2


KINDS = ("stdlib-code", "stdlib-chat", "chat", "math", "writing", "tools", "prose")


def parse_spec(spec: str) -> Tuple[str, int]:
    """'stdlib-code:500' -> ('stdlib-code', 500), with an error that lists the kinds."""
    kind, _, n = spec.partition(":")
    if kind not in KINDS or not n.isdigit() or int(n) < 1:
        raise TrainHeadError(f"--prompts {spec!r}: give KIND:N with KIND one of {', '.join(KINDS)} and N >= 1 "
                             "(e.g. --prompts chat:2000)")
    return kind, int(n)


LOSSES = ("kl", "argmax", "tokens")


@dataclass
class TrainConfig:
    depth_layers: int = 1  # decoder blocks in the head
    draft_depths: int = 3  # draft depths trained (depth k feeds the head its own depth k-1 output)
    steps: int = 1000  # optimizer steps (the cosine schedule spans exactly these)
    batch_size: int = 8  # sequences per step
    seq_len: int = 512  # longest training sequence (tokens); text is cut into windows of this
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = -1  # -1: 5% of steps (at most 100)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    heldout: float = 0.1  # fraction of sequences held out (at least one, at most 64)
    max_rows: Optional[int] = None  # prompts (job / table) or windows (text) used at most
    max_new_tokens: Optional[int] = None  # self-distillation: tokens generated per prompt (None: the job's max_tokens, or 256)
    gen_batch: int = 32  # self-distillation: rows decoded together
    init: str = "random"  # random (MLX default init) | trunk: blocks start as copies of the trunk's last layer
    loss: str = "kl"  # kl: to the trunk's next-token distribution | argmax: CE to the trunk's argmax | tokens: CE to the data
    hidden_weight: float = 0.0  # weight of a regression of the head's hidden state onto the trunk's (EAGLE)
    draft_vocab: int = 8192  # drafting vocabulary: the N most frequent training tokens (0: the whole vocabulary)
    sample: Optional[int] = None  # job / table data: a seeded sample of N rows (None: all, up to max_rows)
    samples_per_prompt: int = 0  # self-distillation: sampled continuations per prompt besides the greedy one
    temperature: float = 0.8  # self-distillation: temperature of the sampled continuations
    prompts: Tuple[str, ...] = ()  # general prompts self-distilled for training only: "KIND:N" (KINDS)
    general_samples: int = 1  # sampled continuations per general prompt besides the greedy one
    data_seconds: Optional[float] = None  # self-distillation stops at this wall time, keeping what finished
    text: Tuple[str, ...] = ()  # general text mixed into training: files, directories, or "stdlib"
    text_tokens: int = 200_000  # tokens of general text at most
    heldout_data: Tuple[str, ...] = ()  # other datasets evaluated, never trained on: jobs, tables, dataset names
    heldout_rows: int = 32  # rows of each heldout_data set
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    train_dtype: str = "auto"  # the training step's matmuls: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    seed: int = 0
    eval_every: int = 100  # steps between held-out evaluations (progress bar, log)
    checkpoint_every: int = 100  # steps between checkpoints
    max_seconds: Optional[float] = None  # stop training after this much wall time (the head is evaluated and saved)
    fit_steps: bool = False  # with max_seconds: shorten the schedule (at most `steps`) to what the measured step time fits

    # Keys that change what is trained: a resume with different values is refused.
    RESUME_KEYS = ("depth_layers", "draft_depths", "steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps",
                   "weight_decay", "grad_clip", "init", "dtype", "train_dtype", "seed", "loss", "hidden_weight", "draft_vocab",
                   "fit_steps")

    def check(self):
        rules = [("depth_layers", self.depth_layers >= 1, ">= 1"),
                 ("draft_depths", 1 <= self.draft_depths <= 8, "in 1..8"),
                 ("steps", self.steps >= 0, ">= 0"),
                 ("batch_size", self.batch_size >= 1, ">= 1"),
                 ("seq_len", self.seq_len >= 3, ">= 3 (h_t, x_t+1, x_t+2)"),
                 ("heldout", 0.0 < self.heldout < 1.0, "a fraction in (0, 1)"),
                 ("init", self.init in ("trunk", "random"), "trunk or random"),
                 ("loss", self.loss in LOSSES, f"one of {', '.join(LOSSES)}"),
                 ("hidden_weight", self.hidden_weight >= 0, ">= 0"),
                 ("draft_vocab", self.draft_vocab >= 0, ">= 0 (0: the whole vocabulary)"),
                 ("sample", self.sample is None or self.sample >= 1, ">= 1 rows"),
                 ("general_samples", self.general_samples >= 0, ">= 0"),
                 ("gen_batch", self.gen_batch >= 1, ">= 1 rows"),
                 ("data_seconds", self.data_seconds is None or self.data_seconds > 0, "> 0"),
                 ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"), "auto, float32, bfloat16 or float16"),
                 ("train_dtype", self.train_dtype in ("auto", "float32", "bfloat16"), "auto, float32 or bfloat16")]
        problems = [f"{name} must be {want}, got {getattr(self, name)!r}" for name, ok, want in rules if not ok]
        for spec in self.prompts:
            try:
                parse_spec(spec)
            except TrainHeadError as e:
                problems.append(str(e))
        if problems:
            raise TrainHeadError("invalid training settings: " + "; ".join(problems))

    @property
    def warmup(self) -> int:
        return min(self.warmup_steps, self.steps) if self.warmup_steps >= 0 else min(100, self.steps // 20)

    def resume_view(self) -> dict:
        return {k: getattr(self, k) for k in self.RESUME_KEYS}


