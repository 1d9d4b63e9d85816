#!/usr/bin/env bash
# The H200 measurements in BENCHMARKS.md, in steps that each fit one device call.
# MLX goes there as wheels (../shared/GPU.md); the GGUF model and HumanEval JSONL sit in ~/keep.
#
#   bash benchmarks/gpu_session.sh train    # self-distilled MTP head for SmolLM2 (no HumanEval rows)
#   bash benchmarks/gpu_session.sh real     # SmolLM2 on HumanEval: plain / ngram / mtp vs mlx-lm
#   bash benchmarks/gpu_session.sh shapes   # random Qwen3-0.6B / 8B shapes: engine vs mlx-lm, verify cost
set -euo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=~/site:$PWD MTPLX_CACHE=/tmp/mtplx-cache PYTHONUNBUFFERED=1
MODEL=${MODEL:-$HOME/keep/SmolLM2-135M-Instruct.Q4_1.gguf}
PROMPTS=${PROMPTS:-$HOME/keep/humaneval.jsonl}
HEAD=${HEAD:-/tmp/head}

case "${1:-all}" in
train)
  python3 -m pipelines.cli train-head "$MODEL" --data benchmarks/data/head_train_prompts.jsonl --out "$HEAD" \
    --steps "${STEPS:-1500}" --batch-size 16 --seq-len 384 --max-new-tokens 128 --eval-every 250 --quiet \
    2>&1 | tee "$OUT/train_head.log"
  # bf16 copy small enough to bring back and commit (the head trains in fp32)
  python3 - "$HEAD" "$OUT/head" <<'EOF'
import json, shutil, sys, pathlib
import mlx.core as mx
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
w = mx.load(str(src / "mtp_head.safetensors"))
mx.save_safetensors(str(dst / "mtp_head.safetensors"), {k: v.astype(mx.bfloat16) for k, v in w.items()})
shutil.copy(src / "mtp_head.json", dst / "mtp_head.json")
print(json.load(open(dst / "mtp_head.json")))
EOF
  ;;
real)
  python3 -m benchmarks.real_models --model "$MODEL" --prompts "$PROMPTS" --head "${HEAD_EVAL:-$OUT/head}" \
    --rows 32 --tokens 128 --widths 8,32 --depths 1,2,3,4 --out "$OUT"
  ;;
shapes)
  python3 -m benchmarks.engine_efficiency --shapes 0.6b,8b --tokens 128 --batch 32 --out "$OUT"
  ;;
esac
