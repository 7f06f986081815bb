// The NVLink copy floor (`uccl-ep-megatron bench nvlink`): the intranode kernels' own row copies
// (kernels/common.cuh: copy_row_multi, TmaPipe) in a dispatch's all-to-all pattern, all devices
// at once, next to the copy engines. One process drives every device.
#include <vector>

#include "common/gpu.h"

#include "bench/nvlink_bench.h"
#include "kernels/common.cuh"

#if defined(UCCL_EP_DEVICE_HIP)
#define nvl_event_create hipEventCreate
#define nvl_event_elapsed hipEventElapsedTime
#define nvl_event_sync hipEventSynchronize
#define nvl_enable_peer hipDeviceEnablePeerAccess
#define nvl_peer_enabled hipErrorPeerAccessAlreadyEnabled
#define nvl_memset hipMemset
#else
#define nvl_event_create cudaEventCreate
#define nvl_event_elapsed cudaEventElapsedTime
#define nvl_event_sync cudaEventSynchronize
#define nvl_enable_peer cudaDeviceEnablePeerAccess
#define nvl_peer_enabled cudaErrorPeerAccessAlreadyEnabled
#define nvl_memset cudaMemset
#endif

namespace uccl_ep::gpu {
namespace {

using kernels::kMaxRanks;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / dev::kWarpSize;

struct A2aParams {
  const uint8_t* src;
  uint8_t* region[kMaxRanks];  // every device's receive region: kMaxRanks slots of rows * row_bytes
  int rank, num_ranks, rows, fanout;
  int64_t row_bytes;
};

// The peer that row t of `rank` goes to as its j-th destination (j < fanout): a rotation over
// the R - 1 peers, as a dispatch sends a token to the ranks of its experts. The kernel and the
// host's byte counts and spot check all place rows by it.
__host__ __device__ inline int peer_of(int rank, int64_t t, int j, int R) {
  return (rank + 1 + static_cast<int>((t + j) % (R - 1))) % R;
}

// Row t goes to peer_of(rank, t, j), j < fanout, into slot `rank` of their regions at row t.
template <bool kTma>
__global__ void __launch_bounds__(kThreads) a2a_kernel(A2aParams p) {
  const int lane = threadIdx.x % dev::kWarpSize, warp = threadIdx.x / dev::kWarpSize;
#if UCCL_EP_HAS_TMA
  extern __shared__ __align__(128) uint8_t s_tma[];
  __shared__ uint64_t s_bar[kWarps * kernels::kTmaStages];
  kernels::TmaPipe pipe;
  if constexpr (kTma)
    pipe.init(s_tma + warp * kernels::kTmaStages * kernels::kTmaChunk, s_bar + warp * kernels::kTmaStages, lane);
#endif
  const int R = p.num_ranks;
  const int64_t slot_bytes = static_cast<int64_t>(p.rows) * p.row_bytes;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < p.rows; t += nw) {
    uint8_t* dst[kMaxRanks];
    unsigned mask = 0;
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) dst[r] = nullptr;
    for (int j = 0; j < p.fanout; ++j) {
      mask |= 1u << peer_of(p.rank, t, j, R);
    }
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (mask >> r & 1u) dst[r] = p.region[r] + p.rank * slot_bytes + t * p.row_bytes;
    const uint8_t* s = p.src + t * p.row_bytes;
    if constexpr (kTma) {
#if UCCL_EP_HAS_TMA
      pipe.push_row(s, p.row_bytes, dst, mask);
#endif
    } else {
      kernels::copy_row_multi<int4, 8>(s, p.row_bytes, dst, mask, lane);
    }
  }
#if UCCL_EP_HAS_TMA
  if constexpr (kTma) pipe.drain();
#endif
}

void enable_peers(const std::vector<int>& devices) {
  for (int a : devices) {
    GPU_CHECK(gpuSetDevice(a));
    for (int b : devices) {
      if (a == b) continue;
      const auto err = nvl_enable_peer(b, 0);
      if (err == nvl_peer_enabled) {
        (void)gpuGetLastError();
      } else {
        GPU_CHECK(err);
      }
    }
  }
}

}  // namespace

NvlinkBenchResult run_nvlink_bench(const std::vector<int>& devices, const std::string& mode, int sms, int rows,
                                   int64_t row_bytes, int fanout, int iters) {
  const int R = static_cast<int>(devices.size());
  UCCL_EP_CHECK_ARG(R >= 2 && R <= kMaxRanks, "bench nvlink needs 2..", kMaxRanks, " devices, got ", R);
  UCCL_EP_CHECK_ARG(fanout >= 1 && fanout < R, "fanout=", fanout, " must be in 1..", R - 1, " (peers per row)");
  UCCL_EP_CHECK_ARG(row_bytes > 0 && row_bytes % 16 == 0, "row_bytes=", row_bytes,
                    " must be a positive multiple of 16");
  UCCL_EP_CHECK_ARG(rows > 0 && iters > 0, "rows=", rows, " and iters=", iters, " must be positive");
  UCCL_EP_CHECK_ARG(mode == "ce" || sms > 0, "sms=", sms, " must be positive for the kernel copies");
  UCCL_EP_CHECK_ARG(mode == "ldst" || mode == "tma" || mode == "ce", "mode=", mode, " must be ldst, tma or ce");
  enable_peers(devices);
  const int64_t slot = static_cast<int64_t>(rows) * row_bytes;
  std::vector<uint8_t*> src(R), region(R);
  std::vector<gpuStream_t> main(R);
  std::vector<std::vector<gpuStream_t>> side(R, std::vector<gpuStream_t>(R));
  std::vector<gpuEvent_t> start(R), stop(R);
  std::vector<std::vector<gpuEvent_t>> joined(R, std::vector<gpuEvent_t>(R));
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    GPU_CHECK(gpuMalloc(&src[i], slot));
    GPU_CHECK(gpuMalloc(&region[i], slot * R));
    GPU_CHECK(nvl_memset(src[i], i + 1, slot));
    GPU_CHECK(gpuStreamCreateWithFlags(&main[i], gpuStreamNonBlocking));
    GPU_CHECK(nvl_event_create(&start[i]));
    GPU_CHECK(nvl_event_create(&stop[i]));
    for (int j = 0; j < R; ++j) {
      GPU_CHECK(gpuStreamCreateWithFlags(&side[i][j], gpuStreamNonBlocking));
      GPU_CHECK(gpuEventCreateWithFlags(&joined[i][j], gpuEventDisableTiming));
    }
  }
  const bool tma = mode == "tma";
  constexpr int smem = kernels::tma_smem_bytes(kWarps);
  if (tma) {
    UCCL_EP_CHECK_ARG(kernels::tma_supported(), "mode=tma needs an sm_90+ NVIDIA GPU");
#if defined(UCCL_EP_DEVICE_CUDA)
    for (int i = 0; i < R; ++i) {
      GPU_CHECK(gpuSetDevice(devices[i]));
      GPU_CHECK(cudaFuncSetAttribute(a2a_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
#endif
  }
  // Peer slot bytes for the copy engines: the rows a row-to-peer assignment gives each peer.
  auto rows_to = [&](int i, int d) {
    int64_t n = 0;
    for (int64_t t = 0; t < rows; ++t)
      for (int j = 0; j < fanout; ++j)
        if (peer_of(i, t, j, R) == d) ++n;
    return n;
  };
  auto last_row = [&](int i, int d) {
    for (int64_t t = rows - 1; t >= 0; --t)
      for (int j = 0; j < fanout; ++j)
        if (peer_of(i, t, j, R) == d) return t;
    return static_cast<int64_t>(-1);
  };
  std::vector<std::vector<int64_t>> ce_bytes(R, std::vector<int64_t>(R, 0));
  if (mode == "ce")
    for (int i = 0; i < R; ++i)
      for (int d = 0; d < R; ++d)
        if (d != i) ce_bytes[i][d] = rows_to(i, d) * row_bytes;
  auto round = [&](int i) {
    if (mode == "ce") {
      GPU_CHECK(gpuEventRecord(joined[i][i], main[i]));
      for (int d = 0; d < R; ++d) {
        if (d == i) continue;
        GPU_CHECK(gpuStreamWaitEvent(side[i][d], joined[i][i], 0));
        GPU_CHECK(gpuMemcpyPeerAsync(region[d] + i * slot, devices[d], src[i], devices[i], ce_bytes[i][d],
                                      side[i][d]));
        GPU_CHECK(gpuEventRecord(joined[i][d], side[i][d]));
      }
      for (int d = 0; d < R; ++d)
        if (d != i) GPU_CHECK(gpuStreamWaitEvent(main[i], joined[i][d], 0));
      return;
    }
    A2aParams p{};
    p.src = src[i];
    for (int d = 0; d < R; ++d) p.region[d] = region[d];
    p.rank = i;
    p.num_ranks = R;
    p.rows = rows;
    p.fanout = fanout;
    p.row_bytes = row_bytes;
    if (tma) {
      a2a_kernel<true><<<sms, kThreads, smem, main[i]>>>(p);
    } else {
      a2a_kernel<false><<<sms, kThreads, 0, main[i]>>>(p);
    }
    GPU_CHECK(gpuGetLastError());
  };
  // Warm-up round, then `iters` rounds back to back on every device; a device's time is its
  // events' span over the rounds, divided by them (the launch skew between devices counts once).
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    round(i);
  }
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    GPU_CHECK(gpuDeviceSynchronize());
  }
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    GPU_CHECK(gpuEventRecord(start[i], main[i]));
  }
  for (int k = 0; k < iters; ++k)
    for (int i = 0; i < R; ++i) {
      GPU_CHECK(gpuSetDevice(devices[i]));
      round(i);
    }
  NvlinkBenchResult res;
  res.bytes_per_device = static_cast<int64_t>(rows) * fanout * row_bytes;
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    GPU_CHECK(gpuEventRecord(stop[i], main[i]));
  }
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    GPU_CHECK(nvl_event_sync(stop[i]));
    float ms = 0;
    GPU_CHECK(nvl_event_elapsed(&ms, start[i], stop[i]));
    res.seconds.push_back(ms / 1e3 / iters);
  }
  // Spot check: the last byte of every slot a device received holds its sender's pattern.
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    for (int s = 0; s < R; ++s) {
      if (s == i) continue;
      uint8_t b = 0;
      const int64_t last = mode == "ce" ? ce_bytes[s][i] - 1 : (last_row(s, i) + 1) * row_bytes - 1;
      if (last < 0) continue;
      GPU_CHECK(gpuMemcpy(&b, region[i] + s * slot + last, 1, gpuMemcpyDeviceToHost));
      UCCL_EP_CHECK_ARG(b == s + 1, "bench nvlink: device ", devices[i], " holds ", static_cast<int>(b),
                        " where sender ", devices[s], " wrote ", s + 1);
    }
  }
  for (int i = 0; i < R; ++i) {
    GPU_CHECK(gpuSetDevice(devices[i]));
    for (int j = 0; j < R; ++j) {
      GPU_CHECK(gpuStreamDestroy(side[i][j]));
      GPU_CHECK(gpuEventDestroy(joined[i][j]));
    }
    GPU_CHECK(gpuStreamDestroy(main[i]));
    GPU_CHECK(gpuEventDestroy(start[i]));
    GPU_CHECK(gpuEventDestroy(stop[i]));
    GPU_CHECK(gpuFree(src[i]));
    GPU_CHECK(gpuFree(region[i]));
  }
  return res;
}

}  // namespace uccl_ep::gpu
