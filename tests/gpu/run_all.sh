#!/usr/bin/env bash
# Every GPU suite of the project in one run on a 4-GPU machine (2 GPUs: the lanes run one after
# the other and the 4-rank suites share GPUs under MPS): build once, then each suite under its
# own time limit and a whole-run deadline, so a hang costs only its own slot. Logs are tarred
# into $OUT/logs.tar.gz, benchmark JSON lands in $OUT, a summary table is printed last.
#   bash tests/gpu/run_all.sh   (megatron-core wheels for Python 3.12 in .whl/, optional)
# Phase 1, two lanes at once: EP2 intranode, sync-free, binding checks, the Megatron layer, the
#   dispatcher modes, EP overlap, teardown and timeout poisoning on GPUs 0,1; 2x1 internode, FIFO
#   and the failure scenarios (2 ranks: sharing a GPU under MPS, and one GPU each) on GPUs 2,3.
# Phase 2, all GPUs: EP4 intranode and sync-free, 2x2 internode, grouped experts.
# Phase 3, benchmarks: bench proxy (CPU only), bench nvlink (the link floor, seconds), bench
#   internode (2x2, NIC model at 50 GB/s) and bench layer at EP4 (last; on 4 GPUs it needs a
#   call of its own: PHASES=3).
# Env: SKIP (suite names to leave out), PHASES (default "1 2 3"), DEADLINE_S (default 560).
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=64
LOGS=/tmp/logs
DEADLINE=$((SECONDS + ${DEADLINE_S:-560}))
mkdir -p "$LOGS"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
phase() { [[ " ${PHASES:-1 2 3} " == *" $1 "* ]]; }
echo "GPUs: $NGPU"
nvidia-smi topo -m > "$LOGS/topo.log" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$LOGS/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
build_sm90
cd /tmp || exit 1 # import the installed package, not the source tree
PYTEST=(python3 -X faulthandler -m pytest -q -p no:cacheprovider --import-mode=importlib
  -o addopts="" -o faulthandler_timeout=100 -rA --tb=short --durations=5)

# suite NAME GPUS LIMIT CMD...: runs CMD on GPUS (log $LOGS/NAME.log) bounded by LIMIT and the
# deadline; one summary line in $LOGS/summary_NAME.txt.
suite() {
  local name=$1 gpus=$2 limit=$3
  shift 3
  if skip "$name"; then echo "$name skipped" > "$LOGS/summary_$name.txt"; return; fi
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then echo "$name not run (deadline)" > "$LOGS/summary_$name.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$SECONDS
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  printf '%-22s gpus=%-8s rc=%-3s %4ss  %s\n' "$name" "$gpus" "$rc" "$((SECONDS - t))" \
    "$(grep -E '[0-9]+ (passed|failed|error)' "$LOGS/$name.log" | tail -1 | cut -c1-90)" \
    > "$LOGS/summary_$name.txt"
}

if [ "$NGPU" -ge 4 ]; then A=0,1 B=2,3; else A=0,1 B=0,1; fi
ALL=$(seq -s, 0 $((NGPU - 1)))
T=$REPO/tests/gpu
lane_a() {
  UCCL_EP_TEST_RANKS=2 suite intranode_ep2 $A 170 "${PYTEST[@]}" "$T/test_intranode.py" \
    "$T/test_sync_free.py" "$T/test_bindings_checks.py"
  suite megatron_ep2 $A 150 "${PYTEST[@]}" -s "$T/test_megatron_gpu.py"
  suite others_ep2 $A 150 "${PYTEST[@]}" "$T/test_dispatcher_modes_gpu.py" \
    "$T/test_overlap_gpu.py" "$T/test_teardown.py" "$T/test_timeout_poison.py"
}
lane_b() {
  UCCL_EP_TEST_RANKS_PER_NODE=1 UCCL_EP_TEST_KERNEL_TIMEOUT_MS=15000 suite internode_2x1 $B 150 \
    "${PYTEST[@]}" "$T/test_internode.py"
  suite fifo $B 120 "${PYTEST[@]}" "$T/test_fifo_gpu.py"
  suite failures $B 300 "${PYTEST[@]}" "$T/test_failure_scenarios.py" \
    "$T/test_nccl_group_after_timeout.py" "$T/test_module_loading_gpu.py"
}
if phase 1; then
  if [ "$NGPU" -ge 4 ]; then
    lane_a & lane_b & wait
  else
    lane_a
    lane_b
  fi
fi
if phase 2; then
  UCCL_EP_TEST_RANKS=4 suite intranode_ep4 "$ALL" 150 "${PYTEST[@]}" "$T/test_intranode.py" \
    "$T/test_sync_free.py"
  UCCL_EP_TEST_RANKS_PER_NODE=$((NGPU / 2)) UCCL_EP_TEST_KERNEL_TIMEOUT_MS=15000 \
    suite "internode_2x$((NGPU / 2))" "$ALL" 150 "${PYTEST[@]}" "$T/test_internode.py"
  suite grouped_experts "$ALL" 200 "${PYTEST[@]}" -s "$T/test_grouped_experts.py"
fi
if phase 3; then  # CPU only: the proxies alone on this host's cores
  suite bench_proxy "$ALL" 60 python3 -m uccl_ep_megatron.bench.proxy --json "$OUT/proxy.json"
fi
if phase 3 && [ "$NGPU" -ge 2 ]; then  # seconds: the NVLink link floor over every GPU
  suite bench_nvlink "$ALL" 60 python3 -m uccl_ep_megatron.bench.nvlink --modes ldst,tma,ce \
    --sms 12,24,48 --fanout 1,$((NGPU - 1)) --json "$OUT/nvlink.json"
fi
if phase 3 && [ "$NGPU" -ge 4 ]; then
  suite bench_internode "$ALL" 100 python3 -m uccl_ep_megatron.bench.internode --ranks 4 \
    --ranks-per-node 2 --link-gbps 50 --latency-us 3 --threads 4 --chunk 20 --fp8 --sync-free \
    --intranode-ref --iters 8 --json "$OUT/internode-2x2.json"
  # Last: on 4 GPUs phases 1 and 2 leave it about a minute of the default deadline; a call of
  # its own (PHASES=3) gives it the time it needs.
  suite bench_layer "$ALL" 200 python3 -m uccl_ep_megatron.cli bench layer --gpus 4 \
    --dispatchers alltoall,exact,sync-free --json "$OUT/layer-ep4.json"
fi
tar -czf "$OUT/logs.tar.gz" -C /tmp logs
echo "================ summary (elapsed $SECONDS s)"
cat "$LOGS"/summary_*.txt
for f in "$LOGS"/*.log; do
  grep -HE "^(FAILED|ERROR)" "$f" 2>/dev/null | head -6 | cut -c1-240
done
for f in bench_nvlink bench_internode bench_layer bench_proxy; do
  echo "---- $f"
  grep -vE "Warning|warn|return func|^\s*$" "$LOGS/$f.log" 2>/dev/null | tail -14
done
