#include "common/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "common/errors.h"

namespace uccl_ep {
namespace {

// A variable's text without surrounding blanks; a blank variable (`VAR=` in a shell) means unset.
std::string trimmed(const char* v) {
  std::string t(v);
  const size_t a = t.find_first_not_of(" \t\n");
  if (a == std::string::npos) return "";
  return t.substr(a, t.find_last_not_of(" \t\n") - a + 1);
}

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

bool one_of(const std::string& v, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return v == a; });
}

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// The values each variable accepts beyond its type. Checked by Env::load, so every use of the
// library (Buffer(), the proxies) rejects exactly what `uccl-ep-megatron doctor` flags (which
// loads with `problems`). `reject` records (or throws) the message and restores the default.
template <typename Reject>
void validate(Env& e, Reject reject) {
  const Env d;
  // An empty value means "unset" for the choices below.
  if (e.log_level.empty()) e.log_level = d.log_level;
  e.log_level = upper(e.log_level);
  if (e.log_level == "WARNING") e.log_level = "WARN";  // Python's spelling of the same level
  if (!one_of(e.log_level, {"ERROR", "WARN", "INFO", "DEBUG"})) {
    reject("UCCL_EP_LOG_LEVEL", "is not a log level; use ERROR, WARN (or WARNING), INFO or DEBUG",
           [&] { e.log_level = d.log_level; });
  }
  if (e.backend.empty()) e.backend = d.backend;
  if (!one_of(e.backend, {"auto", "kernels", "reference"})) {
    reject("UCCL_EP_BACKEND", "is not a backend; use auto, kernels or reference", [&] { e.backend = d.backend; });
  }
  if (e.transport.empty()) e.transport = d.transport;
  if (!one_of(e.transport, {"auto", "verbs", "ipc"})) {
    reject("UCCL_EP_TRANSPORT", "is not a transport; use auto, verbs or ipc", [&] { e.transport = d.transport; });
  }
  if (e.ipc_delivery.empty()) e.ipc_delivery = d.ipc_delivery;
  if (!one_of(e.ipc_delivery, {"store", "copy"})) {
    reject("UCCL_EP_IPC_DELIVERY", "is not an ipc delivery; use store or copy",
           [&] { e.ipc_delivery = d.ipc_delivery; });
  }
  if (e.proxy_ordering.empty()) e.proxy_ordering = d.proxy_ordering;
  if (!one_of(e.proxy_ordering, {"receiver", "sender", "none"})) {
    reject("UCCL_EP_PROXY_ORDERING", "is not an ordering; use receiver, sender or none",
           [&] { e.proxy_ordering = d.proxy_ordering; });
  }
  if (e.timeout_ms <= 0) {
    reject("UCCL_EP_TIMEOUT_MS",
           "must be a positive number of milliseconds: it bounds every wait (0 or less would wait forever or "
           "fail every call); unset it for the default",
           [&] { e.timeout_ms = d.timeout_ms; });
  }
  if (e.num_proxy_threads < 1) {
    reject("UCCL_EP_NUM_PROXY_THREADS", "must be at least 1 (CPU proxy threads per GPU)",
           [&] { e.num_proxy_threads = d.num_proxy_threads; });
  }
  if (e.proxy_idle_us < 0) {
    reject("UCCL_EP_PROXY_IDLE_US", "must be 0 (always spin) or the microseconds of idling before a proxy naps",
           [&] { e.proxy_idle_us = d.proxy_idle_us; });
  }
  if (e.recv_arena_bytes < 0) {
    reject("UCCL_EP_RECV_ARENA_BYTES", "must be 0 (no arena: staged path only) or a positive byte count",
           [&] { e.recv_arena_bytes = d.recv_arena_bytes; });
  }
  if (e.fifo_capacity < 2 || (e.fifo_capacity & (e.fifo_capacity - 1)) != 0) {
    reject("UCCL_EP_FIFO_CAPACITY", "must be a power of two >= 2 (slots per FIFO channel), e.g. 1024",
           [&] { e.fifo_capacity = d.fifo_capacity; });
  }
  if (e.ranks_per_node < 0) {
    reject("UCCL_EP_RANKS_PER_NODE", "must be 0 (from the launcher) or the number of ranks per (virtual) node",
           [&] { e.ranks_per_node = d.ranks_per_node; });
  }
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
#define UCCL_EP_ENV_STR(field, name, def, doc)  \
  if (const char* v = std::getenv(name)) {      \
    if (const std::string t = trimmed(v); !t.empty()) e.field = t; \
  }
#define UCCL_EP_ENV_BOOL(field, name, def, doc) \
  if (const char* v = std::getenv(name)) parse(name, [&] { return parse_bool(name, v); }, e.field);
#include "common/env_params.def"
#undef UCCL_EP_ENV_INT
#undef UCCL_EP_ENV_STR
#undef UCCL_EP_ENV_BOOL
  validate(e, [problems](const char* name, const char* rule, auto restore) {
    const char* raw = std::getenv(name);
    std::string msg = detail::concat(name, "='", raw ? raw : "", "' ", rule);
    if (!problems) UCCL_EP_THROW(InvalidArgument, msg);
    problems->emplace_back(name, msg);
    restore();
  });
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
