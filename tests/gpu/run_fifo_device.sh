#!/usr/bin/env bash
# One run on a GPU machine for the FIFO and proxy: build for sm_90, run the GPU FIFO tests and
# `uccl-ep-megatron bench fifo`, logs under $OUT, a short table last.
# Usage (on a GPU machine): bash tests/gpu/run_fifo_device.sh
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
{ nvidia-smi --query-gpu=name,pci.bus_id --format=csv; nvidia-smi topo -m; lscpu | head -20; } > "$OUT/machine.txt" 2>&1
build_sm90
cd /tmp || exit 1  # import the installed package, not the source tree
timeout 240 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts="" -rs \
  "$REPO/tests/gpu/test_fifo_gpu.py" > "$OUT/pytest.log" 2>&1
test_rc=$?
t2=$(date +%s)
timeout 120 python3 -m uccl_ep_megatron.bench.fifo --json "$OUT/bench_fifo.json" > "$OUT/bench_fifo.log" 2>&1
bench_rc=$?
t3=$(date +%s)
echo "---- pytest (rc=$test_rc, $((t2 - t1)) s) ----"
grep -E "passed|failed|FAILED|Error|assert" "$OUT/pytest.log" | tail -25
echo "---- bench fifo (rc=$bench_rc, $((t3 - t2)) s) ----"
tail -15 "$OUT/bench_fifo.log"
