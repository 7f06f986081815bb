// One exception hierarchy for the whole core. The bindings translate each class to the
// Python exception of the same role in uccl_ep_megatron.core.errors, so a C++ failure reaches
// the user as a typed, catchable Python error with its context intact.
#pragma once

#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>
#include <stdexcept>
#include <string>

namespace uccl_ep {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed a value the core cannot use (bad size, offset out of range, ...).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A bounded wait ran out; the message names the rank / channel / index that stalled.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A transport (verbs, EFA, ipc) or a system call failed.
class TransportError : public Error {
 public:
  using Error::Error;
};

// A CUDA/HIP runtime call failed.
class GpuError : public Error {
 public:
  using Error::Error;
};

// The build or the machine lacks a capability (no GPU toolchain, no libibverbs, ...).
class Unsupported : public Error {
 public:
  using Error::Error;
};

namespace detail {
// Messages are built without iostreams: on the device image the extension runs beside another
// libstdc++ and std::ostringstream crashed there, which would turn every error into a segfault.
inline void append(std::string& out, const std::string& v) { out += v; }
inline void append(std::string& out, const char* v) { out += v ? v : "(null)"; }
inline void append(std::string& out, char v) { out += v; }
inline void append(std::string& out, bool v) { out += v ? "true" : "false"; }
inline void append(std::string& out, const void* v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", v);
  out += buf;
}
template <typename T>
inline std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>> append(
    std::string& out, T v) {
  out += std::to_string(v);
}
template <typename T>
inline std::enable_if_t<std::is_enum_v<T>> append(std::string& out, T v) {
  out += std::to_string(static_cast<std::underlying_type_t<T>>(v));
}

template <typename... Args>
std::string concat(Args&&... args) {
  std::string out;
  (append(out, std::forward<Args>(args)), ...);
  return out;
}
}  // namespace detail

}  // namespace uccl_ep

// Throw `kind` with a message built from the streamable arguments and the call site.
#define UCCL_EP_THROW(kind, ...) \
  throw ::uccl_ep::kind(::uccl_ep::detail::concat(__VA_ARGS__, " [", __FILE__, ":", __LINE__, "]"))

// Argument check: throws InvalidArgument naming the failed condition.
#define UCCL_EP_CHECK_ARG(cond, ...)                                                  \
  do {                                                                                \
    if (!(cond)) UCCL_EP_THROW(InvalidArgument, "check `" #cond "` failed: ", __VA_ARGS__); \
  } while (0)

// System call returning -1/errno style failure.
#define UCCL_EP_SYSCHECK(expr, what)                                                         \
  do {                                                                                       \
    if ((expr) < 0) {                                                                        \
      int err__ = errno;                                                                     \
      UCCL_EP_THROW(TransportError, what, " failed: ", std::string(::strerror(err__)));      \
    }                                                                                        \
  } while (0)
