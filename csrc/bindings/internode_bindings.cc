// The internode HT kernels in `_C` (raw pointers as ints), plus their pure layout arithmetic,
// which is bound in every build so CPU tests can check what the kernels will compute.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "kernels/internode_layout.h"
#ifdef UCCL_EP_WITH_GPU
#include "common/errors.h"
#include "common/registry.h"
#include "kernels/internode.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

#ifdef UCCL_EP_WITH_GPU
namespace {

namespace in = uccl_ep::internode;
constexpr uint64_t kStatusBytes = in::kStatusWords * sizeof(int64_t);

// As in kernel_bindings.cc: `_C`'s own allocations are checked against the registry, tensor
// pointers for non-null where the sizes say a kernel touches them.
void check_ptr(intptr_t ptr, bool used, const std::string& what) {
  if (used && ptr == 0) UCCL_EP_THROW(InvalidArgument, what, " is a null pointer but the sizes say it is used");
}

void check_common(const in::Common& c, const char* op) {
  AllocRegistry& reg = AllocRegistry::get();
  const std::string at = std::string("internode ") + op + ": ";
  UCCL_EP_CHECK_ARG(c.num_ranks >= 1 && c.ranks_per_node >= 1 && c.num_ranks % c.ranks_per_node == 0,
                    at, "num_ranks=", c.num_ranks, " ranks_per_node=", c.ranks_per_node);
  UCCL_EP_CHECK_ARG(static_cast<int>(c.nvl.size()) == c.ranks_per_node, at, "got ", c.nvl.size(),
                    " NVLink buffers for ", c.ranks_per_node, " ranks per node");
  UCCL_EP_CHECK_ARG(c.region_bytes > 0, at, "region_bytes=", c.region_bytes, " must be positive");
  reg.check(static_cast<uintptr_t>(c.region), static_cast<uint64_t>(c.region_bytes), {AllocKind::kDeviceBuffer},
            (at + "region").c_str());
  for (size_t j = 0; j < c.nvl.size(); ++j) {
    reg.check(static_cast<uintptr_t>(c.nvl[j]), 1, {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping},
              (at + "nvl[" + std::to_string(j) + "]").c_str());
  }
  reg.check(static_cast<uintptr_t>(c.status), kStatusBytes, {AllocKind::kHostStatus}, (at + "status").c_str());
  reg.check(static_cast<uintptr_t>(c.counters), in::kNumCounters * sizeof(int64_t), {AllocKind::kMappedCounters},
            (at + "counters").c_str());
  check_ptr(c.fifo_handles, true, at + "fifo_handles");
  check_ptr(c.state, true, at + "state");
}

void check_dispatch(const in::DispatchArgs& a, const char* op) {
  check_common(a.common, op);
  const std::string at = std::string("internode ") + op + ": ";
  UCCL_EP_CHECK_ARG(a.num_tokens >= 0 && a.num_topk >= 0 && a.num_scales >= 0 && a.row_bytes > 0, at,
                    "num_tokens=", a.num_tokens, " num_topk=", a.num_topk, " num_scales=", a.num_scales,
                    " row_bytes=", a.row_bytes);
  const bool send = a.num_tokens > 0;
  UCCL_EP_CHECK_ARG(a.out_rows >= 0, at, "out_rows=", a.out_rows);
  const int recv = a.out_rows;
  check_ptr(a.recv_rows, true, at + "recv_rows");
  check_ptr(a.recv_prefix, true, at + "recv_prefix");
  check_ptr(a.x, send, at + "x");
  check_ptr(a.x_scales, send && a.num_scales > 0, at + "x_scales");
  check_ptr(a.topk_idx, send && a.num_topk > 0, at + "topk_idx");
  check_ptr(a.topk_weights, send && a.num_topk > 0, at + "topk_weights");
  check_ptr(a.dst_row, send, at + "dst_row");
  check_ptr(a.lists, send, at + "lists");
  check_ptr(a.list_count, true, at + "list_count");
  check_ptr(a.recv_x, recv > 0, at + "recv_x");
  check_ptr(a.recv_scales, recv > 0 && a.num_scales > 0, at + "recv_scales");
  check_ptr(a.recv_topk_idx, recv > 0 && a.num_topk > 0, at + "recv_topk_idx");
  check_ptr(a.recv_topk_weights, recv > 0 && a.num_topk > 0, at + "recv_topk_weights");
}

void check_combine(const in::CombineArgs& a, const char* op) {
  check_common(a.common, op);
  const std::string at = std::string("internode ") + op + ": ";
  UCCL_EP_CHECK_ARG(a.num_tokens >= 0 && a.num_recv >= 0 && a.num_topk >= 0 && a.row_bytes > 0, at,
                    "num_tokens=", a.num_tokens, " num_recv=", a.num_recv, " num_topk=", a.num_topk,
                    " row_bytes=", a.row_bytes);
  check_ptr(a.x, a.num_recv > 0, at + "x");
  check_ptr(a.topk_weights, a.num_recv > 0 && a.num_topk > 0, at + "topk_weights");
  check_ptr(a.recv_count, a.num_recv > 0, at + "recv_count");
  check_ptr(a.src_tokens, true, at + "src_tokens");
  check_ptr(a.plan, true, at + "plan");
  check_ptr(a.lists, true, at + "lists");
  check_ptr(a.list_count, true, at + "list_count");
  check_ptr(a.dst_row, a.num_tokens > 0, at + "dst_row");
  check_ptr(a.stream_cum, a.num_tokens > 0, at + "stream_cum");
  check_ptr(a.out, a.num_tokens > 0, at + "out");
  check_ptr(a.out_weights, a.num_tokens > 0 && a.num_topk > 0, at + "out_weights");
}

}  // namespace
#endif

void bind_internode(py::module_& m) {
  namespace in = uccl_ep::internode;
  py::module_ s = m.def_submodule("internode", "Internode HT dispatch/combine (FIFO -> proxy -> transport).");
  s.attr("MAX_CHANNELS") = in::kMaxChannels;
  s.attr("MAX_NODES") = in::kMaxNodes;
  s.attr("MAX_LOCAL") = in::kMaxLocal;
  s.attr("MAX_TOPK") = in::kMaxTopk;
  s.attr("NUM_COUNTERS") = in::kNumCounters;
  s.attr("STATE_WORDS") = in::kStateWords;
  s.attr("MAX_ATOMIC_STEP") = in::kMaxAtomicStep;
  py::dict kinds;
  kinds["dispatch_tail"] = static_cast<int>(in::kDispatchTail);
  kinds["dispatch_done"] = static_cast<int>(in::kDispatchDone);
  kinds["dispatch_head"] = static_cast<int>(in::kDispatchHead);
  kinds["combine_tail"] = static_cast<int>(in::kCombineTail);
  kinds["combine_head"] = static_cast<int>(in::kCombineHead);
  s.attr("COUNTER_KINDS") = kinds;

  s.def("counter_index", &in::counter_index, py::arg("kind"), py::arg("channel"), py::arg("node"),
        "Index of a software-atomic counter (kind, channel, node) in the proxy's counter array.");
  s.def(
      "channel_range",
      [](int t, int c, int ch) {
        in::Range r = in::channel_range(t, c, ch);
        return py::make_tuple(r.begin, r.end);
      },
      py::arg("num_tokens"), py::arg("num_channels"), py::arg("channel"),
      "[begin, end) of the tokens channel `channel` serves.");
  s.def(
      "dispatch_slot",
      [](int64_t row_bytes, int ns, int k, int l) {
        in::DispatchSlot d = in::dispatch_slot(row_bytes, ns, k, l);
        py::dict o;
        o["x"] = d.x, o["scales"] = d.scales, o["gid"] = d.gid, o["weights"] = d.weights, o["src"] = d.src;
        o["rows"] = d.rows, o["bytes"] = d.bytes;
        return o;
      },
      py::arg("row_bytes"), py::arg("num_scales"), py::arg("num_topk"), py::arg("ranks_per_node"),
      "Byte layout of one dispatch ring slot.");
  s.def(
      "combine_slot",
      [](int64_t row_bytes, int k) {
        in::CombineSlot d = in::combine_slot(row_bytes, k);
        py::dict o;
        o["x"] = d.x, o["weights"] = d.weights, o["src"] = d.src, o["bytes"] = d.bytes;
        return o;
      },
      py::arg("row_bytes"), py::arg("num_topk"), "Byte layout of one combine ring slot / staging row.");
  s.def(
      "stage_slot",
      [](int64_t row_bytes, int ns, int k, int idx_bytes) {
        in::StageSlot d = in::stage_slot(row_bytes, ns, k, idx_bytes);
        py::dict o;
        o["x"] = d.x, o["scales"] = d.scales, o["idx"] = d.idx, o["weights"] = d.weights, o["src"] = d.src;
        o["bytes"] = d.bytes;
        return o;
      },
      py::arg("row_bytes"), py::arg("num_scales"), py::arg("num_topk"), py::arg("idx_bytes"),
      "Byte layout of one NVLink dispatch staging row.");
  s.def(
      "ring_layout",
      [](bool combine, int64_t region_bytes, int c, int n, int cap, int64_t slot) {
        in::RingLayout l = in::ring_layout(combine, region_bytes, c, n, cap, slot);
        py::dict o;
        o["half_offset"] = l.half_offset, o["send_offset"] = l.send_offset, o["recv_offset"] = l.recv_offset;
        o["bytes"] = l.bytes, o["half_bytes"] = in::region_half_bytes(region_bytes);
        return o;
      },
      py::arg("combine"), py::arg("region_bytes"), py::arg("num_channels"), py::arg("num_nodes"), py::arg("cap"),
      py::arg("slot_bytes"), "Where the rings of a call sit in the registered RDMA region.");
  s.def(
      "ring_slot_offset",
      [](bool combine, bool recv, int64_t region_bytes, int c_total, int n_total, int cap, int64_t slot, int c,
         int n, int64_t index) {
        in::RingLayout l = in::ring_layout(combine, region_bytes, c_total, n_total, cap, slot);
        return in::ring_slot_offset(recv ? l.recv_offset : l.send_offset, l, c, n, index);
      },
      py::arg("combine"), py::arg("recv"), py::arg("region_bytes"), py::arg("num_channels"), py::arg("num_nodes"),
      py::arg("cap"), py::arg("slot_bytes"), py::arg("channel"), py::arg("node"), py::arg("index"),
      "Region offset of cumulative slot `index` of ring (channel, node).");
  s.def(
      "chunk_pieces",
      [](int64_t start, int k, int cap) {
        in::ChunkPieces p = in::chunk_pieces(start, k, cap);
        return py::make_tuple(p.first_slot, p.n1, p.n2);
      },
      py::arg("start"), py::arg("k"), py::arg("cap"), "(first slot, slots before the wrap, slots after).");
  s.def(
      "atomic_steps",
      [](int64_t delta) {
        std::vector<int> v;
        for (int i = 0; i < in::atomic_steps(delta); ++i) v.push_back(in::atomic_step_value(delta, i));
        return v;
      },
      py::arg("delta"), "Values of the 11-bit software atomics that add `delta` to a counter.");

#ifndef UCCL_EP_WITH_GPU
  s.def("built", [] { return false; }, "Whether the internode GPU kernels were compiled into _C.");
#else
  s.def("built", [] { return true; }, "Whether the internode GPU kernels were compiled into _C.");
  s.attr("STATUS_WORDS") = in::kStatusWords;
  py::dict sites;
  sites[py::int_(static_cast<int>(in::kSiteDispatchSend))] = "dispatch send (waiting for ring room at the forwarder)";
  sites[py::int_(static_cast<int>(in::kSiteDispatchForward))] = "dispatch forward (waiting for tokens from a source)";
  sites[py::int_(static_cast<int>(in::kSiteCombineSend))] = "combine send (waiting for ring room at the source)";
  sites[py::int_(static_cast<int>(in::kSiteCombineRecv))] = "combine receive (waiting for a node's partial sums)";
  sites[py::int_(static_cast<int>(in::kSiteFifo))] = "FIFO push (the proxy stopped or the channel stayed full)";
  sites[py::int_(static_cast<int>(in::kSiteCombineOrder))] = "combine order check (a partial for another token)";
  sites[py::int_(static_cast<int>(in::kSiteNvlBarrier))] = "NVLink barrier of the node";
  sites[py::int_(static_cast<int>(in::kSiteDispatchRow))] = "dispatch row check (a slot named a row out of range)";
  sites[py::int_(static_cast<int>(in::kSiteAgreement))] = "call-header check on the GPU (sync-free call)";
  s.attr("SITE_AGREEMENT") = static_cast<int>(in::kSiteAgreement);
  s.attr("SITES") = sites;
  s.def(
      "status_alloc",
      [] {
        const intptr_t p = in::status_alloc();
        AllocRegistry::get().add(static_cast<uintptr_t>(p), kStatusBytes, AllocKind::kHostStatus);
        return p;
      },
      "Mapped pinned status words (host pointer == device pointer).");
  s.def(
      "status_free",
      [](intptr_t ptr) {
        AllocRegistry::get().remove(static_cast<uintptr_t>(ptr), AllocKind::kHostStatus, "internode.status_free");
        in::status_free(ptr);
      },
      py::arg("ptr"));
  s.def(
      "status_read",
      [](intptr_t ptr) {
        AllocRegistry::get().check(static_cast<uintptr_t>(ptr), kStatusBytes, {AllocKind::kHostStatus},
                                   "internode.status_read");
        return in::status_read(ptr);
      },
      py::arg("ptr"), "[set, peer rank, waited-for value, site, channel, observed value].");

  py::class_<in::Common>(s, "Common")
      .def(py::init<>())
      .def_readwrite("rank", &in::Common::rank)
      .def_readwrite("num_ranks", &in::Common::num_ranks)
      .def_readwrite("ranks_per_node", &in::Common::ranks_per_node)
      .def_readwrite("num_channels", &in::Common::num_channels)
      .def_readwrite("fifo_handles", &in::Common::fifo_handles)
      .def_readwrite("num_fifos", &in::Common::num_fifos)
      .def_readwrite("counters", &in::Common::counters)
      .def_readwrite("state", &in::Common::state)
      .def_readwrite("region", &in::Common::region)
      .def_readwrite("region_bytes", &in::Common::region_bytes)
      .def_readwrite("nvl", &in::Common::nvl)
      .def_readwrite("cap", &in::Common::cap)
      .def_readwrite("chunk", &in::Common::chunk)
      .def_readwrite("status", &in::Common::status)
      .def_readwrite("timeout_ns", &in::Common::timeout_ns)
      .def_readwrite("verdict", &in::Common::verdict);

#define RW(cls, f) .def_readwrite(#f, &in::cls::f)
  py::class_<in::DispatchArgs>(s, "DispatchArgs")
      .def(py::init<>())
      RW(DispatchArgs, common) RW(DispatchArgs, num_tokens) RW(DispatchArgs, experts_per_rank)
      RW(DispatchArgs, num_topk) RW(DispatchArgs, num_scales) RW(DispatchArgs, row_bytes) RW(DispatchArgs, x)
      RW(DispatchArgs, x_scales) RW(DispatchArgs, topk_idx) RW(DispatchArgs, topk_weights)
      RW(DispatchArgs, idx_is_64) RW(DispatchArgs, dst_row) RW(DispatchArgs, lists) RW(DispatchArgs, list_count)
      RW(DispatchArgs, recv_x) RW(DispatchArgs, recv_scales) RW(DispatchArgs, recv_topk_idx)
      RW(DispatchArgs, recv_topk_weights) RW(DispatchArgs, recv_src_idx) RW(DispatchArgs, plan)
      RW(DispatchArgs, plan_tokens) RW(DispatchArgs, stage_offset) RW(DispatchArgs, recv_rows)
      RW(DispatchArgs, recv_prefix) RW(DispatchArgs, out_rows);
  py::class_<in::CombineArgs>(s, "CombineArgs")
      .def(py::init<>())
      RW(CombineArgs, common) RW(CombineArgs, dtype) RW(CombineArgs, num_topk)
      RW(CombineArgs, num_tokens) RW(CombineArgs, num_recv) RW(CombineArgs, recv_count) RW(CombineArgs, row_bytes) RW(CombineArgs, x)
      RW(CombineArgs, topk_weights) RW(CombineArgs, plan) RW(CombineArgs, plan_tokens) RW(CombineArgs, lists)
      RW(CombineArgs, list_count) RW(CombineArgs, src_tokens) RW(CombineArgs, dst_row)
      RW(CombineArgs, stream_cum) RW(CombineArgs, bias0) RW(CombineArgs, bias1) RW(CombineArgs, out)
      RW(CombineArgs, out_weights) RW(CombineArgs, stage_offset);
#undef RW

  s.def(
      "dispatch",
      [](const in::DispatchArgs& a, intptr_t stream) {
        check_dispatch(a, "dispatch");
        in::dispatch(a, stream);
      },
      py::arg("args"), py::arg("stream"), "Launch the sender/forwarder dispatch kernel (2 * num_channels blocks).");
  s.def(
      "dispatch_finish",
      [](const in::DispatchArgs& a, uint64_t barrier_seq, intptr_t stream) {
        check_dispatch(a, "dispatch_finish");
        in::dispatch_finish(a, barrier_seq, stream);
      },
      py::arg("args"), py::arg("barrier_seq"), py::arg("stream"),
      "Ranks per node > 1: node barrier, then staged rows into the outputs.");
  s.def(
      "combine_prepare",
      [](const in::CombineArgs& a, uint64_t barrier_seq, intptr_t stream) {
        check_combine(a, "combine_prepare");
        in::combine_prepare(a, barrier_seq, stream);
      },
      py::arg("args"), py::arg("barrier_seq"), py::arg("stream"),
      "Ranks per node > 1: stage this rank's combine input for its node peers, then a node barrier.");
  s.def(
      "combine",
      [](const in::CombineArgs& a, intptr_t stream) {
        check_combine(a, "combine");
        in::combine(a, stream);
      },
      py::arg("args"), py::arg("stream"), "Launch the combine kernel.");
  s.def(
      "node_barrier",
      [](const in::Common& c, uint64_t barrier_seq, intptr_t stream) {
        check_common(c, "node_barrier");
        in::node_barrier(c, barrier_seq, stream);
      },
      py::arg("common"), py::arg("barrier_seq"), py::arg("stream"), "NVLink barrier of the node's ranks.");
  s.def("preload_kernels", &in::preload_kernels,
        "Load every internode kernel on the current device now (no lazy load while one waits).");
#endif
}

}  // namespace uccl_ep::bindings
