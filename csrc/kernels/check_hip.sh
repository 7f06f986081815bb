#!/usr/bin/env bash
# Compile check of every GPU source (kernels, FIFO, transport hooks) for AMD gfx90a (wave64, CDNA) with Debian's hipcc
# (ROCm 5.2: `apt-get install -y hipcc`). It proves the single-source CUDA/HIP path builds;
# gfx942/gfx950 need a current ROCm (see the ROCm Dockerfile). Usage: csrc/kernels/check_hip.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export HIP_PLATFORM=amd
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for f in csrc/kernels/*.cu csrc/kernels/internode/*.cu csrc/fifo/*.cu csrc/transport/*.cu csrc/bench/*.cu; do
  echo "hipcc gfx90a: $f"
  hipcc -std=c++17 -O2 --offload-arch=gfx90a -DUCCL_EP_HIP=1 -Icsrc -x hip -c "$f" -o "$out/$(basename "$f").o"
done
echo "HIP compile check passed"
