#!/usr/bin/env bash
# Every GPU check of the project in one device call: build once, then each suite under its own
# time limit (and a whole-call deadline), so a hang costs only its own slot. On 4+ GPUs the
# 2-GPU suites run in two lanes at once (GPUs 0,1 and 2,3), then the 4-GPU runs (EP4
# intranode, 2x2 virtual-node internode, EP4 training) follow. Logs go into $OUT/logs.tar.gz
# (a few files are easier to keep than many); a summary table is printed last.
#   bash tests/gpu/run_all.sh   (on a machine with 4 GPUs, megatron-core wheels in .whl/)
# .whl/ holds megatron-core for Python 3.12 (see tests/gpu/run_megatron_gpu.sh).
# Env: SKIP="fifo internode megatron train intranode bench resume" (names to leave out), PHASES
#      ("1 2 3": 2-GPU correctness, all-GPU correctness, timings), TRAIN_ITERS (50, 2 GPUs),
#      TRAIN_ITERS_ALL (20, all GPUs), BENCH_SMS (24), DEADLINE_S (570: the call's budget).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CMAKE_BUILD_PARALLEL_LEVEL=64 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
REPO=$(pwd)
LOGS=/tmp/logs
DEADLINE=$((SECONDS + ${DEADLINE_S:-570}))
ITERS=${TRAIN_ITERS:-50}
mkdir -p "$OUT" "$LOGS"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
phase() { [[ " ${PHASES:-1 2 3} " == *" $1 "* ]]; }
echo "GPUs: $NGPU; commit $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi topo -m > "$LOGS/topo.log" 2>&1

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$LOGS/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
t0=$SECONDS
timeout 180 python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
  -C cmake.define.UCCL_EP_CUDA_ARCHS=90 . > "$LOGS/build.log" 2>&1
rc=$?
echo "build rc=$rc ($((SECONDS - t0)) s)" | tee "$LOGS/summary_build.txt"
if [ $rc -ne 0 ]; then tail -30 "$LOGS/build.log"; exit 1; fi
cd /tmp || exit 1 # import the installed package, not the source tree
PYTEST=(python3 -X faulthandler -m pytest -q -p no:cacheprovider --import-mode=importlib
  -o addopts="" -o faulthandler_timeout=100 -rA --tb=short --durations=5)

# suite NAME GPUS LIMIT LOG CMD...: one line per suite in $LOGS/summary_<log>.txt
suite() {
  local name=$1 gpus=$2 limit=$3 log=$4
  shift 4
  if skip "$name"; then echo "$log skipped" > "$LOGS/summary_$log.txt"; return; fi
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then echo "$log not run (deadline)" > "$LOGS/summary_$log.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$SECONDS
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 "$limit" "$@" > "$LOGS/$log.log" 2>&1
  local rc=$?
  printf '%-24s gpus=%-8s rc=%-3s %4ss  %s\n' "$log" "$gpus" "$rc" "$((SECONDS - t))" \
    "$(grep -E '[0-9]+ (passed|failed|error)' "$LOGS/$log.log" | tail -1 | cut -c1-90)" \
    > "$LOGS/summary_$log.txt"
}
train() {  # lane-gpus ngpu dispatcher tag
  suite train "$1" 240 "train_$4" python3 -m uccl_ep_megatron.cli train --recipe deepseek-v3/proxy \
    --dispatcher "$3" --gpus "$2" --iters "$ITERS" --save-interval 0 --no-wandb \
    --run-dir "/tmp/train_$4"
  cp "/tmp/train_$4/metrics.jsonl" "$LOGS/train_$4_metrics.jsonl" 2>/dev/null
}

if [ "$NGPU" -ge 4 ]; then A=0,1 B=2,3; else A=0,1 B=0,1; fi
ALL=$(seq -s, 0 $((NGPU - 1)))
# Phase 1, correctness on 2 GPUs, in two lanes when there are 4+ GPUs.
lane_a() {
  suite fifo $A 150 fifo "${PYTEST[@]}" "$REPO/tests/gpu/test_fifo_gpu.py"
  suite megatron $A 150 megatron "${PYTEST[@]}" -s "$REPO/tests/gpu/test_megatron_gpu.py"
}
lane_b() {
  suite intranode $B 90 intranode_2 "${PYTEST[@]}" "$REPO/tests/gpu/test_intranode.py"
  UCCL_EP_TEST_KERNEL_TIMEOUT_MS=15000 suite internode $B 200 internode_2x1 "${PYTEST[@]}" \
    "$REPO/tests/gpu/test_internode.py"
}
if phase 1; then
  if [ "$NGPU" -ge 4 ]; then
    lane_a & lane_b & wait
  else
    lane_a; lane_b
  fi
fi
# Phase 2, correctness on all GPUs (EP4 intranode, 2 x N/2 virtual nodes).
if phase 2 && [ "$NGPU" -ge 4 ]; then
  suite intranode "$ALL" 90 "intranode_$NGPU" "${PYTEST[@]}" "$REPO/tests/gpu/test_intranode.py"
  UCCL_EP_TEST_KERNEL_TIMEOUT_MS=15000 suite internode "$ALL" 150 "internode_2x$((NGPU / 2))" \
    "${PYTEST[@]}" "$REPO/tests/gpu/test_internode.py"
fi
# Phase 3, timings, one at a time: training side by side, then the microbenchmarks.
if phase 3; then
  train $A 2 uccl_ep uccl_ep_2
  train $A 2 alltoall alltoall_2
  if [ "$NGPU" -ge 4 ]; then
    ITERS=${TRAIN_ITERS_ALL:-20} train "$ALL" "$NGPU" uccl_ep "uccl_ep_$NGPU"
    ITERS=${TRAIN_ITERS_ALL:-20} train "$ALL" "$NGPU" alltoall "alltoall_$NGPU"
    suite bench "$ALL" 90 "bench_intranode_$NGPU" python3 -m uccl_ep_megatron.cli bench \
      intranode --sms "${BENCH_SMS:-24}" --json "$LOGS/bench_intranode_$NGPU.json"
  fi
  suite bench $A 60 bench_intranode_2 python3 -m uccl_ep_megatron.cli bench intranode \
    --sms "${BENCH_SMS:-24}" --json "$LOGS/bench_intranode_2.json"
  suite bench 0 60 bench_fifo python3 -X faulthandler -m uccl_ep_megatron.bench.fifo \
    --json "$LOGS/bench_fifo.json"
  suite bench $A 90 bench_internode_2x1 python3 -m uccl_ep_megatron.bench.internode --iters 5 \
    --json "$LOGS/bench_internode_2x1.json"
  if [ "$NGPU" -ge 4 ]; then
    suite bench "$ALL" 90 "bench_internode_2x$((NGPU / 2))" python3 -m \
      uccl_ep_megatron.bench.internode --iters 5 --json "$LOGS/bench_internode_2x$((NGPU / 2)).json"
  fi
  # Checkpoint save and resume (Megatron distributed checkpointing): 6 iterations saving at 3
  # and 6, then the same run directory continued to 9; the resumed run must log steps 7-9.
  R=(python3 -m uccl_ep_megatron.cli train --recipe deepseek-v3/proxy --dispatcher uccl_ep
    --gpus 2 --no-wandb --checkpoint-dir /tmp/ckpt/checkpoints)
  suite resume $A 120 resume_save "${R[@]}" --iters 6 --save-interval 3 --run-dir /tmp/ckpt/a
  suite resume $A 120 resume_load "${R[@]}" --iters 9 --save-interval 0 --run-dir /tmp/ckpt/b
  if ! skip resume; then
    python3 -c "import json, sys; s = [json.loads(l)['step'] for l in open(sys.argv[1])]; \
print('resumed steps', s); sys.exit(s != [7, 8, 9])" /tmp/ckpt/b/metrics.jsonl \
      > "$LOGS/resume_check.log" 2>&1
    echo "resume check rc=$? $(tail -1 "$LOGS/resume_check.log")" > "$LOGS/summary_resume_check.txt"
  fi
fi

for n in 2 "$NGPU"; do # side-by-side table, and the loss curves step by step
  a=/tmp/train_alltoall_$n u=/tmp/train_uccl_ep_$n
  if [ ! -f "$a/metrics.jsonl" ] || [ ! -f "$u/metrics.jsonl" ]; then continue; fi
  timeout 60 python3 -m uccl_ep_megatron.cli report "$a" "$u" --out "/tmp/report_$n" \
    > "$LOGS/report_$n.log" 2>&1
  python3 - "$a" "$u" >> "$LOGS/report_$n.log" 2>&1 << 'PY'
import json, sys
runs = [[json.loads(l) for l in open(f"{d}/metrics.jsonl") if l.strip()] for d in sys.argv[1:]]
la, lu = ([r["loss"] for r in run if "loss" in r] for run in runs)
d = [abs(x - y) for x, y in zip(la, lu)] or [float("nan")]
if not la or not lu:
    sys.exit(f"no loss records: alltoall {len(la)}, uccl_ep {len(lu)}")
print(f"loss steps {len(d)}: alltoall {la[0]:.4f}->{la[-1]:.4f} uccl_ep {lu[0]:.4f}->{lu[-1]:.4f}"
      f" max|diff| {max(d):.4f} (step {d.index(max(d)) + 1}) mean|diff| {sum(d) / len(d):.4f}")
PY
done
tar -czf "$OUT/logs.tar.gz" -C /tmp logs
echo "================ summary (elapsed $SECONDS s)"
cat "$LOGS"/summary_*.txt
for f in "$LOGS"/*.log; do
  grep -HE "^(FAILED|ERROR)|Error:|Timeout" "$f" 2>/dev/null | head -4 | cut -c1-300
done
echo "---- bench fifo"; tail -8 "$LOGS/bench_fifo.log" 2>/dev/null
echo "---- megatron layer"; grep -E "tok/s" "$LOGS/megatron.log" 2>/dev/null | tail -2
for r in "$LOGS"/report_*.log; do echo "---- $r"; tail -10 "$r"; done
for t in uccl_ep_2 "uccl_ep_$NGPU"; do
  echo "---- train_$t tail"; tail -4 "$LOGS/train_$t.log" 2>/dev/null | cut -c1-300
done
for f in "$LOGS"/bench_in*.log; do echo "---- $f"; grep -vE "Warning|warn|return func" "$f" | tail -11; done
