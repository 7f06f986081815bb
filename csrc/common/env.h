// Typed view of the environment registry (env_params.def), read once per process.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace uccl_ep {

struct Env {
#define UCCL_EP_ENV_INT(field, name, def, doc) int64_t field = def;
#define UCCL_EP_ENV_STR(field, name, def, doc) std::string field = def;
#define UCCL_EP_ENV_BOOL(field, name, def, doc) bool field = def;
#include "common/env_params.def"
#undef UCCL_EP_ENV_INT
#undef UCCL_EP_ENV_STR
#undef UCCL_EP_ENV_BOOL

  // Parses the current process environment; throws InvalidArgument naming the variable
  // when a value does not parse as its declared type. With `problems`, a value that does not
  // parse keeps its default and its error is appended there instead (diagnostics: doctor).
  static Env load(std::vector<std::pair<std::string, std::string>>* problems = nullptr);
};

// The process-wide values, loaded on first use. Tests that change the environment call
// Env::load() directly instead.
const Env& env();

struct EnvParam {
  std::string name;
  std::string type;  // "int", "str" or "bool"
  std::string default_value;
  std::string doc;
};

// Every registered variable, in declaration order.
const std::vector<EnvParam>& env_registry();

}  // namespace uccl_ep
