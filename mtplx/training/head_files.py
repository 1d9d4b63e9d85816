"""What `train-head` writes, each file replaced atomically: the sidecar (NextN keys) and the checkpoint
it resumes from (head, optimizer, step, RNG state)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Union

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..models.loading import ModelBundle
from ..models.mtp import SIDECAR_META, SIDECAR_WEIGHTS, MTPHead, _probe_matches, trunk_probe, trunk_signature
from ..models.mtp_layouts import NEXTN_HEAD
from .config import TrainHeadError

CHECKPOINT_DIR = "checkpoint"
DATA_FILE = "data.npz"
STATE_DIR = "latest"

# head parameter names -> DeepSeek NextN names (under model.layers.{N}.); the head is the trunk's
NEXTN_NAMES = {ours: theirs for theirs, ours in NEXTN_HEAD.items() if ours != "head"}


def nextn_weights(head: MTPHead, num_hidden_layers: int, dtype=None) -> Dict[str, mx.array]:
    """The head's parameters under NextN names at model.layers.{N} (block i at N + i)."""
    N, out = num_hidden_layers, {}
    for k, v in tree_flatten(head.parameters()):
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            name = f"model.layers.{N + int(i)}.{rest}"
        else:
            mod, param = k.split(".", 1)
            if mod not in NEXTN_NAMES:
                raise ValueError(f"head parameter {k!r} has no NextN name")
            name = f"model.layers.{N}.{NEXTN_NAMES[mod]}.{param}"
        out[name] = v.astype(dtype) if dtype is not None and mx.issubdtype(v.dtype, mx.floating) else v
    return out


def save_sidecar(bundle: ModelBundle, head: MTPHead, out_dir: Union[str, os.PathLike], meta: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    N = int(bundle.config["num_hidden_layers"])
    trunk_float = bundle.model.model.embed_tokens(mx.array([0])).dtype  # not a quantized weight's uint32
    tmp = out / (SIDECAR_WEIGHTS + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), nextn_weights(head, N, trunk_float), metadata={"format": "mlx", "layout": "nextn"})
    os.replace(tmp, out / SIDECAR_WEIGHTS)
    full = {"trunk": trunk_signature(bundle.config), "num_hidden_layers": N, "layout": "nextn",
            "depth_layers": len(head.layers), **meta, "trunk_probe": trunk_probe(bundle)}
    tmp = out / (SIDECAR_META + ".tmp")
    tmp.write_text(json.dumps(full, indent=1))
    os.replace(tmp, out / SIDECAR_META)
    return out


def _ckpt_state_dir(out: Path) -> Optional[Path]:
    ck = out / CHECKPOINT_DIR
    return next((ck / n for n in (STATE_DIR, STATE_DIR + ".old") if (ck / n / "state.json").exists()), None)


def _save_checkpoint(out: Path, head: MTPHead, opt: optim.Optimizer, step: int, rng: np.random.Generator,
                     header: dict, history: List[dict], train_loss: Optional[float]):
    ck = out / CHECKPOINT_DIR
    tmp = ck / (STATE_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "head.safetensors"), dict(tree_flatten(head.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    state = dict(header, step=step, rng=rng.bit_generator.state, history=history, train_loss=train_loss)
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    cur, old = ck / STATE_DIR, ck / (STATE_DIR + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if cur.exists():
        os.replace(cur, old)  # a resume finds the old one until the new one is in place
    os.replace(tmp, cur)
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_step(out_dir) -> Optional[int]:
    d = _ckpt_state_dir(Path(out_dir))
    return None if d is None else int(json.loads((d / "state.json").read_text())["step"])


def resumable_state(state_dir: Optional[Path], ck: Path, cfg, header: dict) -> Optional[dict]:
    """The checkpoint's state (None without one); refused unless it is a run of these settings."""
    if state_dir is None:
        return None
    state = json.loads((state_dir / "state.json").read_text())
    saved = dict({"draft_depths": 1, "fit_steps": False}, **state["config"])  # what a checkpoint without them ran
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs now {v!r}" for k, v in cfg.resume_view().items()
            if saved.get(k) != v]
    if state["trunk"] != header["trunk"]:
        diff.insert(0, f"trunk: checkpoint {state['trunk']} vs model {header['trunk']}")
    elif not _probe_matches(state.get("trunk_probe") or [], header["trunk_probe"]):
        diff.insert(0, "trunk: same shape but other weights than the checkpoint's")
    dkey = header["data_key"]
    if dkey is not None and state.get("data_key") is not None and state["data_key"] != dkey:
        diff.append(f"data: checkpoint {state['data_key'].get('path')} (sha256 {state['data_key'].get('sha256')}) "
                    f"vs now {dkey['path']} (sha256 {dkey['sha256']})")
    if diff:
        raise TrainHeadError(f"{ck} holds a run with other settings ({'; '.join(diff)}): use the same "
                             "settings to resume it, or --restart to start over")
    return state


def sidecar_meta(cfg, tdata, res, header: dict, held_report: dict, train_dtype, vocab) -> dict:
    """The sidecar's metadata: the run's TrainResult `res`, its data and its settings."""
    same = ("steps", "train_loss", "heldout_loss", "heldout_acceptance", "initial_heldout_loss",
            "initial_heldout_acceptance", "heldout_other", "sequences")
    return {**{k: getattr(res, k) for k in same}, "planned_steps": header.get("planned_steps"),
            "heldout_acceptance_by_depth": res.acceptance_by_depth,
            "heldout_tokens_per_verify": held_report["tokens_per_verify"],
            "heldout_replayed_tokens_per_verify": held_report["replayed_tokens_per_verify"],
            "train_dtype": str(train_dtype).split(".")[-1],  # what the training steps computed in
            "draft_vocab": None if vocab is None else len(vocab),
            "data": tdata.source, "data_digest": tdata.digest(), "sample_rows": tdata.rows,
            "heldout_sequences": len(tdata.heldout), "train_positions": res.train_tokens,
            "heldout_positions": res.heldout_tokens, "seconds": round(res.seconds, 1), "config": asdict(cfg)}
