#include "common/env.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/errors.h"

namespace uccl_ep {
namespace {

int64_t parse_int(const char* name, const char* raw) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(raw, &end, 0);
  if (errno != 0 || end == raw || *end != '\0') {
    UCCL_EP_THROW(InvalidArgument, name, "='", raw, "' is not an integer; unset it or give a whole number");
  }
  return static_cast<int64_t>(v);
}

bool parse_bool(const char* name, const char* raw) {
  std::string s(raw);
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off" || s.empty()) return false;
  UCCL_EP_THROW(InvalidArgument, name, "='", raw, "' is not a boolean; use 0/1, true/false, yes/no or on/off");
}

}  // namespace

Env Env::load(std::vector<std::pair<std::string, std::string>>* problems) {
  Env e;
  // Strict by default; with `problems` a bad value is recorded and its default kept.
  auto parse = [problems](const char* name, auto fn, auto& field) {
    try {
      field = fn();
    } catch (const InvalidArgument& err) {
      if (!problems) throw;
      problems->emplace_back(name, err.what());
    }
  };
#define UCCL_EP_ENV_INT(field, name, def, doc) \
  if (const char* v = std::getenv(name)) parse(name, [&] { return parse_int(name, v); }, e.field);
#define UCCL_EP_ENV_STR(field, name, def, doc) \
  if (const char* v = std::getenv(name)) e.field = v;
#define UCCL_EP_ENV_BOOL(field, name, def, doc) \
  if (const char* v = std::getenv(name)) parse(name, [&] { return parse_bool(name, v); }, e.field);
#include "common/env_params.def"
#undef UCCL_EP_ENV_INT
#undef UCCL_EP_ENV_STR
#undef UCCL_EP_ENV_BOOL
  return e;
}

const Env& env() {
  static const Env instance = Env::load();
  return instance;
}

const std::vector<EnvParam>& env_registry() {
  static const std::vector<EnvParam> params = {
#define UCCL_EP_ENV_INT(field, name, def, doc) {name, "int", #def, doc},
#define UCCL_EP_ENV_STR(field, name, def, doc) {name, "str", def, doc},
#define UCCL_EP_ENV_BOOL(field, name, def, doc) {name, "bool", (def) ? "1" : "0", doc},
#include "common/env_params.def"
#undef UCCL_EP_ENV_INT
#undef UCCL_EP_ENV_STR
#undef UCCL_EP_ENV_BOOL
  };
  return params;
}

}  // namespace uccl_ep
