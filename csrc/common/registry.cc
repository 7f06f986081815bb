#include "common/registry.h"

#include <algorithm>
#include <cstdio>

#include "common/errors.h"

namespace uccl_ep {
namespace {

std::string hex(uintptr_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

const char* alloc_kind_name(AllocKind kind) {
  switch (kind) {
    case AllocKind::kDeviceBuffer:
      return "device buffer (device_alloc_zeroed)";
    case AllocKind::kIpcMapping:
      return "IPC mapping (ipc_open_handle)";
    case AllocKind::kHostStatus:
      return "status words (status_alloc)";
    case AllocKind::kHostRegion:
      return "host region (HostRegion)";
    case AllocKind::kMappedCounters:
      return "mapped counters (Counters)";
  }
  return "allocation";
}

AllocRegistry& AllocRegistry::get() {
  // Leaked on purpose: bindings may free allocations while static destructors run at exit.
  static AllocRegistry* r = new AllocRegistry();
  return *r;
}

std::map<uintptr_t, AllocRegistry::Entry>::const_iterator AllocRegistry::find(uintptr_t ptr) const {
  auto it = by_base_.upper_bound(ptr);
  if (it == by_base_.begin()) return by_base_.end();
  --it;
  return ptr - it->first < it->second.bytes ? it : by_base_.end();
}

std::string AllocRegistry::describe(uintptr_t ptr) const {
  auto it = find(ptr);
  if (it == by_base_.end()) return hex(ptr) + " lies in no live allocation of _C";
  return detail::concat(hex(ptr), " lies in a ", alloc_kind_name(it->second.kind), " of ", it->second.bytes,
                        " bytes at offset ", ptr - it->first);
}

void AllocRegistry::add(uintptr_t base, uint64_t bytes, AllocKind kind) {
  if (base == 0 || bytes == 0) UCCL_EP_THROW(InvalidArgument, "cannot record a null or empty ", alloc_kind_name(kind));
  std::lock_guard<std::mutex> lock(mu_);
  auto same = by_base_.find(base);
  if (same != by_base_.end() && same->second.bytes == bytes && same->second.kind == kind) {
    ++same->second.refs;
    return;
  }
  auto next = by_base_.lower_bound(base);
  const bool overlaps_next = next != by_base_.end() && next->first - base < bytes;
  if (overlaps_next || find(base) != by_base_.end()) {
    UCCL_EP_THROW(InvalidArgument, "a new ", alloc_kind_name(kind), " [", hex(base), ", +", bytes,
                  ") overlaps a recorded allocation: ", describe(overlaps_next ? next->first : base));
  }
  by_base_.emplace(base, Entry{bytes, kind, 1});
}

uint64_t AllocRegistry::remove(uintptr_t base, AllocKind kind, const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_base_.find(base);
  if (it == by_base_.end() || it->second.kind != kind) {
    UCCL_EP_THROW(InvalidArgument, what, ": ", hex(base), " is not the start of a live ", alloc_kind_name(kind), " (",
                  describe(base), "); pass the value the allocating call returned, once");
  }
  const uint64_t bytes = it->second.bytes;
  if (--it->second.refs == 0) by_base_.erase(it);
  return bytes;
}

uint64_t AllocRegistry::size_of(uintptr_t base, AllocKind kind, const char* what) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_base_.find(base);
  if (it == by_base_.end() || it->second.kind != kind) {
    UCCL_EP_THROW(InvalidArgument, what, ": ", hex(base), " is not the start of a live ", alloc_kind_name(kind), " (",
                  describe(base), ")");
  }
  return it->second.bytes;
}

bool AllocRegistry::contains(uintptr_t ptr, uint64_t bytes, std::initializer_list<AllocKind> kinds) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = find(ptr);
  if (it == by_base_.end()) return false;
  if (std::find(kinds.begin(), kinds.end(), it->second.kind) == kinds.end()) return false;
  return bytes <= it->second.bytes - (ptr - it->first);
}

void AllocRegistry::check(uintptr_t ptr, uint64_t bytes, std::initializer_list<AllocKind> kinds,
                          const char* what) const {
  if (ptr == 0) UCCL_EP_THROW(InvalidArgument, what, " is a null pointer");
  if (contains(ptr, bytes, kinds)) return;
  std::string want;
  for (AllocKind k : kinds) want += detail::concat(want.empty() ? "" : " or ", alloc_kind_name(k));
  std::lock_guard<std::mutex> lock(mu_);
  UCCL_EP_THROW(InvalidArgument, what, ": [", hex(ptr), ", +", bytes, ") must lie inside one ", want, ", but ",
                describe(ptr));
}

std::pair<uint64_t, uint64_t> AllocRegistry::live(AllocKind kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t count = 0, bytes = 0;
  for (const auto& kv : by_base_) {
    if (kv.second.kind != kind) continue;
    ++count;
    bytes += kv.second.bytes;
  }
  return {count, bytes};
}

}  // namespace uccl_ep
