#!/bin/bash
# Train the DeepSeek-V3-shaped proxy recipe (deepseek-v3/proxy, ~0.9B parameters, EP over the
# GPUs) once with the uccl_ep dispatcher and once with megatron-core's alltoall dispatcher, on
# the same synthetic data and seed, then print tokens/s, TFLOP/s/GPU, dispatch/combine time and
# final loss side by side. Also checks checkpoint resume (the uccl_ep run continues from its
# last checkpoint) and that flops.py's parameter count matches the model megatron-core built.
#
# Needs on the device: this package installed (pip install .) and megatron-core importable.
# The device image has no megatron-core: carry the wheel (Python 3.12, no dependencies beyond
# torch/numpy/packaging, which the image has):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#     -d .whl megatron-core==0.16.0
# wandb is optional (without it metrics go to RUN_DIR/metrics.jsonl only); matplotlib is in
# the image (report PNGs).
#
# Env: ITERS (default 20), GPUS (default 2), OUT (results folder; default /tmp/train_compare).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
ITERS="${ITERS:-20}"
GPUS="${GPUS:-2}"
OUT_DIR="${OUT:-/tmp/train_compare}"
CLI=(python3 -m uccl_ep_megatron.cli)
mkdir -p "${OUT_DIR}"
python3 -c "import megatron.core, uccl_ep_megatron, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"

status=0
for dispatcher in alltoall uccl_ep; do
  rm -rf "${OUT_DIR:?}/${dispatcher}"
  # Only the uccl_ep run saves a checkpoint (~14 bytes per parameter with Adam): it is resumed below.
  save=0
  if [ "${dispatcher}" = uccl_ep ]; then save="${ITERS}"; fi
  echo "=== train deepseek-v3/proxy on ${GPUS} GPUs, dispatcher ${dispatcher}, ${ITERS} iterations"
  timeout 600 "${CLI[@]}" train --recipe deepseek-v3/proxy --dispatcher "${dispatcher}" \
    --gpus "${GPUS}" --iters "${ITERS}" --save-interval "${save}" --no-wandb \
    --run-dir "${OUT_DIR}/${dispatcher}" 2>&1 | tee "${OUT_DIR}/${dispatcher}.log" || {
    status=$?
    echo "!!! ${dispatcher} run failed (exit ${status}); see ${OUT_DIR}/${dispatcher}.log"
  }
done

if [ -f "${OUT_DIR}/uccl_ep/checkpoints/latest_checkpointed_iteration.txt" ]; then
  echo "=== resume the uccl_ep run from its iteration-${ITERS} checkpoint for 4 more iterations"
  rm -rf "${OUT_DIR:?}/uccl_ep_resume"
  timeout 600 "${CLI[@]}" train --recipe deepseek-v3/proxy --dispatcher uccl_ep --gpus "${GPUS}" \
    --iters "$((ITERS + 4))" --save-interval 0 --no-wandb \
    --checkpoint-dir "${OUT_DIR}/uccl_ep/checkpoints" --run-dir "${OUT_DIR}/uccl_ep_resume" \
    2>&1 | tee "${OUT_DIR}/uccl_ep_resume.log" || status=$?
fi
python3 - "${OUT_DIR}" "${ITERS}" <<'PY' || status=$?
import json, sys
from pathlib import Path
out, iters = Path(sys.argv[1]), int(sys.argv[2])
resume = out / "uccl_ep_resume" / "metrics.jsonl"
if resume.is_file():
    steps = [json.loads(l)["step"] for l in resume.read_text().splitlines()]
    ok = steps == list(range(iters + 1, iters + 5))
    print(f"resume {'OK' if ok else 'FAILED'}: steps {steps}, expected {iters + 1}..{iters + 4}")
for d in ("alltoall", "uccl_ep"):
    summary = out / d / "summary.json"
    if not summary.is_file():
        print(f"{d}: no summary.json (the run did not finish)")
        continue
    s = json.loads(summary.read_text())
    if "model_params_built" not in s:
        print(f"{d}: not a GPU run (summary {s})")
        continue
    built, expected = s["model_params_built"], s["model_params_expected"]
    print(f"{d}: megatron-core parameters {built:,} vs flops.py {expected:,}"
          f" ({'match' if built == expected else 'MISMATCH'}); Buffer backend: {s['buffer_backends']}")
PY

echo "=== side by side (means after 5 warm-up iterations)"
runs=()
for d in alltoall uccl_ep; do
  if [ -f "${OUT_DIR}/${d}/metrics.jsonl" ]; then runs+=("${OUT_DIR}/${d}"); fi
done
if [ "${#runs[@]}" -gt 0 ]; then
  "${CLI[@]}" report "${runs[@]}" --out "${OUT_DIR}/report" --warmup-steps 5 || status=$?
fi
exit "${status}"
