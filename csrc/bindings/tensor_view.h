// Torch tensors as typed views, for the per-call bindings. `_C` does not link libtorch
// (docs/architecture.md, "Build"): a tensor is read through the Python protocol every torch version keeps
// (`data_ptr()`, `shape`, `dtype`) into a view (base address, up to three sizes, dtype), and a
// view is checked against the shape and dtypes a call expects before anything is launched, with
// a message that names the argument. Torch owns the memory: contiguity is the caller's part.
// Used by intranode_calls.cc and internode_calls.cc.
#pragma once

#ifdef UCCL_EP_WITH_GPU
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "kernels/intranode.h"

namespace uccl_ep::bindings::views {

namespace py = pybind11;

// What a call needs of a torch dtype. Codes are ours; torch's dtype objects are singletons, so
// they are looked up by identity after the first sight of each.
enum class Dt : uint8_t {
  kOther,
  kBool,
  kUInt8,
  kInt32,
  kInt64,
  kFloat32,
  kBFloat16,
  kFloat16,
  kE4m3,
  kE4m3Fnuz
};

struct DtypeInfo {
  Dt dt = Dt::kOther;
  int itemsize = 0;
  uint64_t nan = 0;  // the 8-byte fill word of NaN in this dtype (floating types only)
  std::string name;  // "bfloat16", for messages
};

// `unit` (of `bytes` bytes) repeated to fill 8 bytes, little-endian.
inline uint64_t repeat(uint64_t unit, int bytes) {
  uint64_t out = 0;
  for (int i = 0; i < 8; i += bytes) out |= unit << (8 * i);
  return out;
}

inline DtypeInfo describe_dtype(PyObject* dtype) {
  py::handle h(dtype);
  DtypeInfo d;
  d.name = py::str(h).cast<std::string>();
  if (d.name.rfind("torch.", 0) == 0) d.name = d.name.substr(6);
  d.itemsize = h.attr("itemsize").cast<int>();
  // NaN as torch converts float("nan"): the positive quiet NaN of each format (e4m3fn has
  // one NaN, 0x7F with the sign clear; e4m3fnuz's only NaN is 0x80).
  struct Known {
    const char* name;
    Dt dt;
    uint64_t nan_unit;
  };
  static const Known known[] = {
      {"bool", Dt::kBool, 0},
      {"uint8", Dt::kUInt8, 0},
      {"int32", Dt::kInt32, 0},
      {"int64", Dt::kInt64, 0},
      {"float32", Dt::kFloat32, 0x7FC00000u},
      {"bfloat16", Dt::kBFloat16, 0x7FC0u},
      {"float16", Dt::kFloat16, 0x7E00u},
      {"float8_e4m3fn", Dt::kE4m3, 0x7Fu},
      {"float8_e4m3fnuz", Dt::kE4m3Fnuz, 0x80u},
  };
  for (const Known& kn : known) {
    if (d.name == kn.name) {
      d.dt = kn.dt;
      d.nan = repeat(kn.nan_unit, d.itemsize);
    }
  }
  return d;
}

inline const DtypeInfo& dtype_info(PyObject* dtype) {
  // A handful of entries; a deque keeps the references views hold valid as it grows.
  static std::deque<std::pair<PyObject*, DtypeInfo>> seen;
  for (const auto& [obj, info] : seen)
    if (obj == dtype) return info;
  Py_INCREF(dtype);  // kept for the process: the identity key must stay valid
  seen.emplace_back(dtype, describe_dtype(dtype));
  return seen.back().second;
}

inline PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (!o) throw py::error_already_set();
  return o;
}

constexpr int kMaxViewDims = 3;

// A tensor as the kernels see it: base address, up to three sizes, dtype. `none` for None.
struct TensorView {
  bool none = true;
  intptr_t ptr = 0;
  int dim = 0;
  int64_t size[kMaxViewDims] = {0, 0, 0};
  const DtypeInfo* dtype = nullptr;

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < dim; ++i) n *= size[i];
    return n;
  }
  int64_t bytes() const { return none ? 0 : numel() * dtype->itemsize; }
};

inline TensorView view_of(py::handle t, const char* name) {
  TensorView v;
  if (t.is_none()) return v;
  static PyObject* const s_data_ptr = interned("data_ptr");
  static PyObject* const s_shape = interned("shape");
  static PyObject* const s_dtype = interned("dtype");
  py::object ptr = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t.ptr(), s_data_ptr));
  if (!ptr) throw py::error_already_set();
  py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(t.ptr(), s_shape));
  if (!shape) throw py::error_already_set();
  py::object dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(t.ptr(), s_dtype));
  if (!dtype) throw py::error_already_set();
  const Py_ssize_t dims = PyTuple_Check(shape.ptr()) ? PyTuple_GET_SIZE(shape.ptr()) : -1;
  UCCL_EP_CHECK_ARG(dims >= 1 && dims <= kMaxViewDims, name, ": expected a tensor of 1 to ", kMaxViewDims,
                    " dimensions");
  v.none = false;
  v.ptr = static_cast<intptr_t>(PyLong_AsSsize_t(ptr.ptr()));
  v.dim = static_cast<int>(dims);
  for (Py_ssize_t i = 0; i < dims; ++i) v.size[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
  if (PyErr_Occurred()) throw py::error_already_set();
  v.dtype = &dtype_info(dtype.ptr());
  return v;
}

inline std::string shape_text(const TensorView& v) {
  if (v.none) return "None";
  std::string s = "[";
  for (int i = 0; i < v.dim; ++i) s += detail::concat(i ? ", " : "", v.size[i]);
  return s + "]";
}

// "any" for a size of -1.
inline std::string size_text(int64_t n) { return n < 0 ? std::string("any") : std::to_string(n); }

// `v` has as many dims as `shape` has entries, each size equal where the entry is >= 0, and one
// of the `dts` dtypes.
inline void expect(const TensorView& v, const char* what, std::initializer_list<int64_t> shape,
                   std::initializer_list<Dt> dts) {
  UCCL_EP_CHECK_ARG(!v.none, what, " is None but this call uses it");
  const int dim = static_cast<int>(shape.size());
  bool shape_ok = v.dim == dim;
  int i = 0;
  for (int64_t n : shape) {
    shape_ok = shape_ok && (n < 0 || v.size[i] == n);
    ++i;  // every entry, "any" ones too
  }
  if (!shape_ok) {
    const int64_t* s = shape.begin();
    std::string want;
    if (dim <= 2) {
      want = size_text(s[0]) + " rows";
      if (dim > 1) want += " and " + size_text(s[1]) + " columns";
    } else {
      want = "shape [";
      for (int j = 0; j < dim; ++j) want += detail::concat(j ? ", " : "", size_text(s[j]));
      want += "]";
    }
    UCCL_EP_THROW(InvalidArgument, what, " has shape ", shape_text(v), "; expected ", dim, "-D with ", want);
  }
  bool dt_ok = false;
  for (Dt d : dts) dt_ok |= v.dtype->dt == d;
  UCCL_EP_CHECK_ARG(dt_ok, what, " has dtype ", v.dtype->name, ", which this call does not take there");
}

// The view of `t`, checked by expect(); None (an empty view) passes only when `optional`.
inline TensorView arg(py::handle t, const char* what, bool optional, std::initializer_list<int64_t> shape,
                      std::initializer_list<Dt> dts) {
  TensorView v = view_of(t, what);
  if (!(optional && v.none)) expect(v, what, shape, dts);
  return v;
}

// On `stream`, after a call's last kernel: when the status word at `status` is set (a wait of
// the call timed out, or its inputs were rejected on the GPU), fill each view with its 8-byte
// pattern, so no caller reads uninitialised rows before the next call raises. None and empty
// views are skipped.
inline void poison(intptr_t status, intptr_t stream,
                   std::initializer_list<std::pair<const TensorView*, uint64_t>> fills) {
  std::vector<intptr_t> ptrs;
  std::vector<int64_t> bytes;
  std::vector<uint64_t> patterns;
  for (const auto& [v, pattern] : fills) {
    if (v->bytes() == 0) continue;
    ptrs.push_back(v->ptr);
    bytes.push_back(v->bytes());
    patterns.push_back(pattern);
  }
  if (!ptrs.empty()) kernels::poison_if_failed(status, ptrs, bytes, patterns, stream);
}

}  // namespace uccl_ep::bindings::views
#endif
