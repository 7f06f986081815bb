#include "common/log.h"

#include <cstdio>
#include <mutex>

#include "common/env.h"
#include "common/errors.h"

namespace uccl_ep {

LogLevel log_level() {
  static const LogLevel level = [] {
    const std::string& s = env().log_level;
    if (s == "ERROR") return LogLevel::kError;
    if (s == "INFO") return LogLevel::kInfo;
    if (s == "DEBUG") return LogLevel::kDebug;
    if (s == "WARN" || s.empty()) return LogLevel::kWarn;
    std::fprintf(stderr, "[uccl_ep WARN] UCCL_EP_LOG_LEVEL='%s' is unknown; using WARN\n", s.c_str());
    return LogLevel::kWarn;
  }();
  return level;
}

void log_write(LogLevel level, const std::string& msg) {
  static std::mutex mu;
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "[uccl_ep %s] %s\n", names[static_cast<int>(level)], msg.c_str());
}

}  // namespace uccl_ep
