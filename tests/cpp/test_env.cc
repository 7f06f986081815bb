#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/env.h"
#include "common/errors.h"

namespace uccl_ep {
namespace {

TEST(Env, DefaultsWhenUnset) {
  ::unsetenv("UCCL_EP_NUM_PROXY_THREADS");
  EXPECT_EQ(Env::load().num_proxy_threads, 4);
}

TEST(Env, ParsesIntAndRejectsGarbage) {
  ::setenv("UCCL_EP_NUM_PROXY_THREADS", "8", 1);
  EXPECT_EQ(Env::load().num_proxy_threads, 8);
  ::setenv("UCCL_EP_NUM_PROXY_THREADS", "eight", 1);
  try {
    Env::load();
    FAIL() << "garbage accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("UCCL_EP_NUM_PROXY_THREADS"), std::string::npos);
  }
  ::unsetenv("UCCL_EP_NUM_PROXY_THREADS");
}

TEST(Env, RegistryNamesAreUnique) {
  std::set<std::string> names;
  for (const auto& p : env_registry()) {
    EXPECT_TRUE(names.insert(p.name).second) << p.name << " declared twice";
    EXPECT_FALSE(p.doc.empty()) << p.name << " has no doc";
  }
}

// Values of the right type that the library cannot use: Env::load rejects each, naming the
// variable, and the lenient load (doctor) reports the same message and keeps the default.
TEST(Env, RejectsValuesOutOfRange) {
  const std::pair<const char*, const char*> bad[] = {
      {"UCCL_EP_TIMEOUT_MS", "0"},          {"UCCL_EP_TIMEOUT_MS", "-1"},
      {"UCCL_EP_NUM_PROXY_THREADS", "0"},   {"UCCL_EP_RECV_ARENA_BYTES", "-1"},
      {"UCCL_EP_FIFO_CAPACITY", "1000"},    {"UCCL_EP_FIFO_CAPACITY", "1"},
      {"UCCL_EP_RANKS_PER_NODE", "-1"},     {"UCCL_EP_LOG_LEVEL", "foo"},
      {"UCCL_EP_BACKEND", "foo"},           {"UCCL_EP_TRANSPORT", "foo"},
      {"UCCL_EP_PROXY_ORDERING", "foo"},    {"UCCL_EP_PROXY_IDLE_US", "-1"},
  };
  const Env defaults;
  for (const auto& [name, value] : bad) {
    ::setenv(name, value, 1);
    try {
      Env::load();
      ADD_FAILURE() << name << "=" << value << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(name) + "='" + value + "'"), std::string::npos) << e.what();
    }
    std::vector<std::pair<std::string, std::string>> problems;
    const Env lenient = Env::load(&problems);
    ASSERT_EQ(problems.size(), 1u) << name << "=" << value;
    EXPECT_EQ(problems[0].first, name);
    EXPECT_EQ(lenient.timeout_ms, defaults.timeout_ms);
    EXPECT_EQ(lenient.fifo_capacity, defaults.fifo_capacity);
    EXPECT_EQ(lenient.backend, defaults.backend);
    ::unsetenv(name);
  }
}

TEST(Env, AcceptsBothSpellingsOfWarn) {
  for (const char* v : {"WARN", "WARNING", "warning", "warn"}) {
    ::setenv("UCCL_EP_LOG_LEVEL", v, 1);
    EXPECT_EQ(Env::load().log_level, "WARN") << v;
  }
  ::setenv("UCCL_EP_LOG_LEVEL", "debug", 1);
  EXPECT_EQ(Env::load().log_level, "DEBUG");
  ::unsetenv("UCCL_EP_LOG_LEVEL");
}

}  // namespace
}  // namespace uccl_ep
