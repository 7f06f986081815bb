#include "transport/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "common/errors.h"

namespace uccl_ep {

SharedMemory::SharedMemory(const std::string& name, size_t bytes, bool create)
    : name_(name), bytes_(bytes), owner_(create) {
  UCCL_EP_CHECK_ARG(!name.empty() && name[0] == '/', "shared-memory name '", name, "' must start with '/'");
  UCCL_EP_CHECK_ARG(bytes > 0, "shared-memory segment '", name, "' needs a positive size");
  int fd = ::shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    int err = errno;
    UCCL_EP_THROW(TransportError, "shm_open('", name, "') failed: ", std::strerror(err),
                  create ? " (is /dev/shm mounted and writable?)" : " (did the peer process create it and is it alive?)");
  }
  if (create && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    UCCL_EP_THROW(TransportError, "ftruncate of shared memory '", name, "' to ", bytes,
                  " bytes failed: ", std::strerror(err), " (is /dev/shm large enough?)");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    if (create) ::shm_unlink(name.c_str());
    UCCL_EP_THROW(TransportError, "mmap of shared memory '", name, "' failed: ", std::strerror(err));
  }
  data_ = p;
}

SharedMemory::~SharedMemory() {
  if (data_) ::munmap(data_, bytes_);
  if (owner_) ::shm_unlink(name_.c_str());
}

std::string SharedMemory::unique_name(const std::string& tag) {
  static std::atomic<uint64_t> counter{0};
  // Plain string building (no iostreams) on every success path of the core; see text_util.h.
  return "/uccl_ep_" + std::to_string(::getpid()) + "_" + std::to_string(counter.fetch_add(1)) + "_" + tag;
}

}  // namespace uccl_ep
