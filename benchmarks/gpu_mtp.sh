#!/usr/bin/env bash
# Issue 18 on the H200: train the SmolLM2 MTP head with the recipe, then benchmark it on held-out
# rows of the job it was trained on and on a second dataset. Each step fits one device call.
# The files travel as in ../shared/GPU.md: .gpu-a (mlx, mlx-lm, CUDA wheel part 1), .gpu-b (CUDA
# part 2, gguf wheel, humaneval + gsm8k-100 jsonl), .gpu-c / .gpu-d (the SmolLM2 GGUF in two parts);
# a call per folder runs `cp .gpu-X/* ~/keep/`, and the next two steps follow on the same machine.
#
#   bash benchmarks/gpu_mtp.sh train   # install, assets, train-head (the recipe, <= 7 min in all) -> ~/keep/head and $OUT
#   bash benchmarks/gpu_mtp.sh bench   # HumanEval rows the head never saw + GSM8K: ours vs mlx-lm; phase profile
#   bash benchmarks/gpu_mtp.sh round   # the shipped head: MTP 3 (pipelined; + lookup 2) vs plain vs mlx-lm, widths 1/32/8, HumanEval held out + GSM8K, phases at 1
#   bash benchmarks/gpu_mtp.sh lookup  # the shipped head: mtp vs mtp + lookup fallback vs ngram vs plain vs mlx-lm, HumanEval held out + GSM8K
#   bash benchmarks/gpu_mtp.sh depth   # the shipped head: adaptive depth vs fixed depth 3 vs plain, widths 1/32, HumanEval held out + GSM8K (~2 min)
#   bash benchmarks/gpu_mtp.sh attn    # rows_attention's checks + timing, then width-32 MTP rounds (one wave, refilled stream), limit 8 vs 3
#   bash benchmarks/gpu_mtp.sh cli     # the example jobs as a user runs them (mtplx-batch run, a fresh process each): wall, startup phases, summary
#   bash benchmarks/gpu_mtp.sh fresh   # the shipped eval-mtp job in fresh processes, prefill queries unpadded / padded: warm-up (first-time costs) vs timed
#   bash benchmarks/gpu_mtp.sh jobs    # jobs/eval-mtp.yaml as shipped vs the same rows with ngram / ngram adaptive / none, and batch_generate, one process, phases as they end
#   bash benchmarks/gpu_mtp.sh kcache  # custom CUDA kernels built by MLX in every process vs once per machine (mtplx/kernel_cache.py): fresh processes, sources, entries
#   bash benchmarks/gpu_mtp.sh clirep  # the example jobs as a user runs them, fresh processes, settings interleaved REPEATS times: medians, same text
#   bash benchmarks/gpu_mtp.sh stream  # width-32 refilled streams of 2x / 4x width rows: plain vs MTP 3 (+ lookup 2), admissions, drains, tail (REPEATS=N: interleaved)
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=~/site:$PWD MTPLX_CACHE=${MTPLX_CACHE:-/tmp/mtplx-cache} PYTHONUNBUFFERED=1
KEEP=${KEEP:-$HOME/keep}
MODEL=smollm2-135m-instruct
HEAD=$KEEP/head

heldout() {  # HEAD_DIR: HumanEval rows outside that head's training sample, and GSM8K (the gsm8k job's template)
  python3 - "$1" "$MTPLX_CACHE/assets" <<'EOF'
import json, sys
head, assets = sys.argv[1], sys.argv[2]
seen = set(json.load(open(f"{head}/mtp_head.json"))["sample_rows"])
rows = [json.loads(l) for l in open(f"{assets}/humaneval/humaneval.jsonl")]
with open("/tmp/humaneval-heldout.jsonl", "w") as f:
    for i, r in enumerate(rows):
        if i not in seen:
            f.write(json.dumps({"id": r.get("id", i), "prompt": r["prompt"]}) + "\n")
with open("/tmp/gsm8k.jsonl", "w") as f:
    for l in open(f"{assets}/gsm8k-100/gsm8k-100.jsonl"):
        r = json.loads(l)
        f.write(json.dumps({"prompt": r["question"] + "\nAnswer with the final number after 'The answer is'."}) + "\n")
print(f"{len(rows) - len(seen)} held-out HumanEval rows")
EOF
}

case "${1:-}" in
train)  # the recipe, data + training + held-out evaluation, under one hard limit (TOTAL, 400 s) -> $OUT
  # Sizes are env vars so the same step dry-runs on a CPU with tiny ones (install and asset copies are
  # skipped where their files are absent, as on a CPU).
  if [ ! -d ~/site/mlx ] && [ -f "$KEEP/cuda-aa" ]; then
    cat "$KEEP"/cuda-aa "$KEEP"/cuda-ab > "$KEEP"/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    rm -f "$KEEP"/cuda-a?
    python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site "$KEEP"/*.whl || exit 1
  fi
  A=$MTPLX_CACHE/assets
  mkdir -p "$A/$MODEL" "$A/humaneval" "$A/gsm8k-100"
  [ -f "$A/$MODEL/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cat "$KEEP"/smol-aa "$KEEP"/smol-ab > "$A/$MODEL/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$KEEP/humaneval.jsonl" ] && cp "$KEEP/humaneval.jsonl" "$A/humaneval/"
  [ -f "$KEEP/gsm8k-100.jsonl" ] && cp "$KEEP/gsm8k-100.jsonl" "$A/gsm8k-100/"
  python3 -c "import mlx.core as mx; print(mx.default_device())"
  # The recipe (docs/train-head.md): 100 sampled rows of the job with greedy + 8 sampled continuations
  # each, up to 3000 stdlib functions (signature + docstring) and 2000 stdlib docstrings asked about
  # in words (the stdlib has ~2300 of each), each greedy + 1 sampled, all generated together 256 rows
  # at a time and cut 170 s after the first continuation finished (on a fresh host that first one
  # waits ~170 s for kernel builds; session 5's run: 3.7k tok/s at 128 rows, 560k tokens in 150 s); 200k
  # tokens of stdlib source; depths 1-3 unrolled, KL to the trunk over the 8192-token drafting vocabulary;
  # GSM8K held out as the second dataset. Batches of 32 x 448, each step in bfloat16 over float32 weights
  # (--train-dtype auto; session 5's float32 step: 0.066 s); --fit-steps times steps 25-125 and fits the
  # cosine schedule (at most 12000 steps) to end before 365 s from the start, where training stops
  # anyway (evaluated and written either way); the whole command is cut at TOTAL (400 s, inside a 7-minute
  # device call).
  time timeout "${TOTAL:-400}" python3 -m pipelines.cli train-head $MODEL --data jobs/eval.yaml --sample "${SAMPLE:-100}" \
    --samples-per-prompt "${SPP:-8}" --max-new-tokens "${NEW:-192}" --prompts "stdlib-code:${CODE:-3000}" \
    --prompts "stdlib-chat:${CHAT:-2000}" --gen-batch "${GEN_BATCH:-256}" --data-seconds "${DATA_SECONDS:-170}" \
    --text stdlib --text-tokens "${TEXT_TOKENS:-200000}" --heldout-data jobs/gsm8k.yaml --heldout-rows 32 \
    --steps "${STEPS:-12000}" --fit-steps --batch-size "${BATCH:-32}" --seq-len "${SEQ:-448}" --draft-depths 3 --hidden-weight 0.1 \
    --eval-every "${EVAL_EVERY:-500}" --checkpoint-every 500 --max-seconds "${MAX_SECONDS:-365}" --out "$HEAD" --restart 2>&1 \
    | grep --line-buffered -v "^\s*$" | while IFS= read -r line; do echo "$(date +%T) $line"; done | tee "$OUT/train.log"
  cp "$HEAD"/mtp_head.json "$HEAD"/mtp_head.safetensors "$HEAD"/mtp_draft_vocab.npy "$OUT"/ 2>/dev/null
  ls -la "$OUT" | tee -a "$OUT/train.log"
  ;;
bench)
  heldout "$HEAD"
  R="benchmarks.real_models --model $MODEL --head $HEAD --tokens 128 --ngram-depths 4 --batch-methods none,ngram,mtp"
  timeout 260 python3 -m $R --prompts /tmp/humaneval-heldout.jsonl --rows 32 --widths 8,32 --depths 2,3,4 --out /tmp/b/he 2>&1 | tee "$OUT/bench.log"
  cp /tmp/b/he/real_models.md "$OUT/humaneval.md"; cp /tmp/b/he/real_models.json "$OUT/humaneval.json"
  timeout 150 python3 -m $R --prompts /tmp/gsm8k.jsonl --rows 32 --widths 32 --depths 3 --out /tmp/b/gsm 2>&1 | tee -a "$OUT/bench.log"
  cp /tmp/b/gsm/real_models.md "$OUT/gsm8k.md"; cp /tmp/b/gsm/real_models.json "$OUT/gsm8k.json"
  timeout 90 python3 -m benchmarks.phase_profile jobs/eval-mtp.yaml --set input.limit=8 --set schedule.max_batch=1 \
    --set speculative.mtp_head="$HEAD" --out /tmp/b/prof 2>&1 | tail -30 | tee -a "$OUT/bench.log"
  cat /tmp/b/prof/*.md > "$OUT/profile.md" 2>/dev/null
  ;;
round)  # issue 18 (h5r): what an MTP round costs with the shipped head, one process, ~4 min on a warm host.
  # Widths 1, 32, 8, each on held-out HumanEval rows then GSM8K: ours plain, MTP depth 3 (pipelined, the
  # head's commit + next drafts in one program), MTP depth 3 and 5 + mtp_lookup 2, mlx-lm generate_step /
  # batch_generate; after the first (width 1, HumanEval) the per-phase split of an MTP round. Sizes are
  # env vars (CPU dry runs; DEPTHS=3,3s,3l2,a adds synchronous rounds and adaptive depth).
  # ROWS 4,2x: width 1 runs 4 rows; widths 8 and 32 run one wave (rows = width) and a refilled stream (2 x width
  # rows, as a job with more rows than width runs): both, not the flattering one (round_cost --rows).
  SHIPPED=heads/smollm2-135m-instruct; TOKENS=${TOKENS:-96}; ROWS=${ROWS:-4,2x}; WIDTHS=${WIDTHS:-1,32,8}
  heldout $SHIPPED
  timeout 45 python3 -c "from mtplx import rows_attention as r; from benchmarks.decode_anatomy import rows_attention_check as c
c() if r.cuda_ready() else print('rows_attention check: not on CUDA')" 2>&1 | tee "$OUT/round-cost.log"
  timeout ${LIMIT:-250} python3 -m benchmarks.round_cost --model $MODEL --head $SHIPPED \
    --prompts /tmp/humaneval-heldout.jsonl,/tmp/gsm8k.jsonl --widths $WIDTHS --rows $ROWS --tokens $TOKENS \
    --depths ${DEPTHS:-3,3l2,5l2} --peer --phases 2>&1 | tee -a "$OUT/round-cost.log"
  ;;
depth)  # issue 18 (h7a): adaptive depth (every depth's programs built at a shape's first round, rounds that built
  # one never priced) against fixed depth 3 and plain: widths 1 (4 rows) and 32 (one wave of 32, a refilled stream
  # of 64), held-out HumanEval then GSM8K, 96 tokens a row, no peer, no phases (~2 min warm). Columns to read:
  # x plain tok/s (full), ms/round, mean depth, new programs (built inside the measured run: 0 wanted), warm-up s.
  SHIPPED=heads/smollm2-135m-instruct
  heldout $SHIPPED
  timeout ${LIMIT:-170} python3 -m benchmarks.round_cost --model $MODEL --head $SHIPPED \
    --prompts /tmp/humaneval-heldout.jsonl,/tmp/gsm8k.jsonl --widths ${WIDTHS:-1,32} --rows ${ROWS:-4,2x} \
    --tokens ${TOKENS:-96} --depths ${DEPTHS:-3,a} 2>&1 | tee "$OUT/depth.log"
  ;;
attn)  # issue 18 (h6a): rows_attention as chunks of queries a block (each key read once for a KV head's G x L
  # queries), ~4 min warm: its checks and timing (benchmarks/attn_check: same bits whatever the chunk / query count,
  # MLX's bits on exact keys, us a call vs a block per query / the masked fallback / MLX), then width-32 MTP depth 3
  # vs plain with it, one wave (32 rows: the last rounds run part-empty) and a refilled stream (64 held-out rows, as a
  # job runs), the phase split of the 32-row MTP round (verify vs the head's propose / advance), then the same
  # stream with the query limit at 3 (a 4-query verify on the masked fallback) to compare.
  heldout heads/smollm2-135m-instruct
  echo "== attn_check $(date +%T)" | tee -a "$OUT/attn.log"
  timeout ${CHECK_LIMIT:-90} python3 -m benchmarks.attn_check 2>&1 | tee -a "$OUT/attn.log"
  for q in 8 3; do
    rows=${ROWS:-32,64}; phases=--phases; [ $q = 3 ] && rows=${ROWS3:-64} && phases=
    echo "== rows_attention query limit $q, rows $rows $(date +%T)" | tee -a "$OUT/attn.log"
    timeout ${LIMIT:-120} python3 -m benchmarks.round_cost --model $MODEL --head heads/smollm2-135m-instruct \
      --prompts /tmp/humaneval-heldout.jsonl --widths ${WIDTHS:-32} --rows $rows --tokens ${TOKENS:-96} \
      --depths 3 --attention-queries $q $phases 2>&1 | tee -a "$OUT/attn.log"
  done
  ;;
jobs)  # issue 18 (h7c): is the eval-mtp job the fastest way to run its rows? One process, the model loaded once:
  # each setting through the whole pipeline on the job's rows (ROWS, the job's width 8, stop strings dropped; its own
  # engine, a warm-up run, a timed run), most telling first: the job as shipped (mtp depth 3 + lookup 2), plain, ngram
  # adaptive (= jobs/eval.yaml on these rows), the head without the prompt-lookup fallback (mtp_lookup 0), the shipped
  # job with the drained tail narrowing as on a CPU (engine.TAIL_KEEPS_WIDTH=1: the programs it compiles and what that
  # costs), mtp at depth 2, ngram at eval-mtp's fixed depth; no setting starts past LIMIT - PEER_S s, so batch_generate on the same
  # rendered rows (a fresh copy of the model) always runs last. Every phase prints as it ends with its seconds (load, rows, each setting's setup / warm-up /
  # timed run with the programs compiled and their first calls' seconds, the peer's warm-up / timed run), and the
  # table files are rewritten after each setting, so a run cut at LIMIT still says where the time went.
  mkdir -p "$OUT/jobs"
  echo "== eval-mtp settings, ${ROWS:-64} rows $(date +%T)" | tee -a "$OUT/jobs.log"
  L=${LIMIT:-200}
  timeout $L python3 -m benchmarks.jobs_vs_peer jobs/eval-mtp.yaml --set input.limit=${ROWS:-64} --set output.keep_columns=[] \
    ${JOBS_SET:-} --budget $((L - ${PEER_S:-60})) --variant "speculative.method=mtp" --variant "speculative.method=none" \
    --variant "speculative.method=ngram speculative.adaptive_depth=true" --variant "speculative.method=mtp speculative.mtp_lookup=0" \
    --variant "speculative.method=mtp engine.TAIL_KEEPS_WIDTH=1" --variant "speculative.method=mtp speculative.depth=2" \
    --variant "speculative.method=ngram" \
    --out "$OUT/jobs" 2>&1 | tee -a "$OUT/jobs.log"
  echo "== exit ${PIPESTATUS[0]} $(date +%T)" | tee -a "$OUT/jobs.log"
  cat "$OUT"/jobs/*.md 2>/dev/null | tee -a "$OUT/jobs.log"
  ;;
cli)  # issue 18 (h7c): the example jobs as a user runs them, one fresh process each (imports, load, compiled programs,
  # attention plans and all; kernels MLX built before are on disk): `mtplx-batch run` on ROWS rows with their stop
  # strings; RUNS lists JOB[:METHOD] (default: eval-mtp as shipped, eval.yaml as shipped (ngram adaptive, the same
  # rows), eval-mtp with method none); prints the wall ms, the --log-json startup phases and the summary (~40 s warm).
  mkdir -p /tmp/b
  for r in ${RUNS:-jobs/eval-mtp.yaml jobs/eval.yaml jobs/eval-mtp.yaml:none}; do
    job=${r%%:*}; m=${r#*:}; set_m=(); [ "$m" != "$r" ] && set_m=(--set speculative.method=$m)
    tag=$(basename "$job" .yaml)${set_m:+-$m}
    t0=$(date +%s%N)
    timeout ${LIMIT:-60} python3 -m pipelines.cli run "$job" --set input.limit=${ROWS:-64} "${set_m[@]}" \
      --set output.dir=/tmp/b/cli-$tag --restart --log-json 2>&1 \
      | grep --line-buffered -E '"event": "(startup|summary)"' > /tmp/b/cli-$tag.log
    rc=${PIPESTATUS[0]}
    echo "== cli $tag rows=${ROWS:-64}: exit $rc, wall $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a "$OUT/cli.log"
    cut -c1-400 /tmp/b/cli-$tag.log | tee -a "$OUT/cli.log"
  done
  ;;
fresh)  # issue 18 (h7c): what a fresh process pays, and the part padded prefill queries take off: for each ATTRS entry
  # (default: prefill queries unpadded, then padded as shipped on a GPU) one fresh process runs the shipped eval-mtp
  # job (ROWS rows) twice through jobs_vs_peer, no peer: its warm-up run (all first-time costs of a process) and a
  # timed run (warm) print with their seconds; their difference is the per-process cost (~20 s each warm).
  for a in ${ATTRS:-mtplx.prefill.PAD_QUERIES=false mtplx.prefill.PAD_QUERIES=true}; do
    echo "== fresh process, $a, ${ROWS:-64} rows $(date +%T)" | tee -a "$OUT/fresh.log"
    timeout ${LIMIT:-60} python3 -m benchmarks.jobs_vs_peer jobs/eval-mtp.yaml --set input.limit=${ROWS:-64} \
      --set output.keep_columns=[] ${JOBS_SET:-} --attr "$a" --no-peer --out /tmp/b/fresh 2>&1 | grep -v "^|" | tee -a "$OUT/fresh.log"
  done
  ;;
kcache)  # issue 18 (h8d): our custom CUDA kernels (rows_attention, layer_kernels, ...) are compiled by MLX's NVRTC in
  # every fresh process: MLX reads its PTX cache for them but never writes them there. mtplx/kernel_cache.py builds each
  # instantiation once and writes the entry MLX reads. Fresh processes on the shipped eval-mtp job (ROWS rows, warm-up
  # run = every first-time cost of a process, then a timed run), each over its own copy of MLX's cache (MLX_PTX_CACHE_DIR,
  # MLX's own variable) without custom-kernel entries: "before" = kernel_cache off (what every process paid), "first" =
  # on (this process builds them), "warm" = on again (a later process finds them); then method none before / warm; then
  # the source check (MLX's generated source = ours, entries present) in the warm copy, and the engine setup profiled.
  mkdir -p /tmp/b
  P=$(python3 -c "from mtplx import kernel_cache as k; print(k.ptx_dir())")
  for d in /tmp/ptx-before /tmp/ptx-after; do
    rm -rf $d; mkdir -p $d; [ -d "$P" ] && cp -r "$P"/. $d/
    find $d -maxdepth 1 -name 'custom_kernel_*' -exec rm -rf {} +
  done
  echo "== MLX's cache $P: $(ls "$P" 2>/dev/null | wc -l) entries, $(ls "$P" 2>/dev/null | grep -c '^custom_kernel_') custom" | tee -a "$OUT/kcache.log"
  run1() {  # TAG PTX_DIR ENABLED [--set ...]
    local tag=$1 dir=$2 en=$3; shift 3
    echo "== fresh process: $tag (MLX_PTX_CACHE_DIR=$dir, kernel_cache.ENABLED=$en) $* $(date +%T)" | tee -a "$OUT/kcache.log"
    MLX_PTX_CACHE_DIR=$dir timeout ${LIMIT:-60} python3 -m benchmarks.jobs_vs_peer jobs/eval-mtp.yaml --set input.limit=${ROWS:-64} \
      --set output.keep_columns=[] "$@" --attr mtplx.kernel_cache.ENABLED=$en --no-peer --out /tmp/b/kc 2>&1 | grep -v "^|" | tee -a "$OUT/kcache.log"
  }
  run1 mtp-before /tmp/ptx-before false
  run1 mtp-first /tmp/ptx-after true
  run1 mtp-warm /tmp/ptx-after true
  run1 none-before /tmp/ptx-before false --set speculative.method=none
  run1 none-warm /tmp/ptx-after true --set speculative.method=none
  echo "== source check $(date +%T)" | tee -a "$OUT/kcache.log"
  MLX_PTX_CACHE_DIR=/tmp/ptx-after timeout 60 python3 -m benchmarks.kernel_cache_check --attr mtplx.kernel_cache.ENABLED=true 2>&1 | tee -a "$OUT/kcache.log"
  echo "== entries written: $(ls /tmp/ptx-after | grep -c '^custom_kernel_') $(date +%T)" | tee -a "$OUT/kcache.log"
  echo "== engine setup, profiled (fresh process, mtp then none) $(date +%T)" | tee -a "$OUT/kcache.log"
  for m in mtp none; do
    MLX_PTX_CACHE_DIR=/tmp/ptx-after timeout 40 python3 -m benchmarks.setup_profile jobs/eval-mtp.yaml --set speculative.method=$m --top 22 2>&1 | tee -a "$OUT/kcache.log"
  done
  ;;
clirep)  # issue 18 (h8d): the example jobs as a user runs them (`mtplx-batch run`, a fresh process each, ROWS rows, stop
  # strings on), every setting once per repeat, REPEATS repeats interleaved: wall s and the summary's s, medians, and whether
  # each setting wrote the same text as the first (greedy: every method must). SPECS: tag|job|overrides|kernel cache|MLX's
  # cache dir (empty: MLX's own): eval-mtp as shipped, eval-mtp with mtp_lookup 0, jobs/eval.yaml, eval-mtp with method none
  # (kernel cache on, MLX's cache in /tmp/ptx-after, made by `kcache`), eval-mtp with the kernel cache off over /tmp/ptx-before
  # (as before). WARM=1: each setting once untimed first (WARM_ROWS rows, 8). A sixth field: MODULE.NAME=V,... set by fresh_cli --attr.
  mkdir -p /tmp/b /tmp/ptx-before /tmp/ptx-after
  SPECS=${SPECS:-"eval-mtp|jobs/eval-mtp.yaml||true|/tmp/ptx-after eval-mtp-l0|jobs/eval-mtp.yaml|speculative.mtp_lookup=0|true|/tmp/ptx-after eval|jobs/eval.yaml||true|/tmp/ptx-after none|jobs/eval-mtp.yaml|speculative.method=none|true|/tmp/ptx-after eval-mtp-before|jobs/eval-mtp.yaml||false|/tmp/ptx-before"}
  if [ -n "${WARM:-}" ]; then  # one untimed run of each setting first (8 rows): kernels any of them builds are on disk before rep 1
    for spec in $SPECS; do
      IFS='|' read -r tag job sets en dir attrs <<< "$spec"
      extra=(); for kv in ${sets//,/ }; do extra+=(--set "$kv"); done
      at=(); for kv in ${attrs//,/ }; do at+=(--attr "$kv"); done
      env ${dir:+MLX_PTX_CACHE_DIR=$dir} timeout ${LIMIT:-60} python3 -m benchmarks.fresh_cli --attr mtplx.kernel_cache.ENABLED=$en "${at[@]}" -- run "$job" \
        --set input.limit=${WARM_ROWS:-8} "${extra[@]}" --set output.dir=/tmp/b/warm-$tag --restart --quiet > /dev/null 2>&1
      echo "== warm-up $tag: exit $?" | tee -a "$OUT/clirep.log"
    done
  fi
  for rep in $(seq ${REPEATS:-3}); do
    for spec in $SPECS; do
      IFS='|' read -r tag job sets en dir attrs <<< "$spec"
      extra=(); for kv in ${sets//,/ }; do extra+=(--set "$kv"); done
      at=(); for kv in ${attrs//,/ }; do at+=(--attr "$kv"); done
      t0=$(date +%s%N)
      env ${dir:+MLX_PTX_CACHE_DIR=$dir} timeout ${LIMIT:-60} python3 -m benchmarks.fresh_cli --attr mtplx.kernel_cache.ENABLED=$en "${at[@]}" -- run "$job" \
        --set input.limit=${ROWS:-64} "${extra[@]}" --set output.dir=/tmp/b/rep-$tag-$rep --restart --log-json 2>&1 \
        | grep --line-buffered -E '"event": "(startup|summary)"' > /tmp/b/rep-$tag-$rep.log
      rc=${PIPESTATUS[0]}
      echo "== rep $rep $tag: exit $rc, wall $(( ($(date +%s%N) - t0) / 1000000 )) ms $(grep -o '"seconds": [0-9.]*' /tmp/b/rep-$tag-$rep.log)" | tee -a "$OUT/clirep.log"
    done
    # the table so far after every repeat (a run cut off by a hard limit still leaves the last one)
    python3 -m benchmarks.clirep_table "$SPECS" "$rep" "$OUT/clirep.log" | tee "$OUT/clirep-table.md"
  done
  ;;
stream)  # issue 18 (h7b): width-32 refilled streams, plain vs MTP depth 3 (+ lookup 2), on held-out HumanEval rows cycled
  # to 2x and 4x the width (64 / 128 rows, greedy, 96 tokens), ~2.5 min warm: the whole-run ratio, and where MTP's time
  # goes besides its rounds (admissions, drains = calls that returned with the pipeline read empty, prefill s, tail s =
  # the part-empty rounds after the last admission). DEPTHS takes round_cost's suffixes (3d: each admission empties the
  # pipeline first, the path before; 3n: the drained tail narrows to 1 row; @NAME=VALUE: an engine attribute, e.g.
  # 3@refill_at=32, or a module's switch for that setting, e.g. 3@mtplx.qmm_rows.ONE_MATRIX=1). REPEATS > 1:
  # interleaved (all settings warmed, then REPEATS rounds of one run each, the order rotated; medians, x plain paired with plain's run of the same round, spread). Sizes are env vars (CPU dry runs).
  SHIPPED=heads/smollm2-135m-instruct
  heldout $SHIPPED
  timeout ${LIMIT:-170} python3 -m benchmarks.round_cost --model $MODEL --head $SHIPPED --prompts /tmp/humaneval-heldout.jsonl \
    --widths ${WIDTHS:-32} --rows ${ROWS:-2x,4x} --cycle --tokens ${TOKENS:-96} --depths ${DEPTHS:-3,3l2} \
    --repeats ${REPEATS:-1} 2>&1 | tee "$OUT/stream.log"
  ;;
lookup)  # issue 18 (h22a): mtp, mtp + prompt-lookup fallback, ngram, plain vs mlx-lm; 1 stream and width 32;
  # held-out HumanEval rows and GSM8K in one process (~2.5 min warm). Sizes are env vars (CPU dry runs).
  SHIPPED=heads/smollm2-135m-instruct
  heldout $SHIPPED
  timeout ${LIMIT:-200} python3 -m benchmarks.real_models --model $MODEL --head $SHIPPED --tokens ${TOKENS:-128} \
    --prompts /tmp/humaneval-heldout.jsonl,/tmp/gsm8k.jsonl --rows ${ROWS:-16} --widths ${WIDTHS:-32} --depths 3 \
    --ngram-depths 3 --mtp-lookup ${LOOKUP:-2,3} --batch-methods none,ngram,mtp,mtp+lookup --out /tmp/b/lookup 2>&1 \
    | tee "$OUT/lookup.log"
  for d in /tmp/b/lookup/*/; do cp "$d/real_models.md" "$OUT/lookup-$(basename $d).md"; done
  ;;
*)
  sed -n 2,19p "$0"; exit 2
  ;;
esac
