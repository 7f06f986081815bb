// Where to pin proxy threads: the CPUs of the GPU's NUMA node, read from sysfs.
#include <cctype>

#include "common/errors.h"
#include "proxy/proxy.h"
#include "proxy/text_util.h"

namespace uccl_ep {

std::vector<int> parse_cpulist(const std::string& s) {
  std::vector<int> out;
  for (const std::string& raw : text::split(s, ',')) {
    std::string part = text::strip(raw);
    if (part.empty()) continue;
    size_t dash = part.find('-');
    int lo = 0, hi = 0;
    bool ok = text::parse_int(part.substr(0, dash), &lo);
    hi = lo;
    if (ok && dash != std::string::npos) ok = text::parse_int(part.substr(dash + 1), &hi);
    if (!ok || lo < 0 || hi < lo) {
      UCCL_EP_THROW(InvalidArgument, "cpulist '", s, "' has a malformed entry '", part, "'");
    }
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  return out;
}

std::vector<int> numa_cpus_of_pci(const std::string& pci_bus_id, const std::string& sysfs_root) {
  std::string id = pci_bus_id;
  for (auto& ch : id) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  // CUDA reports "00000000:3b:00.0"; sysfs uses a 4-digit domain.
  if (id.size() > 12 && id.find(':') == 8) id = id.substr(4);
  int node = -1;
  if (!text::parse_int(text::strip(text::read_first_line(sysfs_root + "/bus/pci/devices/" + id + "/numa_node")),
                       &node) ||
      node < 0) {
    return {};
  }
  std::string list = text::read_first_line(sysfs_root + "/devices/system/node/node" + std::to_string(node) + "/cpulist");
  if (text::strip(list).empty()) return {};
  return parse_cpulist(list);
}

}  // namespace uccl_ep
