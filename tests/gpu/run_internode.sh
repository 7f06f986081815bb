#!/usr/bin/env bash
# One device call for the internode path over the ipc NIC model: build for sm_90, then the steps
# named in STEPS (default: all), each under its own time limit; logs and JSON under $OUT, a
# summary table last (logs are tarred into one file).
#   copy     bench internode --copy-only: the NIC model alone (unthrottled and at 50 GB/s)
#   bench    bench internode on 2x2 (4 GPUs) and 2x1: line rates, proxy threads, chunk sizes
#   tests    tests/gpu/test_internode.py on 2x1 and 2x2, and on 2x2 with copy delivery (PYTEST_K
#            selects cases)
# Env: STEPS, PYTEST_K, BENCH_ARGS (extra flags for the 2x2 bench), DEADLINE_S (default 540).
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
DEADLINE=$((SECONDS + ${DEADLINE_S:-540}))
STEPS=${STEPS:-copy bench tests}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $NGPU; commit $(git rev-parse --short HEAD 2>/dev/null)"
build_sm90
cd /tmp || exit 1  # import the installed package, not the source tree
LOGS=/tmp/logs
mkdir -p "$LOGS"
SUMMARY=()

# step NAME LIMIT CMD...: runs CMD with its output in $OUT/NAME.log, bounded by LIMIT and by
# the call's deadline.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then SUMMARY+=("$name: not run (deadline)"); return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$SECONDS
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t))" \
    "$(grep -E '[0-9]+ (passed|failed)' "$LOGS/$name.log" | tail -1 | cut -c1-80)")")
  echo "==== $name (rc=$rc) ===="
  grep -v -E '^\s*$|Warning|warn\(' "$LOGS/$name.log" | tail -n "${TAIL:-25}"
}

BENCH=(python3 -m uccl_ep_megatron.bench.internode)
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has copy && [ "$NGPU" -ge 4 ]; then
  step copy_2x2 90 "${BENCH[@]}" --ranks 4 --ranks-per-node 2 --copy-only 65536,262144,1048576 \
    --link-gbps 0,50 --json "$OUT/copy-2x2.json"
fi
if has bench && [ "$NGPU" -ge 4 ]; then
  # shellcheck disable=SC2086
  step bench_2x2 240 "${BENCH[@]}" --ranks 4 --ranks-per-node 2 --iters 8 --fp8 --intranode-ref \
    ${BENCH_ARGS:---link-gbps 0,50 --threads 2,4 --chunk 20,40} --json "$OUT/internode-2x2.json"
fi
if has bench; then
  # shellcheck disable=SC2086
  step bench_2x1 120 "${BENCH[@]}" --ranks 2 --ranks-per-node 1 --num-gpus 2 --iters 8 --fp8 \
    ${BENCH_ARGS_2X1:---link-gbps 50 --threads 4 --chunk 20,40} --json "$OUT/internode-2x1.json"
fi
if has tests; then
  PYTEST=(python3 -X faulthandler -m pytest -q -p no:cacheprovider --import-mode=importlib
    -o addopts="" -o faulthandler_timeout=120 -rA --tb=short "$REPO/tests/gpu/test_internode.py"
    ${PYTEST_K:+-k "$PYTEST_K"})
  UCCL_EP_TEST_RANKS_PER_NODE=2 step tests_2x2 240 "${PYTEST[@]}"
  UCCL_EP_TEST_RANKS_PER_NODE=1 step tests_2x1 200 "${PYTEST[@]}"
  # The NIC model's copy delivery (the default is store): the same suite on 2x2.
  UCCL_EP_TEST_IPC_DELIVERY=copy UCCL_EP_TEST_RANKS_PER_NODE=2 step tests_2x2_copy 240 "${PYTEST[@]}"
fi
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
echo "==== summary ===="
printf '%s\n' "${SUMMARY[@]}"
