#include "common/log.h"

#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/env.h"
#include "common/errors.h"

namespace uccl_ep {

LogLevel log_level() {
  static const LogLevel level = [] {
    // Lenient: logging must never throw. An invalid level keeps the default (WARN); every
    // other use of the library raises on it (Env::load), and doctor flags it.
    std::vector<std::pair<std::string, std::string>> problems;
    const std::string s = Env::load(&problems).log_level;
    if (s == "ERROR") return LogLevel::kError;
    if (s == "INFO") return LogLevel::kInfo;
    if (s == "DEBUG") return LogLevel::kDebug;
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
