#!/usr/bin/env bash
# Every GPU check of the project in one device call (nvidia-h200-x2), for when the session's
# device time allows only one: build once, then each suite under its own time limit, most
# valuable first, so a hang in one costs only its own slot. Logs under $OUT, a summary last.
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash tests/gpu/run_all.sh")
# .whl/ holds megatron-core for Python 3.12 (see tests/gpu/run_megatron_gpu.sh).
# Env: SKIP="fifo megatron train internode intranode" (names to leave out), TRAIN_ITERS (8).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CMAKE_BUILD_PARALLEL_LEVEL=32 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
REPO=$(pwd)
mkdir -p "$OUT"
summary=()
note() { summary+=("$1"); echo "## $1"; }
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
t0=$SECONDS
timeout 120 python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
  -C cmake.define.UCCL_EP_CUDA_ARCHS=90 . > "$OUT/build.log" 2>&1
rc=$?
note "build rc=$rc ($((SECONDS - t0)) s)"
if [ $rc -ne 0 ]; then tail -30 "$OUT/build.log"; exit 1; fi
cd /tmp || exit 1  # import the installed package, not the source tree
PYTEST=(python3 -X faulthandler -m pytest -q -p no:cacheprovider --import-mode=importlib -o addopts="" -rs)

suite() {  # name, time limit, log, command...
  local name=$1 limit=$2 log=$3
  shift 3
  if skip "$name"; then note "$name skipped"; return; fi
  local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  note "$name rc=$rc ($((SECONDS - t)) s): $(grep -E '[0-9]+ (passed|failed)' "$OUT/$log" | tail -1)"
}

suite fifo 50 fifo.log "${PYTEST[@]}" "$REPO/tests/gpu/test_fifo_gpu.py"
suite megatron 60 megatron.log "${PYTEST[@]}" -s "$REPO/tests/gpu/test_megatron_gpu.py"
for d in alltoall uccl_ep; do
  suite train 60 "train_$d.log" python3 -m uccl_ep_megatron.cli train --recipe deepseek-v3/proxy \
    --dispatcher "$d" --gpus 2 --iters "${TRAIN_ITERS:-8}" --save-interval 0 --no-wandb \
    --run-dir "/tmp/train_$d"
  cp "/tmp/train_$d/metrics.jsonl" "$OUT/train_${d}_metrics.jsonl" 2>/dev/null
done
skip train || timeout 30 python3 -m uccl_ep_megatron.cli report /tmp/train_alltoall /tmp/train_uccl_ep \
  --out /tmp/report > "$OUT/train_report.log" 2>&1
UCCL_EP_TEST_TIMEOUT_S=45 UCCL_EP_TEST_KERNEL_TIMEOUT_MS=8000 \
  suite internode 60 internode.log "${PYTEST[@]}" -x "$REPO/tests/gpu/test_internode.py"
suite bench-fifo 25 bench_fifo.log python3 -m uccl_ep_megatron.bench.fifo --json "$OUT/bench_fifo.json"
suite intranode 50 intranode.log "${PYTEST[@]}" -x "$REPO/tests/gpu/test_intranode.py"

# The device tool returns at most 8 files: keep every log in one archive.
(cd "$OUT" && mkdir -p /tmp/logs && mv -- *.log *.json *.jsonl /tmp/logs/ 2>/dev/null
 tar -czf "$OUT/logs.tar.gz" -C /tmp logs)
OUT_LOGS=/tmp/logs
echo "================ summary"
printf '%s\n' "${summary[@]}"
echo "---- megatron layer"; grep -E "tok/s|rel|max" "$OUT_LOGS/megatron.log" | tail -8
echo "---- train"; tail -12 "$OUT_LOGS/train_report.log" 2>/dev/null
echo "---- bench fifo"; tail -8 "$OUT_LOGS/bench_fifo.log"
for f in fifo megatron internode intranode; do
  grep -E "^(FAILED|ERROR)" "$OUT_LOGS/$f.log" 2>/dev/null | head -5
done
