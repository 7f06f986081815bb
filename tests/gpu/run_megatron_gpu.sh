#!/usr/bin/env bash
# One run on a 2-GPU machine for the Megatron dispatcher: DeepSeek-V3-shaped MoE
# layer under alltoall and uccl_ep (EP=2), outputs/grads compared, tokens/s side by side.
# Needs megatron-core for Python 3.12 in .whl/: bash tests/gpu/run_megatron_gpu.sh
# Env: UCCL_EP_MEGATRON_GPU_TOKENS (tokens per rank, default 4096).
set -uo pipefail
# shellcheck source=tests/gpu/device_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
export PYTHONPATH=/tmp/site
t0=$(date +%s)
timeout 150 python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
  -C cmake.define.UCCL_EP_CUDA_ARCHS=90 -C "cmake.define.CMAKE_CXX_FLAGS=-include cstdint" . \
  > "$OUT/build.log" 2>&1
build_rc=$?
t1=$(date +%s)
echo "build rc=$build_rc ($((t1 - t0)) s)"
if [ $build_rc -ne 0 ]; then
  # Still test the dispatcher on the reference backend: the package as CMake would install it.
  tail -15 "$OUT/build.log"
  mkdir -p /tmp/overlay && cp -r "$REPO/uccl_ep_megatron" /tmp/overlay/ \
    && cp -r "$REPO/token_dispatcher" /tmp/overlay/uccl_ep_megatron/token_dispatcher
  export PYTHONPATH=/tmp/overlay:/tmp/site
fi
cd /tmp  # import the installed package, not the source tree
python3 -m pytest -q -s -p no:cacheprovider --import-mode=importlib -o addopts="" --timeout=240 \
  "$REPO/tests/gpu/test_megatron_gpu.py" ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
test_rc=$?
t2=$(date +%s)
echo "---- pytest (rc=$test_rc, $((t2 - t1)) s) ----"
grep -E "passed|failed|skipped|Error|error|assert|tok/s" "$OUT/pytest.log" | tail -30
python3 - "$OUT" <<'PY'
import glob, json, sys
rows = []
for path in sorted(glob.glob(sys.argv[1] + "/megatron_gpu_*.json")):
    rec = json.load(open(path))
    r = rec["ranks"][0]
    rows.append((rec["backend"], r))
if rows:
    print(f"{'backend':10} {'alltoall tok/s':>15} {'uccl_ep tok/s':>15} {'out rel':>9} {'dx rel':>9} "
          f"{'param rel':>9} {'disp ms':>8} {'comb ms':>8}")
    for b, r in rows:
        print(f"{b:10} {r['alltoall_tokens_per_s']:15.0f} {r['uccl_ep_tokens_per_s']:15.0f} "
              f"{r['output'][1]:9.2e} {r['input_grad'][1]:9.2e} {r['worst_param_grad'][2]:9.2e} "
              f"{r['uccl_ep_dispatch_ms_per_step']:8.2f} {r['uccl_ep_combine_ms_per_step']:8.2f}")
PY
exit $test_rc
