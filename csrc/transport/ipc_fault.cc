#include "transport/ipc_fault.h"

#include <cerrno>
#include <cstdlib>

#include "common/errors.h"

namespace uccl_ep {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

uint64_t parse_count(const std::string& fault, const std::string& key, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
  if (value.empty() || value[0] == '-' || errno != 0 || *end != '\0') {
    UCCL_EP_THROW(InvalidArgument, "UCCL_EP_IPC_FAULT: '", key, "=", value, "' in '", fault,
                  "' is not a non-negative integer");
  }
  return v;
}

}  // namespace

const char* wc_status_name(int status) {
  switch (status) {
    case kWcSuccess:
      return "IBV_WC_SUCCESS";
    case kWcWrFlushErr:
      return "IBV_WC_WR_FLUSH_ERR (5, work request flushed)";
    case kWcRetryExcErr:
      return "IBV_WC_RETRY_EXC_ERR (12, transport retry counter exceeded)";
    default:
      return "unknown completion status";
  }
}

std::vector<IpcFault> parse_ipc_faults(const std::string& spec) {
  std::vector<IpcFault> faults;
  for (const std::string& raw : split(spec, ';')) {
    const std::string part = trim(raw);
    if (part.empty()) continue;
    const size_t colon = part.find(':');
    const std::string kind = trim(part.substr(0, colon));
    IpcFault f;
    if (kind == "retry_exceeded") {
      f.kind = IpcFault::kRetryExceeded;
    } else if (kind == "dead_peer") {
      f.kind = IpcFault::kDeadPeer;
    } else {
      UCCL_EP_THROW(InvalidArgument, "UCCL_EP_IPC_FAULT: unknown fault '", kind, "' in '", part,
                    "'; use retry_exceeded:rank=R,qp=T,after=N or dead_peer:rank=R,after=N");
    }
    bool has_rank = false, has_after = false;
    const std::string args = colon == std::string::npos ? "" : part.substr(colon + 1);
    for (const std::string& kv_raw : split(args, ',')) {
      const std::string kv = trim(kv_raw);
      if (kv.empty()) continue;
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) {
        UCCL_EP_THROW(InvalidArgument, "UCCL_EP_IPC_FAULT: '", kv, "' in '", part, "' is not key=value");
      }
      const std::string key = trim(kv.substr(0, eq)), value = trim(kv.substr(eq + 1));
      const uint64_t v = parse_count(part, key, value);
      if (key == "rank") {
        f.rank = static_cast<uint32_t>(v), has_rank = true;
      } else if (key == "after") {
        f.after = v, has_after = true;
      } else if (key == "detect_ms") {
        f.detect_ms = v;
      } else if (key == "qp" && f.kind == IpcFault::kRetryExceeded) {
        f.qp = static_cast<int32_t>(v);
      } else if (key == "peer" && f.kind == IpcFault::kRetryExceeded) {
        f.peer = static_cast<int32_t>(v);
      } else {
        UCCL_EP_THROW(InvalidArgument, "UCCL_EP_IPC_FAULT: '", key, "' is not a parameter of ", kind, " (in '",
                      part, "')");
      }
    }
    if (!has_rank || !has_after) {
      UCCL_EP_THROW(InvalidArgument, "UCCL_EP_IPC_FAULT: '", part, "' needs rank= and after=");
    }
    faults.push_back(f);
  }
  return faults;
}

}  // namespace uccl_ep
