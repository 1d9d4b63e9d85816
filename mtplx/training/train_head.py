"""Train a multi-token-prediction sidecar head for a model that ships none (`mtplx-batch train-head`).

An MTPHead over the frozen trunk learns token t+2 from h_t and token t+1 on the model's own
continuations (what the verifier accepts). Depth k sees the head's own depth k-1 output (a head trained
on depth 1 alone accepts almost nothing at depth 2), so `draft_depths` unrolls that recursion."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .config import TrainConfig, TrainHeadError
from .head_data import (ReadData, TrainData, _bar, build_data, general_data, is_dataset_name, is_job_or_table,
                        padded_length, self_distill, text_data, trunk_features)
from .head_prompts import check_heldout
from .head_eval import _batch, _causal, _unrolled, depth_report, evaluate
from ..models.loading import ModelBundle, load
from ..process import prepare_process
from .head_files import (CHECKPOINT_DIR, DATA_FILE, _ckpt_state_dir, _save_checkpoint, checkpoint_step,
                         resumable_state, save_sidecar, sidecar_meta)
from ..drafting.mtp_bank import DRAFT_VOCAB_FILE, DraftVocab, frequent_tokens, save_draft_vocab
from ..models.mtp import MTPHead, has_trunk_split, project_logits, trunk_probe, trunk_signature


@dataclass
class TrainResult:
    out_dir: str
    steps: int
    train_loss: Optional[float]
    heldout_loss: float
    heldout_acceptance: float
    initial_heldout_loss: float
    initial_heldout_acceptance: float
    sequences: int
    train_tokens: int
    heldout_tokens: int
    resumed_from: int = 0
    seconds: float = 0.0
    history: List[dict] = field(default_factory=list)
    acceptance_by_depth: List[float] = field(default_factory=list)
    heldout_other: List[dict] = field(default_factory=list)  # each --heldout-data set's report


def _loss(head: MTPHead, hidden, tokens, targets, mask, depths: int = 1, teacher=None, kind: str = "tokens",
          hidden_weight: float = 0.0, vocab: Optional[DraftVocab] = None, index=None):
    """Mean over depths of the cross-entropy to the trunk's distribution (kl), argmax or tokens, plus
    `hidden_weight` x the squared error to its hidden state; over the drafting vocabulary `vocab`, if any."""
    total = 0.0
    levels = _unrolled(head, hidden, tokens, targets, mask, depths, None if vocab is None else vocab.logits)
    for d, (logits, tgt, m, h) in enumerate(levels):
        logp = logits.astype(mx.float32)
        logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
        t = None if teacher is None else mx.stop_gradient(teacher[:, d : d + tgt.shape[1]])
        if kind == "tokens" or t is None:
            if index is not None:
                tgt = index[tgt]
                m = m * (tgt >= 0)
                tgt = mx.maximum(tgt, 0)
            ce = -mx.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        else:
            t_logits = (project_logits(head._trunk[0], t) if vocab is None else vocab.logits(t)).astype(mx.float32)
            if kind == "kl":
                ce = -(mx.softmax(t_logits, axis=-1) * logp).sum(axis=-1)
            else:
                ce = -mx.take_along_axis(logp, mx.argmax(t_logits, axis=-1)[..., None], axis=-1)[..., 0]
        if hidden_weight and t is not None:
            ce = ce + hidden_weight * mx.square(h.astype(mx.float32) - t.astype(mx.float32)).mean(axis=-1)
        total = total + (ce * m).sum() / mx.maximum(m.sum(), 1.0)
    return total / len(levels)


def _dtypes(cfg):
    """(dtype hidden states are stored in, dtype a step computes in); the rest stays float32."""
    auto = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return tuple(auto if name == "auto" else getattr(mx, name) for name in (cfg.dtype, cfg.train_dtype))


def _value_and_grad(head: nn.Module, loss_fn, dtype):
    """(loss, float32 gradients) of `loss_fn(head, ...)` computed over a `dtype` copy of the parameters."""
    if dtype == mx.float32:
        return nn.value_and_grad(head, loss_fn)

    def over(params, *args):
        head.update(params)
        return loss_fn(head, *args)

    grad_fn = mx.value_and_grad(over)

    def run(_head, *args):
        master = head.trainable_parameters()
        try:
            loss, grads = grad_fn(tree_map(lambda p: p.astype(dtype), master), *args)
        finally:
            head.update(master)
        return loss, tree_map(lambda g: g.astype(mx.float32), grads)

    return run


def _dense_params(module: nn.Module) -> Dict[str, mx.array]:
    """`module`'s parameters in float32, a quantized layer's weight dequantized (its scales and biases dropped)."""
    out, packing = {}, set()
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            prefix = f"{name}." if name else ""
            packing |= {prefix + "scales", prefix + "biases"}
            out[prefix + "weight"] = mx.dequantize(mod.weight, mod.scales, mod.get("biases"), mod.group_size, mod.bits,
                                                   mode=mod.mode)
    out.update((k, v) for k, v in tree_flatten(module.parameters()) if k not in packing and k not in out)
    return {k: v.astype(mx.float32) for k, v in out.items()}


def _init_head(model, cfg: TrainConfig) -> MTPHead:
    mx.random.seed(cfg.seed)
    head = MTPHead(model, n_layers=cfg.depth_layers)
    if cfg.init == "trunk":
        # blocks start as the trunk's last layer of their kind, the norm as its final norm: on its scale
        src = next((l for l in reversed(model.layers) if type(l) is type(head.layers[0])), None)
        if src is not None:
            want = {k: v.shape for k, v in tree_flatten(head.layers[0].parameters())}
            have = _dense_params(src)
            if {k: v.shape for k, v in have.items()} == want:
                for blk in head.layers:
                    blk.update(tree_unflatten(list(have.items())))
        norm = getattr(model.model, "norm", None)
        w = getattr(norm, "weight", None)
        if isinstance(w, mx.array) and w.shape == head.norm.weight.shape and type(norm) is type(head.norm):
            head.norm.weight = w.astype(mx.float32)
    head.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in tree_flatten(head.parameters())]))
    mx.eval(head.parameters())
    return head


def _schedule(cfg: TrainConfig):
    peak, end = cfg.lr, cfg.lr * cfg.min_lr_ratio
    decay = optim.cosine_decay(peak, max(cfg.steps - cfg.warmup, 1), end)
    if cfg.warmup > 0:
        return optim.join_schedules([optim.linear_schedule(peak / cfg.warmup, peak, cfg.warmup), decay], [cfg.warmup])
    return decay


FIT_PROBE = (25, 125)  # --fit-steps times steps 25..125: the first steps build kernels


def _fit(cfg: TrainConfig, step: int, per_step: float, eval_seconds: float, left: float) -> int:
    """Steps the schedule can span in `left` seconds, evaluations and a final reserve included."""
    reserve = max(10.0, 10 * eval_seconds)
    more = (left - reserve) / (per_step + eval_seconds / cfg.eval_every)
    return int(min(cfg.steps, max(step + 1, step + int(more))))


DATA_KEYS = ("max_rows", "max_new_tokens", "seq_len", "heldout", "seed", "sample", "samples_per_prompt", "temperature",
             "text_tokens", "gen_batch", "data_seconds")  # the settings that shape a data file's sequences


def data_key(data, cfg: TrainConfig) -> Optional[dict]:
    """A data file's content digest and the settings that shape its sequences (None: in-memory data)."""
    if not isinstance(data, (str, os.PathLike)) or not os.path.isfile(data):
        return None
    h = hashlib.sha256()
    with open(data, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    key = {"path": os.path.abspath(data), "sha256": h.hexdigest()[:16], **{k: getattr(cfg, k) for k in DATA_KEYS}}
    key.update(text=list(cfg.text), prompts=list(cfg.prompts))
    if cfg.general_samples != 1:  # only when not the default: older keys still match
        key["general_samples"] = cfg.general_samples
    return key


def _read(read, data, bundle: ModelBundle, cfg: TrainConfig):
    if read is not None and isinstance(data, (str, os.PathLike)) and (
            is_job_or_table(str(data)) and os.path.exists(data) or is_dataset_name(str(data))):
        return read(str(data), bundle.tokenizer, cfg)
    return data


def _training_data(bundle: ModelBundle, data, cfg: TrainConfig, ck: Path, state: Optional[dict], dkey, started: float,
                   read, quiet: bool, log) -> TrainData:
    data_file = ck / DATA_FILE
    # a checkpoint's data, or a run's that stopped before its first checkpoint
    if data_file.exists() and (state is not None or dkey is not None and TrainData.stored_key(data_file) == dkey):
        tdata = TrainData.load(data_file)
        log((f"resuming at step {state['step']}: " if state is not None else "reusing ")
            + f"{len(tdata.sequences)} sequences from {data_file}")
        return tdata
    # generation ends by half the time limit, however long kernel builds held it back
    deadline = started + cfg.max_seconds / 2 if cfg.max_seconds is not None else None
    if data is None:  # the general prompts are the data, a share held out
        tdata, extra = general_data(bundle, cfg, quiet, log, deadline), None
    else:
        tdata = build_data(bundle, _read(read, data, bundle, cfg), cfg, quiet, log, deadline).clip(cfg.seq_len)
        extra = tdata.extra if tdata.extra is not None else general_data(bundle, cfg, quiet, log, deadline)
    tdata.split(cfg.heldout, cfg.seed)
    if extra is not None:  # --prompts: training only, like --text
        tdata.extend(extra)
    if cfg.text:  # training only: the held-out split stays the data's own
        tdata.extend(text_data(bundle, cfg.text, cfg.text_tokens, cfg.seq_len, cfg.seed).clip(cfg.seq_len))
    tdata.save(data_file, dkey)
    log(f"data: {len(tdata.sequences)} sequences, {sum(map(len, tdata.sequences)):,} tokens "
        f"({time.monotonic() - started:.0f}s)")
    return tdata


def train_head(model, data, out_dir, config: Optional[TrainConfig] = None, *, restart: bool = False,
               quiet: bool = True, callback: Optional[Callable[[int, dict], None]] = None,
               log: Optional[Callable[[str], None]] = None, read: Optional[Callable] = None,
               gguf_mode: str = "auto") -> TrainResult:
    """Train an MTP sidecar head for `model` on `data` into `out_dir`, resuming a checkpoint of the same
    settings. An exception from `callback(step, metrics)` stops training after a checkpoint;
    `read(path, tokenizer, cfg)` reads a job or a table named by `data` or `heldout_data`."""
    prepare_process()
    cfg = config or TrainConfig()
    cfg.check()
    check_heldout(cfg.prompts, cfg.heldout_data, str(data) if isinstance(data, (str, os.PathLike)) else None)
    if data is None and not cfg.prompts:
        raise TrainHeadError("no training data: give --data (a job, a table or text), --prompts KIND:N, or both")
    log = log or ((lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr)))
    started = time.monotonic()
    bundle = model if isinstance(model, ModelBundle) else load(model, gguf_mode=gguf_mode)
    mdl = bundle.model
    if not has_trunk_split(mdl):
        raise TrainHeadError(f"model {bundle.path}: no separable trunk and output head (model.model.embed_tokens "
                             "and lm_head); an MTP head cannot be trained for it")
    out = Path(out_dir)
    ck = out / CHECKPOINT_DIR
    if restart and ck.exists():
        shutil.rmtree(ck)
    dkey = data_key(data, cfg)
    header = {"trunk": trunk_signature(bundle.config), "trunk_probe": trunk_probe(bundle), "config": cfg.resume_view(),
              "data_key": dkey}
    state_dir = _ckpt_state_dir(out)
    state = resumable_state(state_dir, ck, cfg, header)

    tdata = _training_data(bundle, data, cfg, ck, state, dkey, started, read, quiet, log)
    held = set(tdata.heldout)
    train_idx = [i for i in range(len(tdata.sequences)) if i not in held]
    if not train_idx:
        raise TrainHeadError("no training sequences left after holding some out: give more data")

    store_dtype, step_dtype = _dtypes(cfg)
    train = tdata.subset(train_idx, tdata.source)
    train_f = trunk_features(mdl, train.sequences, train.starts, store_dtype, False, desc="trunk (train)", quiet=quiet)
    held_f = trunk_features(mdl, [tdata.sequences[i] for i in tdata.heldout], [tdata.starts[i] for i in tdata.heldout],
                            store_dtype, True, desc="trunk (held-out)", quiet=quiet)
    others = _heldout_sets(bundle, cfg, ck, store_dtype, quiet, read, log)
    log(f"{len(train_idx)} training sequences ({train_f.positions} positions), {len(tdata.heldout)} held out "
        f"({held_f.positions} positions)" + "".join(f", {f.positions} positions of {name}"
                                                    for name, (_, f) in zip(cfg.heldout_data, others))
        + f"; data and trunk passes took {time.monotonic() - started:.0f}s")
    passes = cfg.steps * min(cfg.batch_size, len(train_idx)) / len(train_idx)
    if passes > 30:
        log(f"note: {cfg.steps} steps x {cfg.batch_size} sequences pass over the training data {passes:.0f} times; "
            "held-out loss will rise after the first few passes (acceptance keeps most of its gain): more data "
            "(--max-rows, a larger job) helps more than more steps")

    head = _init_head(mdl, cfg)
    vocab, draft, index = _draft_vocab(bundle, head, train, cfg)
    _causal(head, 2)  # settle the mask kind outside any gradient transform
    # the schedule spans cfg.steps, or what --fit-steps planned (kept in the checkpoint)
    total = int((state or {}).get("planned_steps") or cfg.steps)
    if (state or {}).get("planned_steps"):
        header["planned_steps"] = total
    plan = {"lr": _schedule(replace(cfg, steps=total))}
    opt = optim.AdamW(learning_rate=lambda s: plan["lr"](s), weight_decay=cfg.weight_decay)
    opt.init(head.trainable_parameters())
    rng = np.random.default_rng(cfg.seed)
    history: List[dict] = []
    train_loss, step = None, 0
    if state is not None:
        head.load_weights(list(mx.load(str(state_dir / "head.safetensors")).items()), strict=True)
        opt.state = tree_unflatten(list(mx.load(str(state_dir / "optimizer.safetensors")).items()))
        rng.bit_generator.state = state["rng"]
        step, history, train_loss = int(state["step"]), list(state["history"]), state.get("train_loss")
        mx.eval(head.parameters(), opt.state)
    resumed_from = step

    def held_out(step: int) -> dict:
        hl, ha = evaluate(head, held_f, vocab=vocab)
        history.append({"step": step, "train_loss": train_loss, "heldout_loss": hl, "heldout_acceptance": ha})
        return history[-1]

    initial = next((h for h in history if h["step"] == 0), None)
    eval_seconds = 0.0
    if initial is None:
        t0 = time.monotonic()
        initial = held_out(0)
        eval_seconds = time.monotonic() - t0
        log(f"untrained head: held-out loss {initial['heldout_loss']:.4f}, acceptance "
            f"{initial['heldout_acceptance']:.3f} ({time.monotonic() - started:.0f}s; training steps compute in "
            f"{str(step_dtype).split('.')[-1]})")

    # on a GPU every step gets one shape (each new one builds kernels); on a CPU padding costs more
    fixed = padded_length(cfg.seq_len) if mx.default_device() == mx.gpu else None
    mixed = {"dtype": step_dtype, "grad": _value_and_grad(head, _loss, step_dtype)}

    def train_step(chosen):
        hidden, tok, tgt, m, _, teacher = _batch(train_f, chosen, mixed["dtype"], fixed)
        loss, grads = mixed["grad"](head, hidden, tok, tgt, m, cfg.draft_depths, teacher, cfg.loss, cfg.hidden_weight,
                                    draft, index)
        if cfg.grad_clip:
            grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(head, grads)
        mx.eval(loss, head.parameters(), opt.state)
        return loss

    def first_step(chosen):
        """The run's first step; float32 from here on where a bfloat16 step fails."""
        kept = (head.trainable_parameters(), tree_map(lambda x: x, opt.state))
        try:
            return train_step(chosen)
        except (RuntimeError, ValueError) as e:
            if mixed["dtype"] == mx.float32:
                raise
            log(f"a {str(mixed['dtype']).split('.')[-1]} training step failed ({e}): training in float32")
            head.update(kept[0])
            opt.state = kept[1]
            mixed.update(dtype=mx.float32, grad=_value_and_grad(head, _loss, mx.float32))
            return train_step(chosen)
    last_eval = history[-1]
    bar = _bar(total, "train-head", not quiet)
    bar.update(step)
    interrupted = None
    fitting = (cfg.fit_steps and cfg.max_seconds is not None and "planned_steps" not in (state or {})
               and cfg.steps > step + FIT_PROBE[1])
    probe_from, probe_to, probe_start = step + FIT_PROBE[0], step + FIT_PROBE[1], 0.0
    try:
        while step < total:
            if cfg.max_seconds is not None and time.monotonic() - started > cfg.max_seconds:
                log(f"time limit of {cfg.max_seconds:.0f}s reached at step {step} of {total}")
                break
            idx = rng.choice(len(train_idx), size=min(cfg.batch_size, len(train_idx)), replace=False)
            loss = (first_step if step == resumed_from else train_step)(sorted(int(i) for i in idx))
            step += 1
            if fitting and step == probe_from:
                probe_start = time.monotonic()
            elif fitting and step == probe_to:
                fitting = False
                per_step = (time.monotonic() - probe_start) / (probe_to - probe_from)
                total = _fit(cfg, step, per_step, eval_seconds, cfg.max_seconds - (time.monotonic() - started))
                plan["lr"] = _schedule(replace(cfg, steps=total))
                header["planned_steps"] = total
                bar.total = total
                log(f"--fit-steps: {per_step:.3f} s a step; the schedule now spans {total} steps "
                    f"(of at most {cfg.steps})")
            lv = loss.item()
            train_loss = lv if train_loss is None else 0.95 * train_loss + 0.05 * lv  # a moving average
            metrics = {"loss": lv, "lr": float(opt.learning_rate)}
            if step % cfg.eval_every == 0 or step == total:
                last_eval = held_out(step)
                hl, ha = last_eval["heldout_loss"], last_eval["heldout_acceptance"]
                metrics.update(heldout_loss=hl, heldout_acceptance=ha)
                log(f"step {step}/{total}: train loss {train_loss:.3f}, held-out loss {hl:.3f}, acceptance {ha:.3f} "
                    f"({time.monotonic() - started:.0f}s)")
            bar.set_postfix_str(f"loss {train_loss:.3f} held-out acc {last_eval['heldout_acceptance']:.3f}",
                                refresh=False)
            bar.update(1)
            if step % cfg.checkpoint_every == 0 or step == total:
                _save_checkpoint(out, head, opt, step, rng, header, history, train_loss)
            if callback is not None:
                callback(step, metrics)
    except BaseException as e:  # KeyboardInterrupt, SIGTERM, a callback
        interrupted = e
    finally:
        bar.close()
    if interrupted is None and last_eval["step"] != step:
        last_eval = held_out(step)
    if checkpoint_step(out) != step:
        _save_checkpoint(out, head, opt, step, rng, header, history, train_loss)
    if interrupted is not None:
        raise interrupted
    depths = max(cfg.draft_depths, 4)
    held_report = depth_report(head, held_f, depths, vocab=vocab)
    other_meta = [{"data": other.source, "sequences": len(other.sequences), "positions": other_f.positions,
                   **depth_report(head, other_f, depths, vocab=vocab)} for other, other_f in others]
    res = TrainResult(out_dir=str(out), steps=step, train_loss=train_loss, heldout_loss=last_eval["heldout_loss"],
                      heldout_acceptance=last_eval["heldout_acceptance"], initial_heldout_loss=initial["heldout_loss"],
                      initial_heldout_acceptance=initial["heldout_acceptance"], sequences=len(tdata.sequences),
                      train_tokens=train_f.positions, heldout_tokens=held_f.positions, resumed_from=resumed_from,
                      seconds=time.monotonic() - started, history=history, heldout_other=other_meta,
                      acceptance_by_depth=held_report["acceptance_by_depth"])
    save_sidecar(bundle, head, out, sidecar_meta(cfg, tdata, res, header, held_report, mixed["dtype"], vocab))
    if vocab is not None:
        save_draft_vocab(out, vocab)
    else:  # an earlier run's: this head drafts over the whole vocabulary
        (out / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    log(f"held-out loss {initial['heldout_loss']:.4f} -> {last_eval['heldout_loss']:.4f}, acceptance "
        f"{initial['heldout_acceptance']:.3f} -> {last_eval['heldout_acceptance']:.3f}; wrote {out}")
    return res


def _draft_vocab(bundle: ModelBundle, head: MTPHead, train: TrainData, cfg: TrainConfig):
    """(ids, DraftVocab, index: id -> place or -1) of the drafting vocabulary, or (None, None, None)."""
    V = int(head.logits(mx.zeros((1, head.fc.weight.shape[0]))).shape[-1])
    if not 0 < cfg.draft_vocab < V:
        return None, None, None
    eos = list(getattr(bundle.tokenizer, "eos_token_ids", None) or [])
    vocab = frequent_tokens(train.sequences, train.starts, cfg.draft_vocab, V, eos)
    draft = DraftVocab(head, vocab, V)
    index = np.full(V, -1, dtype=np.int32)
    index[np.array(draft.ids)] = np.arange(draft.size, dtype=np.int32)
    return vocab, draft, mx.array(index)


def _heldout_sets(bundle: ModelBundle, cfg: TrainConfig, ck: Path, store_dtype, quiet: bool, read, log) -> List[tuple]:
    """(TrainData, Features) of each `heldout_data` set, self-distilled once and kept by key."""
    ocfg = replace(cfg, sample=cfg.heldout_rows, max_rows=cfg.heldout_rows, samples_per_prompt=0, prompts=())
    sets: Dict[str, TrainData] = {}
    todo = []
    for name in cfg.heldout_data:
        key = {"heldout_data": os.path.abspath(name) if os.path.exists(name) else name, "rows": cfg.heldout_rows,
               "seq_len": cfg.seq_len}
        path = ck / f"heldout-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}.npz"
        if path.exists() and TrainData.stored_key(path) == key:
            sets[name] = TrainData.load(path)
        else:
            todo.append((name, key, path, _read(read, name, bundle, ocfg)))
    rows = [(name, p) for name, _, _, d in todo if isinstance(d, ReadData) for p in d.prompts]
    if rows:
        news = [d.max_new_tokens for _, _, _, d in todo if isinstance(d, ReadData) for _ in d.prompts]
        log(f"self-distilling {len(rows)} rows of {len(todo)} held-out set(s)")
        both = self_distill(bundle, [p for _, p in rows], news, cfg.gen_batch, cfg.seq_len, quiet, seed=cfg.seed)
    for name, key, path, d in todo:
        if isinstance(d, ReadData) and d.prompts:
            mine = [i for i, g in enumerate(both.groups) if rows[g][0] == name]
            sets[name] = both.subset(mine, d.source)
        else:
            sets[name] = build_data(bundle, d, ocfg, quiet, log)
        sets[name].clip(cfg.seq_len).save(path, key)
    return [(sets[name], trunk_features(bundle.model, sets[name].sequences, sets[name].starts, store_dtype, True,
                                        desc=f"trunk (held-out {name})", quiet=quiet)) for name in cfg.heldout_data]
