// Small string helpers built on std::string / stdio only. The core's success paths avoid
// iostreams: on the device image (extension built by GCC 13 in a process whose libstdc++ comes
// from elsewhere) constructing a std::ostringstream / std::ifstream crashed the process.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace uccl_ep::text {

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t next = s.find(sep, pos);
    if (next == std::string::npos) next = s.size();
    out.push_back(s.substr(pos, next - pos));
    pos = next + 1;
  }
  return out;
}

inline std::string strip(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// Whole-string base-10 int; false on anything else.
inline bool parse_int(const std::string& s, int* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (*end != '\0' || v < -2147483647L || v > 2147483647L) return false;
  *out = static_cast<int>(v);
  return true;
}

// First line of a file ("" when unreadable).
inline std::string read_first_line(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return "";
  char buf[4096];
  std::string out;
  if (std::fgets(buf, sizeof(buf), f)) out = buf;
  std::fclose(f);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

inline std::string hex64(unsigned long long v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", v);
  return buf;
}

}  // namespace uccl_ep::text
