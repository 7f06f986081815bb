// The proxy's lifecycle: argument checks, one named, pinned thread per Worker (worker.h), bounded
// stop, the watchdog in check(), and the stats the threads keep.
#include "proxy/proxy.h"

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <thread>

#include "common/errors.h"
#include "common/log.h"
#include "fifo/cmd_builder.h"
#include "proxy/worker.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define UCCL_EP_CPU_RELAX() _mm_pause()
#else
#define UCCL_EP_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace uccl_ep {

Ordering parse_ordering(const std::string& s) {
  if (s == "receiver") return Ordering::kReceiver;
  if (s == "sender") return Ordering::kSender;
  if (s == "none") return Ordering::kNone;
  UCCL_EP_THROW(InvalidArgument, "ordering='", s, "' is unknown; use receiver, sender or none");
}

const char* ordering_name(Ordering o) {
  switch (o) {
    case Ordering::kReceiver:
      return "receiver";
    case Ordering::kSender:
      return "sender";
    default:
      return "none";
  }
}

struct Proxy::State {
  ProxyOptions options;
  std::vector<FifoChannel*> channels;
  Transport* transport;
  int64_t* counters;
  uint32_t num_counters;
  std::atomic<bool> stop{false};
  std::vector<std::unique_ptr<ThreadStats>> stats;
  std::mutex error_mu;
  std::exception_ptr error;
  // Which threads have left thread_main; stop() waits on `exit_cv` for them, bounded.
  std::mutex exit_mu;
  std::condition_variable exit_cv;
  std::vector<bool> exited;

  void record_failure(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = e;
    }
    // Producers blocked on this proxy must not hang: make their waits give up.
    for (auto* ch : channels) ch->set_abort(true);
    stop = true;
  }
};

namespace {

using proxy_detail::Worker;

std::atomic<uint32_t> g_live_threads{0};

std::string thread_name(uint32_t rank, uint32_t thread) {
  return ("ueproxy" + std::to_string(rank) + "t" + std::to_string(thread)).substr(0, 15);
}

// What a proxy thread does after a pass that moved nothing: spin a little (work usually follows
// at once inside a call), then yield to co-located threads, and once idle for idle_us (between
// calls: the host is building the next one) nap ~20 us per poll so the core is free. A call's
// first command then waits at most one nap; idle_us = 0 keeps spinning.
class IdlePolicy {
 public:
  explicit IdlePolicy(uint32_t idle_us) : idle_(std::chrono::microseconds(idle_us)), nap_(idle_us > 0) {}

  void after_pass(bool moved) {
    if (moved) {
      passes_ = 0;
      return;
    }
    if (++passes_ < 64) {
      UCCL_EP_CPU_RELAX();
      return;
    }
    if (nap_) {
      const auto now = std::chrono::steady_clock::now();
      if (passes_ == 64) since_ = now;
      if (now - since_ >= idle_) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
        return;
      }
    }
    std::this_thread::yield();
  }

 private:
  std::chrono::steady_clock::duration idle_;
  bool nap_;
  uint64_t passes_ = 0;
  std::chrono::steady_clock::time_point since_{};
};

void thread_main(const std::shared_ptr<Proxy::State>& st, uint32_t thread) {
  const ProxyOptions& o = st->options;
  std::string name = thread_name(o.rank, thread);
  pthread_setname_np(pthread_self(), name.c_str());
  if (!o.cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : o.cpus) CPU_SET(c, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
      UCCL_EP_LOG(kWarn, "proxy thread ", name, ": could not pin to the GPU's NUMA CPUs; running unpinned");
    }
  }
  // Naps are short: the kernel's default timer slack (50 us) would stretch each one.
  if (o.idle_us > 0) (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  try {
    Worker w(o, thread, st->channels, *st->transport, st->counters, st->num_counters, *st->stats[thread]);
    IdlePolicy idle(o.idle_us);
    std::atomic<uint64_t>& passes = st->stats[thread]->passes;
    while (!st->stop.load(std::memory_order_relaxed)) {
      const bool moved = w.run_once();
      passes.store(passes.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      idle.after_pass(moved);
    }
  } catch (...) {
    st->record_failure(std::current_exception());
  }
  {
    std::lock_guard<std::mutex> lock(st->exit_mu);
    st->exited[thread] = true;
  }
  st->exit_cv.notify_all();
  g_live_threads.fetch_sub(1);
}

}  // namespace

Proxy::Proxy(const ProxyOptions& options, std::vector<FifoChannel*> channels, Transport* transport,
             int64_t* counters, uint32_t num_counters)
    : options_(options), st_(std::make_shared<State>()) {
  st_->options = options;
  st_->channels = std::move(channels);
  st_->transport = transport;
  st_->counters = counters;
  st_->num_counters = num_counters;
  const auto& chans = st_->channels;
  UCCL_EP_CHECK_ARG(transport != nullptr, "proxy needs a transport");
  UCCL_EP_CHECK_ARG(options.world_size >= 1 && options.world_size <= cmd_limits::kMaxRanks &&
                        options.rank < options.world_size,
                    "rank=", options.rank, " world_size=", options.world_size);
  UCCL_EP_CHECK_ARG(options.num_threads >= 1 && options.num_threads <= 64, "num_threads=", options.num_threads,
                    " must be in [1, 64] (UCCL_EP_NUM_PROXY_THREADS)");
  UCCL_EP_CHECK_ARG(options.max_inflight_per_stream >= 1 && options.max_inflight_per_stream <= imm::kSeqWindow,
                    "max_inflight_per_stream=", options.max_inflight_per_stream, " must be in [1, ", imm::kSeqWindow,
                    "] (7-bit sequence numbers)");
  UCCL_EP_CHECK_ARG(options.timeout_ms > 0, "timeout_ms must be positive");
  UCCL_EP_CHECK_ARG(options.stop_timeout_ms > 0, "stop_timeout_ms must be positive");
  UCCL_EP_CHECK_ARG(options.batch >= 1, "batch must be >= 1");
  UCCL_EP_CHECK_ARG(num_counters <= cmd_limits::kNumAtomicCounters && (counters != nullptr || num_counters == 0),
                    "num_counters=", num_counters, " must be <= ", cmd_limits::kNumAtomicCounters,
                    " with a counters array");
  UCCL_EP_CHECK_ARG(!chans.empty(), "proxy needs at least one FIFO channel");
  for (size_t i = 0; i < chans.size(); ++i) {
    UCCL_EP_CHECK_ARG(chans[i] != nullptr && chans[i]->channel() == i, "channels[", i, "] must be channel ", i);
  }
  if (options.ordering == Ordering::kNone && !transport->ordered()) {
    UCCL_EP_LOG(kWarn, "proxy rank ", options.rank, ": ordering=none on unordered transport '", transport->name(),
                "': atomics may overtake writes");
  }
}

Proxy::~Proxy() {
  try {
    stop();
  } catch (const TimeoutError& e) {
    // The stuck threads keep the shared state alive; nothing of this object is used by them.
    UCCL_EP_LOG(kError, e.what(), "; the destructor leaves them behind (detached)");
    for (auto& th : threads_) {
      if (th.joinable()) th.detach();
    }
  }
}

uint32_t Proxy::live_threads() { return g_live_threads.load(); }

void Proxy::start() {
  UCCL_EP_CHECK_ARG(!running_, "proxy of rank ", options_.rank,
                    " is already running (or still stopping: a thread did not leave a transport call)");
  st_->stop = false;
  st_->stats.clear();
  for (uint32_t t = 0; t < options_.num_threads; ++t) st_->stats.push_back(std::make_unique<ThreadStats>());
  st_->exited.assign(options_.num_threads, false);
  for (auto* ch : st_->channels) ch->set_abort(false);
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_passes_.assign(options_.num_threads, 0);
    watch_since_.assign(options_.num_threads, std::chrono::steady_clock::now());
  }
  running_ = true;
  for (uint32_t t = 0; t < options_.num_threads; ++t) {
    g_live_threads.fetch_add(1);
    std::shared_ptr<State> st = st_;
    threads_.emplace_back([st, t] { thread_main(st, t); });
  }
}

void Proxy::stop(uint64_t timeout_ms) {
  if (!running_) return;
  st_->stop = true;
  const uint64_t bound = timeout_ms ? timeout_ms : options_.stop_timeout_ms;
  std::vector<uint32_t> stuck;
  {
    std::unique_lock<std::mutex> lock(st_->exit_mu);
    st_->exit_cv.wait_for(lock, std::chrono::milliseconds(bound), [&] {
      return std::all_of(st_->exited.begin(), st_->exited.end(), [](bool e) { return e; });
    });
    for (uint32_t t = 0; t < threads_.size(); ++t) {
      if (!st_->exited[t]) stuck.push_back(t);
    }
  }
  // A thread that left its loop is joined now (it returns at once), a stuck one stays joinable.
  for (uint32_t t = 0; t < threads_.size(); ++t) {
    if (threads_[t].joinable() && std::find(stuck.begin(), stuck.end(), t) == stuck.end()) threads_[t].join();
  }
  if (stuck.empty()) {
    threads_.clear();
    running_ = false;
    return;
  }
  std::string who;
  for (uint32_t t : stuck) {
    who += detail::concat(who.empty() ? "" : ", ", "thread ", t, " (", thread_name(options_.rank, t), ", ",
                          st_->stats[t]->passes.load(std::memory_order_relaxed), " passes done)");
  }
  UCCL_EP_THROW(TimeoutError, "proxy rank ", options_.rank, ": ", who, " did not stop within ", bound,
                " ms: blocked inside a call into transport '", st_->transport->name(),
                "' (e.g. a CUDA call that waits for kernels which wait for this proxy). The proxy keeps the "
                "thread(s) and what they use; call stop() again once the call returned, or end the process");
}

void Proxy::check() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(st_->error_mu);
    e = st_->error;
  }
  if (e) std::rethrow_exception(e);
  if (!running_ || st_->stop.load()) return;
  // Watchdog: a proxy thread blocked inside a call cannot time out by itself.
  std::lock_guard<std::mutex> lock(watch_mu_);
  const auto now = std::chrono::steady_clock::now();
  for (uint32_t t = 0; t < st_->stats.size() && t < watch_passes_.size(); ++t) {
    const uint64_t passes = st_->stats[t]->passes.load(std::memory_order_relaxed);
    if (passes != watch_passes_[t]) {
      watch_passes_[t] = passes;
      watch_since_[t] = now;
      continue;
    }
    const auto stuck_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - watch_since_[t]).count();
    if (static_cast<uint64_t>(stuck_ms) <= options_.timeout_ms) continue;
    try {
      UCCL_EP_THROW(TimeoutError, "proxy rank ", options_.rank, " thread ", t, " (ueproxy", options_.rank, "t", t,
                    ") has not come back from a call into transport '", st_->transport->name(), "' for ", stuck_ms,
                    " ms (after ", passes, " passes): it is blocked, e.g. in a CUDA call that waits for kernels ",
                    "which wait for this proxy; its channels (c % ", options_.num_threads, " == ", t,
                    ") stopped moving");
    } catch (...) {
      st_->record_failure(std::current_exception());
      throw;
    }
  }
}

ProxyStats Proxy::stats() const {
  ProxyStats s;
  for (const auto& t : st_->stats) {
    s.commands += t->commands.load(std::memory_order_relaxed);
    s.writes_posted += t->writes_posted.load(std::memory_order_relaxed);
    s.bytes_posted += t->bytes_posted.load(std::memory_order_relaxed);
    s.atomics_posted += t->atomics_posted.load(std::memory_order_relaxed);
    s.barriers += t->barriers.load(std::memory_order_relaxed);
    s.drains += t->drains.load(std::memory_order_relaxed);
    s.writes_received += t->writes_received.load(std::memory_order_relaxed);
    s.atomics_applied += t->atomics_applied.load(std::memory_order_relaxed);
    s.held_out_of_order += t->held_out_of_order.load(std::memory_order_relaxed);
  }
  return s;
}
}  // namespace uccl_ep
