#!/usr/bin/env bash
# The Qwen2.5-Coder 1.5B target + 0.5B draft for the H200, as 4-bit MLX models (what users run there,
# and 1.3 GB instead of the GGUFs' 1.6 GB to carry), split into device-call parts (../shared/GPU.md).
#   bash benchmarks/prepare_draft_pair.sh [WORK_DIR]   # then one call per .gpu-qNN: cp .gpu-qNN/* ~/keep/
# On the host: mkdir -p /tmp/qwen && cat ~/keep/qp-?? | tar xf - -C /tmp/qwen, and
#   python3 -m benchmarks.real_models --model /tmp/qwen/q15-4bit --draft /tmp/qwen/q05-4bit --prompts humaneval \
#     --rows 8 --tokens 128 --widths 8 --depths 2,4 --ngram-depths '' --batch-methods none,draft
set -euo pipefail
W=${1:-/tmp/qwen-pair}; mkdir -p "$W"; cd "$W"
for size in 0.5b 1.5b; do
  gguf=$(mtplx-batch fetch "qwen2.5-coder-$size-instruct" | tail -1)
  name=q${size/./}; name=${name%b}
  mtplx-batch convert "$gguf" "$name-f16" --dtype float16       # K-quants -> float16 MLX
  python -m mlx_lm convert --hf-path "$name-f16" --mlx-path "$name-4bit" -q --q-bits 4 --q-group-size 64
  rm -rf "$name-f16" "$name-4bit/README.md"
done
tar cf qwen-pair.tar q15-4bit q05-4bit && split -b 53m -d -a 2 qwen-pair.tar qp-
repo=$(git -C "$OLDPWD" rev-parse --show-toplevel)
grep -qx '/.gpu-\*/' "$repo/.git/info/exclude" || echo '/.gpu-*/' >> "$repo/.git/info/exclude"
for f in qp-*; do mkdir -p "$repo/.gpu-q${f#qp-}" && mv "$f" "$repo/.gpu-q${f#qp-}/"; done
ls -d "$repo"/.gpu-q* | wc -l
