// FIFO channels, proxies and transports. Pointers cross as ints.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "bindings/bindings.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/registry.h"
#include "fifo/cmd_builder.h"
#include "fifo/fifo.h"
#include "proxy/proxy.h"
#include "transport/ipc_transport.h"
#ifdef UCCL_EP_WITH_VERBS
#include "transport/verbs_transport.h"
#endif
#ifdef UCCL_EP_WITH_GPU
#include "fifo/fifo_gpu.h"
#include "transport/gpu_hooks.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {
namespace {

py::tuple cmd_tuple(const TransferCmd& c) { return py::make_tuple(c.lo, c.hi); }
TransferCmd cmd_from(uint64_t lo, uint64_t hi) { return TransferCmd{lo, hi}; }

const GpuHooks* hooks_or_null() {
#ifdef UCCL_EP_WITH_GPU
  return gpu_hooks();
#else
  return nullptr;
#endif
}

// The region a transport registers and writes into: a HostRegion, a device buffer of `_C`, or
// (GPU builds, gpu_device >= 0) any allocation on that device, e.g. a torch tensor.
void check_region(uintptr_t ptr, uint64_t bytes, int gpu_device) {
  AllocRegistry& reg = AllocRegistry::get();
  if (ptr != 0 && reg.contains(ptr, bytes, {AllocKind::kHostRegion, AllocKind::kDeviceBuffer})) return;
  const GpuHooks* hooks = hooks_or_null();
  if (ptr != 0 && gpu_device >= 0 && hooks != nullptr && hooks->address_range != nullptr) {
    uintptr_t base = 0;
    size_t size = 0;
    if (!hooks->address_range(reinterpret_cast<const void*>(ptr), gpu_device, &base, &size)) {
      UCCL_EP_THROW(InvalidArgument, "region_ptr=", ptr, " is not device memory of GPU ", gpu_device,
                    " in this process; pass a tensor's data_ptr() on that GPU or _C.device_alloc_zeroed");
    }
    if (bytes > size - (ptr - base)) {
      UCCL_EP_THROW(InvalidArgument, "region_bytes=", bytes, " runs past the end of the device allocation holding ",
                    "region_ptr (", size - (ptr - base), " bytes from region_ptr to its end); pass the size of the ",
                    "memory the region really has");
    }
    return;
  }
  reg.check(ptr, bytes, {AllocKind::kHostRegion, AllocKind::kDeviceBuffer},
            gpu_device >= 0 ? "region (region_ptr, region_bytes)"
                            : "host region (region_ptr, region_bytes; allocate it with _C.HostRegion)");
}

// The setup of a transport over a region the caller passes (checked by check_region).
TransportSetup transport_setup(uint32_t rank, uint32_t world, uint32_t threads, uint32_t channels, uintptr_t region,
                               uint64_t bytes, int gpu_device) {
  check_region(region, bytes, gpu_device);
  TransportSetup s;
  s.rank = rank;
  s.world_size = world;
  s.num_threads = threads;
  s.num_channels = channels;
  s.region = RegionInfo{reinterpret_cast<void*>(region), bytes, gpu_device};
  return s;
}

// Host memory a transport registers (heap for one process, shared memory across processes).
class HostRegion {
 public:
  HostRegion(uint64_t bytes, bool shared) {
    UCCL_EP_CHECK_ARG(bytes > 0, "region bytes must be positive");
    if (shared) {
      shm_ = std::make_unique<SharedHostRegion>(bytes);
      ptr_ = shm_->data();
    } else {
      heap_.assign(bytes, 0);
      ptr_ = heap_.data();
    }
    bytes_ = bytes;
    AllocRegistry::get().add(reinterpret_cast<uintptr_t>(ptr_), bytes_, AllocKind::kHostRegion);
  }
  ~HostRegion() {
    if (ptr_) AllocRegistry::get().remove(reinterpret_cast<uintptr_t>(ptr_), AllocKind::kHostRegion, "~HostRegion");
  }
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;
  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(ptr_); }
  uint64_t bytes() const { return bytes_; }
  std::string shm_name() const { return shm_ ? shm_->name() : ""; }
  py::bytes read(uint64_t offset, uint64_t n) const {
    UCCL_EP_CHECK_ARG(offset + n <= bytes_, "read [", offset, ", ", offset + n, ") outside ", bytes_, " bytes");
    return py::bytes(static_cast<const char*>(ptr_) + offset, n);
  }
  void write(uint64_t offset, const std::string& data) {
    UCCL_EP_CHECK_ARG(offset + data.size() <= bytes_, "write [", offset, ", ", offset + data.size(), ") outside ",
                      bytes_, " bytes");
    std::memcpy(static_cast<char*>(ptr_) + offset, data.data(), data.size());
  }

 private:
  std::unique_ptr<SharedHostRegion> shm_;
  std::vector<uint8_t> heap_;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

// int64 software-atomic counters; mapped into GPUs in GPU builds so kernels can poll them.
class Counters {
 public:
  Counters(uint32_t n, bool mapped) : n_(n) {
    UCCL_EP_CHECK_ARG(n > 0 && n <= cmd_limits::kNumAtomicCounters, "counters n=", n, " must be in [1, ",
                      cmd_limits::kNumAtomicCounters, "]");
    if (mapped) {
#ifdef UCCL_EP_WITH_GPU
      gpu::MappedHost m = gpu::alloc_mapped(n * sizeof(int64_t));
      host_ = static_cast<int64_t*>(m.host);
      dev_ = static_cast<int64_t*>(m.dev);
      mapped_ = true;
      AllocRegistry::get().add(dev_ptr(), n_ * sizeof(int64_t), AllocKind::kMappedCounters);
      return;
#else
      UCCL_EP_THROW(Unsupported, "mapped counters need a GPU build of uccl_ep_megatron");
#endif
    }
    heap_.assign(n, 0);
    host_ = dev_ = heap_.data();
    AllocRegistry::get().add(dev_ptr(), n_ * sizeof(int64_t), AllocKind::kMappedCounters);
  }
  ~Counters() {
    AllocRegistry::get().remove(dev_ptr(), AllocKind::kMappedCounters, "~Counters");
#ifdef UCCL_EP_WITH_GPU
    if (mapped_) gpu::free_mapped(host_);
#endif
  }
  Counters(const Counters&) = delete;
  Counters& operator=(const Counters&) = delete;
  std::vector<int64_t> values() const {
    std::vector<int64_t> v(n_);
    for (uint32_t i = 0; i < n_; ++i) v[i] = __atomic_load_n(&host_[i], __ATOMIC_ACQUIRE);
    return v;
  }
  void reset() {
    for (uint32_t i = 0; i < n_; ++i) __atomic_store_n(&host_[i], 0, __ATOMIC_RELEASE);
  }
  int64_t* host() const { return host_; }
  uintptr_t dev_ptr() const { return reinterpret_cast<uintptr_t>(dev_); }
  uint32_t size() const { return n_; }

 private:
  uint32_t n_;
  int64_t* host_ = nullptr;
  int64_t* dev_ = nullptr;
  bool mapped_ = false;
  std::vector<int64_t> heap_;
};

py::dict nic_stats_dict(const IpcNicStats& s) {
  py::dict d;
  d["writes"] = s.writes;
  d["bytes"] = s.bytes;
  d["copies"] = s.copies;
  d["batches"] = s.batches;
  d["delivered"] = s.delivered;
  d["wire_busy_ns"] = s.wire_busy_ns;
  d["wire_gaps_short"] = s.wire_gaps_short;
  d["wire_idle_short_ns"] = s.wire_idle_short_ns;
  d["wire_gaps_long"] = s.wire_gaps_long;
  d["wire_idle_long_ns"] = s.wire_idle_long_ns;
  d["wire_queue_ns"] = s.wire_queue_ns;
  d["nic_lag_ns"] = s.nic_lag_ns;
  d["late_ns"] = s.late_ns;
  d["busy_passes"] = s.busy_passes;
  d["dma_passes"] = s.dma_passes;
  d["pickup_ns"] = s.step_ns[0];
  d["submit_ns"] = s.step_ns[1];
  d["poll_ns"] = s.step_ns[2];
  d["deliver_ns"] = s.step_ns[3];
  d["acks_ns"] = s.step_ns[4];
  d["cpu_seconds"] = s.cpu_seconds;
  return d;
}

py::dict stats_dict(const ProxyStats& s) {
  py::dict d;
  d["commands"] = s.commands;
  d["writes_posted"] = s.writes_posted;
  d["bytes_posted"] = s.bytes_posted;
  d["atomics_posted"] = s.atomics_posted;
  d["barriers"] = s.barriers;
  d["drains"] = s.drains;
  d["writes_received"] = s.writes_received;
  d["atomics_applied"] = s.atomics_applied;
  d["held_out_of_order"] = s.held_out_of_order;
  return d;
}

}  // namespace


namespace {
// The body of ipc_copy_test (bindings above): one thread drives endpoint 0 of the transport.
std::pair<double, uint64_t> ipc_copy_test(IpcTransport& t, uint32_t peer, uint64_t src_offset, uint64_t dst_offset,
                                         uint64_t span, uint32_t write_bytes, uint32_t writes, uint32_t window,
                                         uint32_t expect_recvs, double timeout_s) {
  UCCL_EP_CHECK_ARG(write_bytes > 0 && span >= write_bytes && window >= 1, "ipc_copy_test: write_bytes=",
                    write_bytes, " span=", span, " window=", window);
  Endpoint& ep = t.endpoint(0);
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + std::chrono::duration<double>(timeout_s);
  const uint64_t slots = span / write_bytes;
  uint64_t posted = 0, done = 0, recvs = 0;
  auto t_last = t0;
  Completion out[256];
  while (done < writes || recvs < expect_recvs) {
    while (posted < writes && posted - done < window) {
      const uint64_t off = (posted % slots) * write_bytes;
      ep.post_write(peer, 0, src_offset + off, dst_offset + off, write_bytes, 0, posted);
      ++posted;
    }
    ep.flush();
    const int n = ep.poll(out, 256);
    for (int i = 0; i < n; ++i) {
      if (out[i].kind == Completion::kSend) {
        ++done;
        t_last = std::chrono::steady_clock::now();
      } else {
        ++recvs;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      UCCL_EP_THROW(TimeoutError, "ipc_copy_test: ", done, " of ", writes, " writes completed and ", recvs, " of ",
                    expect_recvs, " received after ", timeout_s, " s");
    }
  }
  return {std::chrono::duration<double>(t_last - t0).count(), recvs};
}

// The body of proxy_push_test (bindings below): CPU threads standing in for a GPU's producers, one
// per channel, each pushing `writes` Writes of `write_bytes` to `peer` as fast as the ring takes
// them (every `atomic_every`-th one carrying +1 on the peer's counter `channel`, as a chunk's last
// write carries its tail), then Drain(all), waiting for its completion. Channel c's writes cycle
// over its own `span` bytes at src_offset + c * span and dst_offset + c * span. Returns (seconds
// from the start to the last drain completed, commands pushed).
std::pair<double, uint64_t> proxy_push_test(const std::vector<FifoChannel*>& chans, uint32_t peer,
                                            uint64_t src_offset, uint64_t dst_offset, uint64_t span,
                                            uint32_t write_bytes, uint32_t writes, uint32_t atomic_every) {
  UCCL_EP_CHECK_ARG(!chans.empty() && write_bytes > 0 && span >= write_bytes && writes >= 1,
                    "proxy_push_test: channels=", chans.size(), " write_bytes=", write_bytes, " span=", span,
                    " writes=", writes, " (need a channel, write_bytes > 0, span >= write_bytes, writes >= 1)");
  const uint64_t slots = span / write_bytes;
  std::mutex mu;
  std::exception_ptr first;  // the first failure; the others follow from the abort it sets
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t c = 0; c < chans.size(); ++c) {
    threads.emplace_back([&, c] {
      try {
        FifoChannel& f = *chans[c];
        const uint64_t src = src_offset + c * span, dst = dst_offset + c * span;
        const auto channel = static_cast<uint32_t>(c);
        for (uint32_t i = 0; i < writes; ++i) {
          const uint64_t off = (i % slots) * write_bytes;
          const bool tail = atomic_every > 0 && (i + 1) % atomic_every == 0;
          const TransferCmd cmd = tail ? build_write_atomic(peer, src + off, dst + off, write_bytes, channel, 1)
                                       : build_write(peer, src + off, dst + off, write_bytes);
          f.push(cmd);  // throws TimeoutError when the proxy stops consuming
        }
        f.wait_completion(f.push(make_drain_all()));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) {
          first = std::current_exception();
          for (auto* other : chans) other->set_abort(true);  // release the other producers
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (first) std::rethrow_exception(first);
  return {seconds, uint64_t{writes + 1} * chans.size()};
}
}  // namespace

void bind_proxy(py::module_& m) {
  // ---- TransferCmd ----
  m.def("cmd_write", [](uint32_t d, uint64_t s, uint64_t o, uint32_t n) { return cmd_tuple(build_write(d, s, o, n)); },
        py::arg("dst_rank"), py::arg("src_offset"), py::arg("dst_offset"), py::arg("length"),
        "Validated Write TransferCmd as (lo, hi).");
  m.def(
      "cmd_write_atomic",
      [](uint32_t d, uint64_t s, uint64_t o, uint32_t n, uint32_t i, int32_t v) {
        return cmd_tuple(build_write_atomic(d, s, o, n, i, v));
      },
      py::arg("dst_rank"), py::arg("src_offset"), py::arg("dst_offset"), py::arg("length"), py::arg("atomic_index"),
      py::arg("atomic_value"), "Validated Write with a piggy-backed software atomic, as (lo, hi).");
  m.def("cmd_atomic", [](uint32_t d, uint32_t i, int32_t v) { return cmd_tuple(build_atomic(d, i, v)); },
        py::arg("dst_rank"), py::arg("atomic_index"), py::arg("atomic_value"), "Atomic TransferCmd as (lo, hi).");
  m.def("cmd_drain", [](uint64_t upto) { return cmd_tuple(make_drain(upto)); }, py::arg("upto"),
        "Drain up to FIFO index `upto`, as (lo, hi).");
  m.def("cmd_drain_all", [] { return cmd_tuple(make_drain_all()); }, "Drain everything posted before it.");
  m.def("cmd_barrier", [](bool same_rail) { return cmd_tuple(make_barrier(same_rail)); }, py::arg("same_rail") = false,
        "Barrier over all peers (or same-rail peers), as (lo, hi).");
  m.def(
      "cmd_decode",
      [](uint64_t lo, uint64_t hi) {
        CmdFields f = decode_cmd(cmd_from(lo, hi));
        py::dict d;
        d["type"] = cmd_type_name(f.type);
        d["dst_rank"] = f.dst_rank;
        d["src_offset"] = f.src_offset;
        d["dst_offset"] = f.dst_offset;
        d["length"] = f.length;
        d["has_atomic"] = f.has_atomic;
        d["atomic_index"] = f.atomic_index;
        d["atomic_value"] = f.atomic_value;
        d["drain_all"] = f.drain_all;
        d["drain_index_low32"] = f.drain_index_low32;
        d["barrier_same_rail"] = f.barrier_same_rail;
        return d;
      },
      py::arg("lo"), py::arg("hi"), "Decode a TransferCmd (lo, hi) into its fields.");
  py::dict limits;
  limits["max_ranks"] = cmd_limits::kMaxRanks;
  limits["max_length"] = cmd_limits::kMaxLength;
  limits["num_atomic_counters"] = cmd_limits::kNumAtomicCounters;
  limits["min_atomic_value"] = cmd_limits::kMinAtomicValue;
  limits["max_atomic_value"] = cmd_limits::kMaxAtomicValue;
  limits["offset_align"] = cmd_limits::kOffsetAlign;
  limits["max_src_offset"] = cmd_limits::kMaxSrcOffset;
  limits["max_dst_offset"] = cmd_limits::kMaxDstOffset;
  limits["seq_window"] = imm::kSeqWindow;
  m.attr("cmd_limits") = limits;
  m.attr("fifo_device_handle_bytes") = sizeof(FifoDeviceHandle);

  // ---- FIFO channel ----
  py::class_<FifoChannel>(m, "FifoChannel", "A GPU->CPU command ring (see csrc/fifo/fifo.h).")
      .def_static("host", &FifoChannel::create_host, py::arg("channel"), py::arg("capacity"), py::arg("timeout_ms"),
                  "A channel whose producers are CPU threads (all host memory).")
      .def_static(
          "gpu",
          [](uint32_t channel, uint32_t capacity, uint64_t timeout_ms, int device) -> std::unique_ptr<FifoChannel> {
#ifdef UCCL_EP_WITH_GPU
            return gpu::create_fifo(channel, capacity, timeout_ms, device);
#else
            (void)channel, (void)capacity, (void)timeout_ms, (void)device;
            UCCL_EP_THROW(Unsupported, "GPU FIFO channels need a GPU build (nvcc or hipcc at install time)");
#endif
          },
          py::arg("channel"), py::arg("capacity"), py::arg("timeout_ms"), py::arg("device"),
          "A channel whose producers are kernels on `device`.")
      .def_property_readonly("channel", &FifoChannel::channel)
      .def_property_readonly("capacity", &FifoChannel::capacity)
      .def_property_readonly("head", &FifoChannel::head)
      .def_property_readonly("published_head", &FifoChannel::published_head)
      .def(
          "poll",
          [](const FifoChannel& f) -> py::object {
            TransferCmd c;
            if (!f.poll(&c)) return py::none();
            return cmd_tuple(c);
          },
          "The command at head as (lo, hi) without dequeuing it, or None.")
      .def("pop", &FifoChannel::pop, "Dequeue the command at head (consumer side).")
      .def(
          "push", [](FifoChannel& f, uint64_t lo, uint64_t hi) { return f.push(cmd_from(lo, hi)); },
          py::arg("lo"), py::arg("hi"), py::call_guard<py::gil_scoped_release>(),
          "Enqueue a command from the CPU; returns its FIFO index.")
      .def("check_completion", &FifoChannel::check_completion, py::arg("index"))
      .def("wait_completion", &FifoChannel::wait_completion, py::arg("index"),
           py::call_guard<py::gil_scoped_release>(), "Block until `index` was popped (TimeoutError names it).")
      .def("check_error", &FifoChannel::check_error, "Raise a failure a kernel producer recorded.")
      .def("set_abort", &FifoChannel::set_abort, py::arg("abort"))
      .def(
          "device_handle_bytes",
          [](const FifoChannel& f) {
            FifoDeviceHandle h = f.device_handle();
            return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
          },
          "The FifoDeviceHandle kernels take, as raw bytes (copy into device memory).");

  py::class_<HostRegion>(m, "HostRegion", "Host memory to register with a transport.")
      .def(py::init<uint64_t, bool>(), py::arg("bytes"), py::arg("shared") = false)
      .def_property_readonly("ptr", &HostRegion::ptr)
      .def_property_readonly("bytes", &HostRegion::bytes)
      .def_property_readonly("shm_name", &HostRegion::shm_name)
      .def("read", &HostRegion::read, py::arg("offset"), py::arg("n"))
      .def("write", &HostRegion::write, py::arg("offset"), py::arg("data"));

  py::class_<Counters>(m, "Counters", "Software-atomic targets (int64), mapped into GPUs when mapped=True.")
      .def(py::init<uint32_t, bool>(), py::arg("n"), py::arg("mapped") = false)
      .def("values", &Counters::values)
      .def("reset", &Counters::reset)
      .def_property_readonly("dev_ptr", &Counters::dev_ptr)
      .def("__len__", &Counters::size);

  // ---- transports ----
  py::class_<Transport>(m, "Transport")
      .def_property_readonly("name", &Transport::name)
      .def_property_readonly("ordered", &Transport::ordered)
      .def("local_info", [](const Transport& t) { return py::bytes(t.local_info()); })
      .def(
          "connect",
          [](Transport& t, const std::vector<std::string>& infos) { t.connect(infos); }, py::arg("infos"),
          "Connect given every rank's local_info() (indexed by rank).")
      .def("peer_region_bytes", &Transport::peer_region_bytes, py::arg("peer"));

  py::class_<IpcTransport, Transport>(m, "IpcTransport",
                                      "Single-host transport: the NIC model (line rate, latency, RC/SRD, faults).")
      .def(py::init([](uint32_t rank, uint32_t world, uint32_t threads, uint32_t channels, uintptr_t region,
                       uint64_t bytes, int gpu_device, bool reorder, uint64_t seed, uint32_t max_delay_us,
                       uint32_t inbox_capacity, const std::string& shm_name, uint64_t copy_timeout_ms,
                       double link_gbps, double latency_us, const std::string& fault, uint32_t copy_streams,
                       bool bytes_in_place) {
             const TransportSetup s = transport_setup(rank, world, threads, channels, region, bytes, gpu_device);
             IpcOptions o;
             o.reorder = reorder;
             o.seed = seed;
             o.max_delay_us = max_delay_us;
             o.inbox_capacity = inbox_capacity;
             o.copy_timeout_ms = copy_timeout_ms;
             o.link_gbps = link_gbps;
             o.latency_us = latency_us;
             o.faults = parse_ipc_faults(fault);
             o.copy_streams = copy_streams;
             o.bytes_in_place = bytes_in_place;
             o.peer_access = Env::load().ipc_peer_access;
             o.gpu = hooks_or_null();
             return std::make_unique<IpcTransport>(s, o, shm_name);
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("num_threads"), py::arg("num_channels"),
           py::arg("region_ptr"), py::arg("region_bytes"), py::arg("gpu_device") = -1, py::arg("reorder") = false,
           py::arg("seed") = 0, py::arg("max_delay_us") = 50, py::arg("inbox_capacity") = 4096,
           py::arg("shm_name") = "", py::arg("copy_timeout_ms") = 30000, py::arg("link_gbps") = 0.0,
           py::arg("latency_us") = 0.0, py::arg("fault") = "", py::arg("copy_streams") = 4,
           py::arg("bytes_in_place") = false)
      .def("peer_region", &IpcTransport::peer_region, py::arg("peer"),
           "Address of `peer`'s region as mapped in this process (after connect).")
      .def(
          "nic_stats",
          [](const IpcTransport& t) {
            return nic_stats_dict(t.nic_stats());
          },
          "What the virtual NIC did: messages, bytes, copies after coalescing, copy submissions, "
          "immediates delivered, egress busy time, CPU seconds of its thread.");
  m.def(
      "ipc_copy_test",
      [](IpcTransport& t, uint32_t peer, uint64_t src_offset, uint64_t dst_offset, uint64_t span, uint32_t write_bytes,
         uint32_t writes, uint32_t window, uint32_t expect_recvs, double timeout_s) {
        py::gil_scoped_release nogil;
        return ipc_copy_test(t, peer, src_offset, dst_offset, span, write_bytes, writes, window, expect_recvs,
                             timeout_s);
      },
      py::arg("transport"), py::arg("peer"), py::arg("src_offset"), py::arg("dst_offset"), py::arg("span"),
      py::arg("write_bytes"), py::arg("writes"), py::arg("window"), py::arg("expect_recvs"), py::arg("timeout_s"),
      "Copy-only test of a connected ipc transport with no proxy: posts `writes` writes of `write_bytes` "
      "to `peer` (cycling over `span` bytes from the offsets), at most `window` outstanding, and polls until "
      "all completed and `expect_recvs` writes from peers arrived. Returns (seconds to the last send "
      "completion, receives seen).");
  m.def(
      "proxy_push_test",
      [](const std::vector<FifoChannel*>& chans, uint32_t peer, uint64_t src_offset, uint64_t dst_offset,
         uint64_t span, uint32_t write_bytes, uint32_t writes, uint32_t atomic_every) {
        py::gil_scoped_release nogil;
        return proxy_push_test(chans, peer, src_offset, dst_offset, span, write_bytes, writes, atomic_every);
      },
      py::arg("channels"), py::arg("peer"), py::arg("src_offset"), py::arg("dst_offset"), py::arg("span"),
      py::arg("write_bytes"), py::arg("writes"), py::arg("atomic_every"),
      "Proxy throughput test with CPU producers: one thread per host channel pushes `writes` Writes of "
      "`write_bytes` to `peer` (every `atomic_every`-th with +1 on the peer's counter of that channel; 0 = "
      "none), cycling over its own `span` bytes from the offsets (channel c at offset + c * span), then "
      "Drain(all) and waits for it. Returns (seconds until the last drain completed, commands pushed).");
  m.def("parse_ipc_faults", [](const std::string& spec) { return parse_ipc_faults(spec).size(); }, py::arg("spec"),
        "Checks a UCCL_EP_IPC_FAULT string; returns how many faults it names (raises on a malformed one).");

#ifdef UCCL_EP_WITH_VERBS
  py::class_<VerbsTransport, Transport>(m, "VerbsTransport", "RDMA transport: RC or EFA SRD over libibverbs.")
      .def(py::init([](uint32_t rank, uint32_t world, uint32_t threads, uint32_t channels, uintptr_t region,
                       uint64_t bytes, int gpu_device, int local_index, const std::string& flavor) {
             const TransportSetup s = transport_setup(rank, world, threads, channels, region, bytes, gpu_device);
             const Env e = Env::load();
             VerbsOptions o;
             o.hca = e.ib_hca;
             o.local_index = local_index;
             o.gid_index = static_cast<int>(e.ib_gid_index);
             o.sl = e.ib_sl;
             o.tc = e.ib_tc;
             o.dmabuf = e.ib_dmabuf;
             o.flavor = flavor;
             o.gpu = hooks_or_null();
             return std::make_unique<VerbsTransport>(s, o);
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("num_threads"), py::arg("num_channels"),
           py::arg("region_ptr"), py::arg("region_bytes"), py::arg("gpu_device") = -1, py::arg("local_index") = 0,
           py::arg("flavor") = "")
      .def_property_readonly("device_name", &VerbsTransport::device_name);
#endif

  m.def(
      "verbs_status",
      [] {
        py::dict d;
#ifdef UCCL_EP_WITH_VERBS
        const VerbsLib& v = VerbsLib::get();
        d["built"] = true;
        d["loaded"] = v.loaded;
        d["error"] = v.error;
        d["efa_loaded"] = v.efa_loaded;
        d["dmabuf_reg"] = v.reg_dmabuf_mr != nullptr;
#else
        d["built"] = false;
        d["loaded"] = false;
        d["error"] = "built without infiniband/verbs.h (install libibverbs-dev and reinstall)";
        d["efa_loaded"] = false;
        d["dmabuf_reg"] = false;
#endif
        return d;
      },
      "Whether the verbs transport was built and libibverbs/libefa load here.");

  m.def(
      "list_rdma_devices",
      []() {
        py::list out;
#ifdef UCCL_EP_WITH_VERBS
        for (const auto& dev : list_rdma_devices()) {
          py::dict d;
          d["name"] = dev.name;
          d["efa"] = dev.efa;
          py::list ports;
          for (const auto& p : dev.ports) {
            py::dict pd;
            pd["port"] = p.port;
            pd["state"] = p.state;
            pd["link_layer"] = p.link_layer;
            pd["active_mtu"] = p.active_mtu;
            py::list gids;
            for (const auto& g : p.gids) {
              if (gid_is_zero(g.gid)) continue;
              gids.append(py::make_tuple(g.index, g.gid, g.type));
            }
            pd["gids"] = gids;
            ports.append(pd);
          }
          d["ports"] = ports;
          out.append(d);
        }
#else
        UCCL_EP_THROW(Unsupported, "built without infiniband/verbs.h (install libibverbs-dev and reinstall)");
#endif
        return out;
      },
      "RDMA devices with port state, link layer, MTU and GIDs (index, gid, type).");

  // ---- proxy ----
  py::class_<Proxy>(m, "Proxy", "CPU proxy of one GPU (see csrc/proxy/proxy.h).")
      .def(py::init([](uint32_t rank, uint32_t world, uint32_t ranks_per_node, uint32_t threads, uint64_t timeout_ms,
                       const std::string& ordering, const std::vector<FifoChannel*>& channels, Transport* transport,
                       Counters* counters, uint32_t max_inflight, uint64_t max_inflight_bytes,
                       const std::vector<int>& cpus, uint32_t idle_us) {
             ProxyOptions o;
             o.rank = rank;
             o.world_size = world;
             o.ranks_per_node = ranks_per_node;
             o.num_threads = threads;
             o.timeout_ms = timeout_ms;
             o.ordering = parse_ordering(ordering);
             o.max_inflight_per_stream = max_inflight;
             o.max_inflight_bytes_per_stream = max_inflight_bytes;
             o.cpus = cpus;
             o.idle_us = idle_us;
             return std::make_unique<Proxy>(o, channels, transport, counters ? counters->host() : nullptr,
                                            counters ? counters->size() : 0);
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("ranks_per_node"), py::arg("num_threads"),
           py::arg("timeout_ms"), py::arg("ordering"), py::arg("channels"), py::arg("transport"),
           py::arg("counters"), py::arg("max_inflight_per_stream") = imm::kSeqWindow,
           py::arg("max_inflight_bytes_per_stream") = 0, py::arg("cpus") = std::vector<int>{},
           py::arg("idle_us") = 200,
           // The proxy's threads use channels, transport and counters: keep them alive with it.
           py::keep_alive<1, 8>(), py::keep_alive<1, 9>(), py::keep_alive<1, 10>())
      .def("start", &Proxy::start)
      .def("stop", &Proxy::stop, py::arg("timeout_ms") = 0, py::call_guard<py::gil_scoped_release>(),
           "Stop and join the threads within timeout_ms (0: 5 s); TimeoutError names a thread stuck in a call.")
      .def_static("live_threads", &Proxy::live_threads, "Proxy threads in this process that have not exited.")
      .def_property_readonly("running", &Proxy::running)
      .def("check", &Proxy::check, "Re-raise the first failure of a proxy thread.")
      .def("stats", [](const Proxy& p) { return stats_dict(p.stats()); });

  m.def("numa_cpus_of_pci", [](const std::string& bus) { return numa_cpus_of_pci(bus); }, py::arg("pci_bus_id"),
        "CPUs of the NUMA node of a PCI device ([] when unknown).");

  // ---- GPU helpers (the FIFO test/bench kernels are in the _bench_C extension) ----
#ifdef UCCL_EP_WITH_GPU
  m.def("gpu_device_count", &gpu::device_count);
  m.def("gpu_pci_bus_id", &gpu::pci_bus_id, py::arg("device"));
#endif
}

}  // namespace uccl_ep::bindings
