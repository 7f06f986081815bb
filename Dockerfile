# syntax=docker/dockerfile:1
# Images with uccl-ep-megatron built for CUDA (NVIDIA, PyTorch NGC base) or ROCm (AMD MI300X,
# ROCm PyTorch base), rdma-core with the EFA, bnxt_re (Broadcom Thor-2) and mlx5 verbs
# providers, and a pinned megatron-core. Pick the stage with --target:
#
#   docker build --target cuda -t uccl-ep-megatron:cuda .
#   docker build --target rocm -t uccl-ep-megatron:rocm .
#
# Build args (--build-arg NAME=VALUE):
#   CUDA_BASE              PyTorch NGC image (Python >= 3.11)   nvcr.io/nvidia/pytorch:25.01-py3
#   ROCM_BASE              ROCm PyTorch image (Python >= 3.11)  rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.6.0
#   CUDA_ARCHS             UCCL_EP_CUDA_ARCHS of the kernels    90 (H100/H200; "80;90" adds A100)
#   HIP_ARCHS              UCCL_EP_HIP_ARCHS of the kernels     gfx942 (MI300X; add gfx950 for MI355X)
#   MEGATRON_CORE_VERSION  pinned megatron-core                 0.16.0
#   EFA_INSTALLER_VERSION  if set, also runs AWS's EFA installer (libfabric + aws-ofi-nccl for
#                          NCCL over EFA) in the CUDA stage, e.g. 1.38.0; empty = rdma-core only
#
# Run with the host's RDMA devices and GPUs, e.g.
#   docker run --gpus all --network host --ipc host --device /dev/infiniband \
#     --ulimit memlock=-1 uccl-ep-megatron:cuda uccl-ep-megatron train
#   docker run --device /dev/kfd --device /dev/dri --group-add video --network host \
#     --ipc host --device /dev/infiniband --ulimit memlock=-1 uccl-ep-megatron:rocm uccl-ep-megatron doctor
ARG CUDA_BASE=nvcr.io/nvidia/pytorch:25.01-py3
ARG ROCM_BASE=rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.6.0

# ---- CUDA ---------------------------------------------------------------------------------
FROM ${CUDA_BASE} AS cuda
ARG CUDA_ARCHS=90
ARG MEGATRON_CORE_VERSION=0.16.0
ARG EFA_INSTALLER_VERSION=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# ibverbs-providers carries the efa, bnxt_re and mlx5 providers; libibverbs-dev the headers the
# verbs transport compiles against (the library itself is dlopen'd at run time).
RUN apt-get update \
 && apt-get install -y --no-install-recommends rdma-core ibverbs-providers ibverbs-utils \
      libibverbs-dev curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN if [ -n "${EFA_INSTALLER_VERSION}" ]; then \
      cd /tmp \
      && curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
      && tar xzf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
      && (cd aws-efa-installer && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify) \
      && rm -rf /tmp/aws-efa-installer*; \
    fi
WORKDIR /opt/uccl-ep-megatron
COPY . .
RUN python -m pip install --no-cache-dir "scikit-build-core>=0.10" "pybind11>=2.12" \
      "megatron-core==${MEGATRON_CORE_VERSION}" "wandb>=0.19" "matplotlib>=3.7" \
 && UCCL_EP_GPU=cuda python -m pip install --no-cache-dir --no-build-isolation \
      -C build-dir=/tmp/uccl-ep-build -C "cmake.define.UCCL_EP_CUDA_ARCHS=${CUDA_ARCHS}" . \
 && rm -rf /tmp/uccl-ep-build \
 && python -c "import uccl_ep_megatron, megatron.core; print('uccl_ep_megatron', uccl_ep_megatron.__version__)"
ENV NCCL_NVLS_ENABLE=0

# ---- ROCm ---------------------------------------------------------------------------------
FROM ${ROCM_BASE} AS rocm
ARG HIP_ARCHS=gfx942
ARG MEGATRON_CORE_VERSION=0.16.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends rdma-core ibverbs-providers ibverbs-utils \
      libibverbs-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/uccl-ep-megatron
COPY . .
RUN python -m pip install --no-cache-dir "scikit-build-core>=0.10" "pybind11>=2.12" \
      "megatron-core==${MEGATRON_CORE_VERSION}" "wandb>=0.19" "matplotlib>=3.7" \
 && UCCL_EP_GPU=hip python -m pip install --no-cache-dir --no-build-isolation \
      -C build-dir=/tmp/uccl-ep-build -C "cmake.define.UCCL_EP_HIP_ARCHS=${HIP_ARCHS}" . \
 && rm -rf /tmp/uccl-ep-build \
 && python -c "import uccl_ep_megatron, megatron.core; print('uccl_ep_megatron', uccl_ep_megatron.__version__)"
# RCCL on MI300X: fine-grained PCIe memory for the proxies' host-visible FIFOs and flags.
ENV HSA_FORCE_FINE_GRAIN_PCIE=1
