#!/usr/bin/env bash
# One run on a GPU machine for the intranode kernels: build for sm_90, run the GPU tests and
# the intranode benchmark, logs under $OUT, a short table last.
# Usage (on a GPU machine): bash tests/gpu/run_device.sh [extra bench args]
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
build_sm90
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
