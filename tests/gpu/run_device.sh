#!/usr/bin/env bash
# One device call for the intranode kernels (issue 4): build for sm_90, run the GPU tests and
# the intranode benchmark, logs under $OUT, a short table last.
# Usage (device tool): bash tests/gpu/run_device.sh [extra bench args]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CMAKE_BUILD_PARALLEL_LEVEL=32
OUT=${OUT:-/tmp/out}
REPO=$(pwd)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
  -C cmake.define.UCCL_EP_CUDA_ARCHS=90 . > "$OUT/build.log" 2>&1
build_rc=$?
t1=$(date +%s)
echo "build rc=$build_rc ($((t1 - t0)) s)"
if [ $build_rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
cd /tmp  # import the installed package, not the source tree
python3 -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts="" --timeout=300 \
  "$REPO/tests/gpu/test_intranode.py" -x ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
test_rc=$?
t2=$(date +%s)
python3 -m uccl_ep_megatron.bench.intranode --json "$OUT/bench.json" "$@" > "$OUT/bench.log" 2>&1
bench_rc=$?
t3=$(date +%s)
echo "---- pytest (rc=$test_rc, $((t2 - t1)) s) ----"
grep -E "passed|failed|error|Error|assert|mismatch" "$OUT/pytest.log" | tail -25
echo "---- bench (rc=$bench_rc, $((t3 - t2)) s) ----"
tail -15 "$OUT/bench.log"
