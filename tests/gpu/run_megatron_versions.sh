#!/usr/bin/env bash
# One run on a GPU machine: per megatron-core release carried in .whl/mc-<version>/ (cp312
# wheels), `uccl-ep-megatron train` with no arguments (timed, start-up included),
# tests/gpu/test_megatron_gpu.py (DeepSeek-V3-shaped MoE layer, alltoall vs uccl_ep) and, for
# releases with megatron.training (0.17+), tests/gpu/test_pretrain_gpt_gpu.py (Megatron-LM's
# training loop, uccl_ep vs alltoall loss curves; flex+deepep drop-in vs alltoall on 2 GPUs).
#
# Prepare here (the wheels need nothing the device image lacks: torch, numpy, packaging, and
# triton for 0.18+, are there):
#   for v in 0.16.1 0.19.2; do python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_24_x86_64 -d .whl/mc-$v megatron-core==$v; done
# Then, on a GPU machine with .whl/ beside the checkout: bash tests/gpu/run_megatron_versions.sh
# Env: VERSIONS (default: every .whl/mc-* folder), SKIP (words: train layer pretrain),
#      TRAIN_LIMIT_S (default 150), OUT (results; default /tmp/out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
OUT=${OUT:-/tmp/out}
REPO=$(pwd)
SKIP=${SKIP:-}
TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-150}
mkdir -p "$OUT"
skip() { [[ " $SKIP " == *" $1 "* ]]; }

t0=$(date +%s)
timeout 200 python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
  -C cmake.define.UCCL_EP_CUDA_ARCHS=90 . > "$OUT/build.log" 2>&1
echo "build rc=$? ($(($(date +%s) - t0)) s)"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), \
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"

versions=${VERSIONS:-$(cd .whl 2>/dev/null && ls -d mc-* | sed 's/^mc-//')}
[ -n "$versions" ] || { echo "no .whl/mc-<version>/ folders: carry the wheels (see above)"; exit 1; }
status=0
for v in $versions; do
  site=/tmp/site-$v
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" ".whl/mc-$v/"*.whl > "$OUT/wheels-$v.log" 2>&1 \
    || { echo "megatron-core $v: wheel install failed"; cat "$OUT/wheels-$v.log"; status=1; continue; }
  export PYTHONPATH=$site
  echo "==== megatron-core $(cd /tmp && python3 -c 'import megatron.core as m; print(m.__version__)')"
  cd /tmp  # the installed package, not the source tree
  if ! skip train; then
    s=$(date +%s)
    cli=(python3 -m uccl_ep_megatron.cli)
    command -v uccl-ep-megatron > /dev/null && cli=(uccl-ep-megatron)
    # Literally no arguments: what the README's set-up command runs.
    timeout "$TRAIN_LIMIT_S" "${cli[@]}" train > "$OUT/train-$v.log" 2>&1
    rc=$?
    echo "train (no arguments) rc=$rc wall $(($(date +%s) - s)) s"
    grep -E "experts:|train finished|uccl_ep Buffer backend" "$OUT/train-$v.log" | tail -4
    sed -n '/uccl-ep-megatron train/,$p' "$OUT/train-$v.log" | head -12
    [ "$rc" -eq 0 ] || status=1
  fi
  tests=()
  skip layer || tests+=("$REPO/tests/gpu/test_megatron_gpu.py")
  skip pretrain || tests+=("$REPO/tests/gpu/test_pretrain_gpt_gpu.py")
  if [ "${#tests[@]}" -gt 0 ]; then
    mkdir -p "$OUT/$v"
    OUT="$OUT/$v" timeout 480 python3 -m pytest -q -s -p no:cacheprovider \
      --import-mode=importlib -o addopts="" --timeout=420 "${tests[@]}" > "$OUT/pytest-$v.log" 2>&1
    rc=$?
    echo "pytest rc=$rc"
    grep -E "passed|failed|skipped|Error|tok/s|max_abs_diff" "$OUT/pytest-$v.log" | tail -12
    [ "$rc" -eq 0 ] || status=1
  fi
  cd "$REPO"
done
exit $status
