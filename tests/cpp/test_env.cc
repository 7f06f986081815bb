#include <gtest/gtest.h>

#include <cstdlib>
#include <set>

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

}  // namespace
}  // namespace uccl_ep
