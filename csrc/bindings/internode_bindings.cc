// The internode HT kernels in `_C`: constants, status words and kernel loading here, the
// per-call entry points in internode_calls.cc, plus the kernels' pure layout arithmetic, which
// is bound in every build so CPU tests can check what the kernels will compute.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "kernels/internode_layout.h"
#ifdef UCCL_EP_WITH_GPU
#include "common/registry.h"
#include "kernels/internode.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

#ifdef UCCL_EP_WITH_GPU
namespace {

namespace in = uccl_ep::internode;
constexpr uint64_t kStatusBytes = in::kStatusWords * sizeof(int64_t);

}  // namespace
#endif

void bind_internode(py::module_& m) {
  namespace in = uccl_ep::internode;
  py::module_ s = m.def_submodule("internode", "Internode HT dispatch/combine (FIFO -> proxy -> transport).");
  s.attr("MAX_CHANNELS") = in::kMaxChannels;
  s.attr("TRACE_WORDS") = in::kTraceWords;
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
  sites[py::int_(static_cast<int>(in::kSitePlace))] =
      "placement exchange of the node (waiting for a node peer's kernel of the same call to start)";
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

  // The per-call entry points (typed views of the tensors, one call per step).
  bind_internode_calls(s);
  s.def("preload_kernels", &in::preload_kernels,
        "Load every internode kernel on the current device now (no lazy load while one waits).");
#endif
}

}  // namespace uccl_ep::bindings
