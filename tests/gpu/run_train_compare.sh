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

for dispatcher in alltoall uccl_ep; do
  rm -rf "${OUT_DIR:?}/${dispatcher}"
  echo "=== train deepseek-v3/proxy on ${GPUS} GPUs, dispatcher ${dispatcher}, ${ITERS} iterations"
  timeout 600 "${CLI[@]}" train --recipe deepseek-v3/proxy --dispatcher "${dispatcher}" \
    --gpus "${GPUS}" --iters "${ITERS}" --save-interval "${ITERS}" --no-wandb \
    --run-dir "${OUT_DIR}/${dispatcher}" 2>&1 | tee "${OUT_DIR}/${dispatcher}.log"
done

echo "=== resume the uccl_ep run from its iteration-${ITERS} checkpoint for 4 more iterations"
rm -rf "${OUT_DIR:?}/uccl_ep_resume"
timeout 600 "${CLI[@]}" train --recipe deepseek-v3/proxy --dispatcher uccl_ep --gpus "${GPUS}" \
  --iters "$((ITERS + 4))" --save-interval 0 --no-wandb \
  --checkpoint-dir "${OUT_DIR}/uccl_ep/checkpoints" --run-dir "${OUT_DIR}/uccl_ep_resume" \
  2>&1 | tee "${OUT_DIR}/uccl_ep_resume.log"
python3 - "${OUT_DIR}" "${ITERS}" <<'PY'
import json, sys
from pathlib import Path
out, iters = Path(sys.argv[1]), int(sys.argv[2])
steps = [json.loads(l)["step"] for l in (out / "uccl_ep_resume" / "metrics.jsonl").read_text().splitlines()]
assert steps == list(range(iters + 1, iters + 5)), f"resume steps {steps}, expected {iters + 1}..{iters + 4}"
print(f"resume OK: continued at iteration {steps[0]}")
for d in ("alltoall", "uccl_ep"):
    s = json.loads((out / d / "summary.json").read_text())
    built, expected = s["model_params_built"], s["model_params_expected"]
    print(f"{d}: megatron-core parameters {built:,} vs flops.py {expected:,}"
          f" ({'match' if built == expected else 'MISMATCH'})")
PY

echo "=== side by side (means after 5 warm-up iterations)"
"${CLI[@]}" report "${OUT_DIR}/alltoall" "${OUT_DIR}/uccl_ep" --out "${OUT_DIR}/report" --warmup-steps 5
