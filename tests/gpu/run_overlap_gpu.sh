#!/usr/bin/env bash
# Megatron's EP overlap schedule with uccl_ep at EP2 (tests/gpu/test_overlap_gpu.py): a small
# MoE GPT, one step with --overlap-moe-expert-parallel-comm off and on, losses and gradients
# compared, the overlap's asynchronous calls checked; with megatron-core 0.19+ also the
# shared-expert overlap (--moe-shared-expert-overlap); kernels and reference backends.
# Needs 2 GPUs and megatron-core for the device's Python: installed, or its wheels in WHEELS
# (a glob; default .whl/*.whl), e.g. WHEELS='.whl/mc-0.19.2/*.whl' for 0.19:
#   bash tests/gpu/run_overlap_gpu.sh
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
WHEELS=${WHEELS:-.whl/*.whl}
# shellcheck disable=SC2086  # WHEELS is a glob
if ls $WHEELS > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $WHEELS > "$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -c "from megatron.core import package_info as p; print('megatron-core', p.__version__)"
build_sm90
cd /tmp || exit 1 # import the installed package, not the source tree
# shellcheck disable=SC2086  # PYTEST_ARGS: extra words for pytest
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} python3 -X faulthandler -m pytest -q -s -rA \
  -p no:cacheprovider --import-mode=importlib -o addopts="" -o faulthandler_timeout=200 \
  --timeout=400 "$REPO/tests/gpu/test_overlap_gpu.py" ${PYTEST_ARGS:-} > "$OUT/pytest_overlap.log" 2>&1
rc=$?
echo "---- pytest (rc=$rc, $(($(date +%s) - t1)) s) ----"
grep -E "passed|failed|skipped|Error|assert" "$OUT/pytest_overlap.log" | tail -30
exit $rc
