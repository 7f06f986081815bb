// Tiny "key=value;" codec for the bootstrap blobs transports exchange (values are hex-escaped
// when they may hold arbitrary bytes).
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace uccl_ep::kv {

std::string hex(const std::string& bytes);
std::string unhex(const std::string& hex);
std::string encode(const std::map<std::string, std::string>& fields);
std::map<std::string, std::string> decode(const std::string& blob);
// The value of `key`; throws InvalidArgument naming the key and the blob's origin when missing.
const std::string& get(const std::map<std::string, std::string>& fields, const std::string& key,
                       const std::string& origin);
uint64_t get_u64(const std::map<std::string, std::string>& fields, const std::string& key, const std::string& origin);

}  // namespace uccl_ep::kv
