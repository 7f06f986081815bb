#!/usr/bin/env bash
# One run on a GPU machine for the internode kernels: build for sm_90, run the GPU tests
# (2 virtual nodes over the ipc transport, injector off and on) and the internode benchmark;
# logs under $OUT, a short summary last.
# Usage (device tool): bash tests/gpu/run_internode.sh [pytest -k expression]
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
t0=$(date +%s)
# Build the committed tree when git is there (other components' sources may be mid-edit in the
# working tree); UCCL_EP_BUILD_FROM=worktree builds the working tree as it is.
SRC=.
BUILD=/tmp/b
if [ "${UCCL_EP_BUILD_FROM:-head}" = head ] && git rev-parse --verify -q HEAD > /dev/null 2>&1; then
  SRC=/tmp/uccl_ep_src
  BUILD=/tmp/b_head  # a CMake cache belongs to one source directory
  rm -rf "$SRC" && mkdir -p "$SRC" && git archive HEAD | tar -x -C "$SRC"
  echo "building commit $(git rev-parse --short HEAD)"
fi
python3 -m pip install --no-build-isolation --no-deps -q -C build-dir="$BUILD" \
  -C cmake.define.UCCL_EP_CUDA_ARCHS=90 -C "cmake.define.CMAKE_CXX_FLAGS=-include cstdint" "$SRC" > "$OUT/build.log" 2>&1
build_rc=$?
t1=$(date +%s)
echo "build rc=$build_rc ($((t1 - t0)) s)"
if [ $build_rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
cd /tmp  # import the installed package, not the source tree
K=${1:-}
timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts="" \
  -x "$REPO/tests/gpu/test_internode.py" ${K:+-k "$K"} > "$OUT/pytest.log" 2>&1
test_rc=$?
t2=$(date +%s)
timeout ${BENCH_TIMEOUT:-60} python3 -m uccl_ep_megatron.bench.internode --iters ${BENCH_ITERS:-5} \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
bench_rc=$?
timeout ${BENCH_TIMEOUT:-60} python3 -m uccl_ep_megatron.bench.internode --iters ${BENCH_ITERS:-5} \
  --threads 4 --reorder --json "$OUT/bench_reorder.json" > "$OUT/bench_reorder.log" 2>&1
t3=$(date +%s)
echo "---- pytest (rc=$test_rc, $((t2 - t1)) s) ----"
grep -E "passed|failed|Error|error|assert|mismatch|Timeout" "$OUT/pytest.log" | head -30
tail -3 "$OUT/pytest.log"
echo "---- bench (rc=$bench_rc, $((t3 - t2)) s) ----"
tail -10 "$OUT/bench.log"
echo "---- bench, injector on ----"
tail -3 "$OUT/bench_reorder.log"
