// Checks of the raw addresses a kernel launch gets from Python, before anything runs on the
// GPU: a bad one must raise, never fault the process or the CUDA context. Buffers and status
// words must be `_C`'s own live allocations of the right size; tensor pointers (torch owns
// them) must be non-null wherever the sizes say the kernels touch them.
#pragma once

#ifdef UCCL_EP_WITH_GPU
#include <cstdint>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/registry.h"
#include "kernels/intranode.h"

namespace uccl_ep::bindings {

inline void check_buffers(const std::vector<intptr_t>& buffers, int num_ranks, int64_t bytes, const char* what) {
  UCCL_EP_CHECK_ARG(static_cast<int>(buffers.size()) == num_ranks, what, ": got ", buffers.size(),
                    " buffers for ", num_ranks, " ranks");
  UCCL_EP_CHECK_ARG(bytes > 0, what, ": buffer_bytes=", bytes, " must be positive");
  const auto& registry = AllocRegistry::get();
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto ptr = static_cast<uintptr_t>(buffers[i]);
    const auto need = static_cast<uint64_t>(bytes);
    // The message (and its string) only on failure: these checks run on every launch.
    if (registry.contains(ptr, need, {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping})) continue;
    const std::string name = detail::concat(what, ": buffers[", i, "]");
    registry.check(ptr, need, {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping}, name.c_str());
  }
}

inline void check_status(intptr_t status, const char* what) {
  AllocRegistry::get().check(static_cast<uintptr_t>(status), kernels::kStatusWords * sizeof(int64_t),
                             {AllocKind::kHostStatus}, what);
}

// check_status naming `what` + ": status", the name built only on failure.
inline void check_status_of(intptr_t status, const char* what) {
  const uint64_t bytes = kernels::kStatusWords * sizeof(int64_t);
  if (AllocRegistry::get().contains(static_cast<uintptr_t>(status), bytes, {AllocKind::kHostStatus})) return;
  check_status(status, (std::string(what) + ": status").c_str());
}

inline void check_ptr(intptr_t ptr, bool used, const char* what) {
  if (used && ptr == 0) UCCL_EP_THROW(InvalidArgument, what, " is a null pointer but the sizes say it is used");
}

}  // namespace uccl_ep::bindings
#endif
