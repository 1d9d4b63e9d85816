#!/usr/bin/env bash
# Packs what an H200 call needs into ignored folders of < 60 MiB each (../shared/GPU.md): the half of the
# kit that runs here, on a machine with PyPI; `gpu_session.sh setup` is the half that runs there.
#
#   bash benchmarks/gpu_pack.sh          # .gpu-a .. .gpu-d from PyPI and `mtplx-batch fetch` (~20 s)
#
# Then one device call a folder, back to back (the host keeps files ~30 s after a call):
#   carry .gpu-a: mkdir -p ~/keep && cp .gpu-a/* ~/keep/      (mlx, mlx-lm, the CUDA wheel's first part)
#   carry .gpu-b: cp .gpu-b/* ~/keep/                         (its second part, gguf, the datasets)
#   carry .gpu-c: cp .gpu-c/* ~/keep/                         (the SmolLM2 GGUF's first part)
#   carry .gpu-d (+ .gpu-k): bash benchmarks/gpu_session.sh setup && ...   (its second part; measure here)
# .gpu-k/ptx.tgz, when an earlier call of the session brought back MLX's kernel cache
# (`tar czf $OUT/ptx.tgz -C /tmp mlx`), spares a fresh host minutes of kernel builds.
# The Qwen2.5-Coder draft pair has a script of its own: benchmarks/prepare_draft_pair.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu-\*/' .git/info/exclude 2>/dev/null || printf '/.gpu-*/\n' >> .git/info/exclude
rm -rf .gpu-a .gpu-b .gpu-c .gpu-d && mkdir -p .gpu-a .gpu-b .gpu-c .gpu-d

wheel() {  # the host's Python (3.12, manylinux x86_64), no dependencies: the host has the rest
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 -d "$1" "${@:2}"
}
wheel .gpu-a mlx==0.32.4 mlx-lm==0.32.2 mlx-cuda-13==0.32.4
split -b 45m .gpu-a/mlx_cuda_13-*.whl .gpu-a/cuda- && rm .gpu-a/mlx_cuda_13-*.whl && mv .gpu-a/cuda-ab .gpu-b/
test ! -e .gpu-a/cuda-ac  # setup joins two parts
python3 -m pip download -q --no-deps -d .gpu-b "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"

CACHE=${MTPLX_CACHE:-$HOME/.cache/mtplx}/assets
for name in smollm2-135m-instruct humaneval gsm8k-100 mmlu-1k; do
  mtplx-batch fetch "$name" > /dev/null
done
for d in humaneval gsm8k-100 mmlu-1k; do cp "$CACHE/$d/$d.jsonl" .gpu-b/; done
split -b 49m "$CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf" /tmp/smol-
mv /tmp/smol-aa .gpu-c/ && mv /tmp/smol-ab .gpu-d/
test ! -e /tmp/smol-ac
du -sh .gpu-a .gpu-b .gpu-c .gpu-d
