// POSIX shared-memory segment (RAII): the "wire" of the ipc transport between processes.
#pragma once

#include <cstddef>
#include <string>

namespace uccl_ep {

class SharedMemory {
 public:
  // create=true: a new zero-filled segment (fails if the name exists); false: attach to one.
  SharedMemory(const std::string& name, size_t bytes, bool create);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }

  // A name unique to this process and call ("/uccl_ep_<pid>_<n>_<tag>").
  static std::string unique_name(const std::string& tag);

 private:
  std::string name_;
  size_t bytes_;
  void* data_ = nullptr;
  bool owner_;
};

}  // namespace uccl_ep
