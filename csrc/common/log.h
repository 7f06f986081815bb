// Minimal leveled logging for the C++ core; the level comes from UCCL_EP_LOG_LEVEL.
#pragma once

#include <sstream>
#include <string>

namespace uccl_ep {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

LogLevel log_level();
void log_write(LogLevel level, const std::string& msg);

}  // namespace uccl_ep

#define UCCL_EP_LOG(level, ...)                                                  \
  do {                                                                           \
    if (static_cast<int>(::uccl_ep::LogLevel::level) <=                          \
        static_cast<int>(::uccl_ep::log_level())) {                              \
      ::uccl_ep::log_write(::uccl_ep::LogLevel::level,                           \
                           ::uccl_ep::detail::concat(__VA_ARGS__));              \
    }                                                                            \
  } while (0)
