#!/usr/bin/env bash
# One device call for issue 14's dispatcher work: the fused permute kernels and the two
# dispatcher modes (tests/gpu/test_dispatcher_modes_gpu.py), then `bench layer` (alltoall vs
# uccl_ep exact / sync-free at EP1). Needs megatron-core for Python 3.12 in .whl/ (carry it):
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600,
#       command="bash tests/gpu/run_dispatcher_modes.sh")
# Two GPUs (nvidia-h200-x2) add the (TP, EP) grid cases with 2 ranks.
# Env: BENCH_ARGS (extra `bench layer` flags) and PYTEST_ARGS, split on spaces.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CMAKE_BUILD_PARALLEL_LEVEL=16
OUT=${OUT:-/tmp/out}
REPO=$(pwd)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
export PYTHONPATH=/tmp/site
t0=$(date +%s)
timeout 300 python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
  -C cmake.define.UCCL_EP_CUDA_ARCHS=90 -C "cmake.define.CMAKE_CXX_FLAGS=-include cstdint" . \
  > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
echo "build ok ($(($(date +%s) - t0)) s)"
read -r -a pytest_args <<< "${PYTEST_ARGS:-}"
read -r -a bench_args <<< "${BENCH_ARGS:-}"
cd /tmp || exit 1  # import the installed package, not the source tree
python3 -m pytest -q -s -p no:cacheprovider --import-mode=importlib -o addopts="" --timeout=300 \
  "$REPO/tests/gpu/test_dispatcher_modes_gpu.py" "${pytest_args[@]}" > "$OUT/pytest.log" 2>&1
echo "---- pytest rc=$? ----"
grep -E "passed|failed|skipped|Error|assert|sync_calls" "$OUT/pytest.log" | tail -30
timeout 240 python3 -m uccl_ep_megatron.bench.layer --json "$OUT/bench_layer.json" "${bench_args[@]}" \
  2>&1 | tee "$OUT/bench_layer.log" | tail -8
