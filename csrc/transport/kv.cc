#include "transport/kv.h"

#include <cstdlib>

#include "common/errors.h"

namespace uccl_ep::kv {

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string unhex(const std::string& h) {
  UCCL_EP_CHECK_ARG(h.size() % 2 == 0, "hex string of odd length ", h.size());
  auto val = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    UCCL_EP_THROW(InvalidArgument, "bad hex digit '", c, "'");
  };
  std::string out(h.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(val(h[2 * i]) * 16 + val(h[2 * i + 1]));
  return out;
}

std::string encode(const std::map<std::string, std::string>& fields) {
  std::string out;
  for (const auto& [k, v] : fields) {
    UCCL_EP_CHECK_ARG(k.find_first_of("=;") == std::string::npos && v.find_first_of("=;") == std::string::npos,
                      "bootstrap field '", k, "' holds '=' or ';'; hex-encode it");
    out += k + "=" + v + ";";
  }
  return out;
}

std::map<std::string, std::string> decode(const std::string& blob) {
  std::map<std::string, std::string> out;
  size_t pos = 0;
  while (pos < blob.size()) {
    size_t semi = blob.find(';', pos);
    size_t eq = blob.find('=', pos);
    UCCL_EP_CHECK_ARG(semi != std::string::npos && eq != std::string::npos && eq < semi,
                      "malformed bootstrap blob near offset ", pos, ": '", blob.substr(pos, 40), "'");
    out[blob.substr(pos, eq - pos)] = blob.substr(eq + 1, semi - eq - 1);
    pos = semi + 1;
  }
  return out;
}

const std::string& get(const std::map<std::string, std::string>& fields, const std::string& key,
                       const std::string& origin) {
  auto it = fields.find(key);
  if (it == fields.end()) {
    UCCL_EP_THROW(InvalidArgument, "bootstrap info from ", origin, " lacks '", key,
                  "'; all ranks must run the same uccl_ep_megatron version and transport");
  }
  return it->second;
}

uint64_t get_u64(const std::map<std::string, std::string>& fields, const std::string& key, const std::string& origin) {
  const std::string& v = get(fields, key, origin);
  char* end = nullptr;
  unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  UCCL_EP_CHECK_ARG(end && *end == '\0' && !v.empty(), "bootstrap field '", key, "' from ", origin, " is '", v,
                    "', not an unsigned integer");
  return x;
}

}  // namespace uccl_ep::kv
