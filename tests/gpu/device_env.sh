# Sourced by the tests/gpu/run_*.sh device scripts: what every device call sets up (NVLink
# multicast off, KINDS.md says why), $OUT for the results, $REPO, and the sm_90 package build.
# shellcheck shell=bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The ipc transport refuses lazy module loading (uccl_ep_megatron/proxy/loading.py says why);
# in-process GPU tests start it too.
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
export CMAKE_BUILD_PARALLEL_LEVEL=32
OUT=${OUT:-/tmp/out}
# shellcheck disable=SC2034  # used by the scripts that source this file
REPO=$(pwd)
mkdir -p "$OUT"

# Builds and installs the package for sm_90 into the device's Python (log: $OUT/build.log);
# sets t0 and t1 (seconds) around it and exits the script when the build fails.
build_sm90() {
  t0=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -q -C build-dir=/tmp/b \
    -C cmake.define.UCCL_EP_CUDA_ARCHS=90 . > "$OUT/build.log" 2>&1
  local build_rc=$?
  t1=$(date +%s)
  echo "build rc=$build_rc ($((t1 - t0)) s)"
  if [ $build_rc -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
}
