// Errors, the environment registry and build facts.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/registry.h"

namespace py = pybind11;

namespace uccl_ep::bindings {

void bind_common(py::module_& m) {
  // C++ exceptions surface as the Python classes of uccl_ep_megatron.core.errors, so callers catch
  // one hierarchy whichever side raised.
  // Leaked on purpose: a static py::object would be released after the interpreter is gone.
  static py::object& errors = *new py::object(py::module_::import("uccl_ep_megatron.core.errors"));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      py::set_error(errors.attr("InvalidInputError"), e.what());
    } catch (const TimeoutError& e) {
      py::set_error(errors.attr("CommTimeoutError"), e.what());
    } catch (const TransportError& e) {
      py::set_error(errors.attr("TransportError"), e.what());
    } catch (const GpuError& e) {
      py::set_error(errors.attr("GpuError"), e.what());
    } catch (const Unsupported& e) {
      py::set_error(errors.attr("UnsupportedError"), e.what());
    } catch (const Error& e) {
      py::set_error(errors.attr("UcclEpError"), e.what());
    }
  });

  m.def(
      "live_allocations",
      [] {
        py::dict out;
        const std::pair<AllocKind, const char*> kinds[] = {
            {AllocKind::kDeviceBuffer, "device_buffer"}, {AllocKind::kIpcMapping, "ipc_mapping"},
            {AllocKind::kHostStatus, "host_status"},     {AllocKind::kHostRegion, "host_region"},
            {AllocKind::kMappedCounters, "mapped_counters"}};
        for (const auto& [kind, name] : kinds) {
          const auto [count, bytes] = AllocRegistry::get().live(kind);
          out[name] = py::make_tuple(count, bytes);
        }
        return out;
      },
      "{kind: (count, bytes)} of the allocations _C has handed out and not yet freed.");
  m.def(
      "env_registry",
      [] {
        py::list out;
        for (const auto& p : env_registry()) {
          py::dict d;
          d["name"] = p.name;
          d["type"] = p.type;
          d["default"] = p.default_value;
          d["doc"] = p.doc;
          out.append(d);
        }
        return out;
      },
      "Every environment variable the core reads: name, type, default and doc.");

  m.def(
      "env_problems",
      [] {
        std::vector<std::pair<std::string, std::string>> problems;
        (void)Env::load(&problems);
        py::dict d;
        for (const auto& [name, msg] : problems) d[py::str(name)] = msg;
        return d;
      },
      "Variables set to a value that does not parse, each with the error the core would raise.");
  m.def(
      "env_effective",
      [](bool lenient) {
        // Re-read now so Python sees the current environment, not the cached first read.
        std::vector<std::pair<std::string, std::string>> problems;
        Env e = Env::load(lenient ? &problems : nullptr);
        py::dict d;
#define UCCL_EP_ENV_INT(field, name, def, doc) d[name] = e.field;
#define UCCL_EP_ENV_STR(field, name, def, doc) d[name] = e.field;
#define UCCL_EP_ENV_BOOL(field, name, def, doc) d[name] = e.field;
#include "common/env_params.def"
#undef UCCL_EP_ENV_INT
#undef UCCL_EP_ENV_STR
#undef UCCL_EP_ENV_BOOL
        return d;
      },
      py::arg("lenient") = false,
      "Effective values of the registry's variables, parsed from the current environment "
      "(lenient: a value that does not parse shows its default instead of raising).");

  py::dict build;
#ifdef UCCL_EP_WITH_CUDA
  build["gpu"] = "cuda";
#elif defined(UCCL_EP_WITH_HIP)
  build["gpu"] = "hip";
#else
  build["gpu"] = "none";
#endif
#ifdef UCCL_EP_WITH_VERBS
  build["verbs"] = true;
#else
  build["verbs"] = false;
#endif
  m.attr("build_info") = build;
}

}  // namespace uccl_ep::bindings
