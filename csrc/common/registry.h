// The allocations `_C` has handed out to Python, so a binding can check the raw address it gets
// back before a kernel, a copy or a free uses it: an integer that is null, outside every such
// allocation, of the wrong kind, or whose range runs past the allocation's end raises
// InvalidArgument instead of faulting the process or the GPU context.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace uccl_ep {

enum class AllocKind : uint8_t {
  kDeviceBuffer,    // device_alloc_zeroed: a registered NVLink/RDMA buffer
  kIpcMapping,      // ipc_open_handle: a peer's buffer mapped into this process
  kHostStatus,      // host_status_alloc / internode status_alloc: mapped status words
  kHostRegion,      // HostRegion: host memory a transport registers
  kMappedCounters,  // Counters(mapped=True): software-atomic targets a GPU polls
};
const char* alloc_kind_name(AllocKind kind);

class AllocRegistry {
 public:
  static AllocRegistry& get();

  // Records [base, base + bytes); throws InvalidArgument when it overlaps a recorded range. The
  // same range of the same kind again counts one more reference (the driver maps a peer's
  // allocation opened twice at one address).
  void add(uintptr_t base, uint64_t bytes, AllocKind kind);
  // Drops one reference to the allocation starting exactly at `base` of `kind` (forgets it at
  // zero) and returns its size; throws InvalidArgument naming `what` when there is none (a
  // second free, or a made-up address).
  uint64_t remove(uintptr_t base, AllocKind kind, const char* what);
  // Throws InvalidArgument naming `what` unless [ptr, ptr + bytes) lies inside one recorded
  // allocation whose kind is one of `kinds` (bytes may be 0: ptr must still be inside).
  void check(uintptr_t ptr, uint64_t bytes, std::initializer_list<AllocKind> kinds, const char* what) const;
  // The size of the allocation starting exactly at `base` of `kind` (check()'d like remove()).
  uint64_t size_of(uintptr_t base, AllocKind kind, const char* what) const;
  // Whether [ptr, ptr + bytes) lies inside a recorded allocation of one of `kinds`.
  bool contains(uintptr_t ptr, uint64_t bytes, std::initializer_list<AllocKind> kinds) const;
  // Live allocations of `kind`: {count, bytes} (a teardown that leaks shows up here).
  std::pair<uint64_t, uint64_t> live(AllocKind kind) const;

 private:
  struct Entry {
    uint64_t bytes;
    AllocKind kind;
    uint32_t refs;
  };
  // The entry whose range holds ptr, or end(); mu_ held.
  std::map<uintptr_t, Entry>::const_iterator find(uintptr_t ptr) const;
  std::string describe(uintptr_t ptr) const;

  mutable std::mutex mu_;
  std::map<uintptr_t, Entry> by_base_;
};

}  // namespace uccl_ep
