// Host API of the internode high-throughput (HT) kernels: GPU-initiated, proxy-executed,
// node-deduplicated dispatch and hierarchical combine (UCCL-EP §3.3 on DeepEP's HT design).
//
// Who does what, for a token of source rank s = (node m, local l):
//   - dispatch sender block (channel c of s): for every other node n that hosts one of the
//     token's experts, packs the token once into the send ring (c, n) of s's registered RDMA
//     region and, per chunk, pushes a 16-byte Write (+ software atomic "tail += k") into FIFO
//     channel c % F; the CPU proxy posts it to rank (n, l), the same rail. Tokens for s's own
//     node are forwarded directly over NVLink by the same block.
//   - dispatch forwarder block (channel c of rank (n, l)): polls the tail counter the proxy
//     bumps, copies each arrived token to every local rank hosting one of its experts, at the
//     token's final row (carried in the slot), and returns ring slots with an Atomic "head += k".
//   - combine forwarder (rank (n, l)): for each token it forwarded, sums the node's rows (the
//     local ranks' combine inputs, over NVLink) into one partial and sends it back to s through
//     the combine ring: one partial per (token, node) crosses the network.
//   - combine receiver (s): for each token in order, adds its own node's rows and the partials
//     of the other nodes, then the biases, and writes the output.
// Flow control is per (channel, node) ring: head/tail are cumulative software-atomic counters
// in the proxy's mapped host memory, the positions each side has reached live in device memory
// (`state`), so calls need no reset. Every wait has a deadline; the first failure is written to
// the mapped host status words and makes every other block give up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/internode_layout.h"

namespace uccl_ep::internode {

// Status words (mapped host memory): [0] set, [1] peer rank, [2] waited-for value, [3] site,
// [4] channel, [5] observed value.
constexpr int kStatusWords = 6;
enum Site : int {
  kSiteDispatchSend = 11,     // sender waits for ring room at the forwarder
  kSiteDispatchForward = 12,  // forwarder waits for tokens (or the end marker) from a source
  kSiteCombineSend = 13,      // combine forwarder waits for ring room at the source
  kSiteCombineRecv = 14,      // combine receiver waits for a node's partial sums
  kSiteFifo = 15,             // a FIFO push failed (proxy stopped or stalled)
  kSiteCombineOrder = 16,     // a partial arrived for another token than expected (corruption)
  kSiteNvlBarrier = 17,       // NVLink barrier among the node's ranks ([1] = local index)
  kSiteDispatchRow = 18,      // a ring slot named a row outside the receiver's output (corruption)
  kSiteAgreement = 19,        // sync-free call: the GPU check of the call headers failed ([1] rank,
                              // [2] verdict code, [5] value); no kernel moved any data
  kSitePlace = 20,            // a kernel waits for a node peer's placement of the call ([1] = peer rank,
                              // [2] = the placement sequence, [5] = the last one seen): its kernel never started
};

// Pinned, device-mapped status words with their device flag (kernels::host_status_alloc, on the
// current device); the host pointer is also the device pointer (UVA).
intptr_t status_alloc();
void status_free(intptr_t ptr);
std::vector<int64_t> status_read(intptr_t ptr);

// Fields shared by every launch.
struct Common {
  int rank = 0, num_ranks = 0, ranks_per_node = 1, num_channels = 1;
  intptr_t fifo_handles = 0;  // FifoDeviceHandle[num_fifos] in device memory
  int num_fifos = 0;
  intptr_t counters = 0;  // int64[kNumCounters], the proxy's mapped host array (device pointer)
  intptr_t state = 0;     // int64[kStateWords], device memory, zeroed once
  intptr_t region = 0;    // registered RDMA region (device memory)
  int64_t region_bytes = 0;
  std::vector<intptr_t> nvl;  // NVLink buffers of the node's ranks (index = local rank)
  // Empty: a NIC moves ring bytes (the senders pack into this rank's send rings and the proxy
  // posts writes from there). Else one region per node, index = node: the region of the rank
  // with this local index on that node, mapped here (the ipc NIC model with
  // UCCL_EP_IPC_DELIVERY=store). The senders then store each slot straight into that rank's
  // receive ring over NVLink, and the model times the writes' delivery without moving bytes.
  std::vector<intptr_t> remote;
  // Empty, or the receive arenas of the node's ranks as mapped here (index = local rank): a
  // peer whose rows of a call lie in its arena (kPlaceFlagsOffset) is written or read there.
  std::vector<intptr_t> arenas;
  int cap = 0;                // ring slots per (channel, node)
  int chunk = 0;              // tokens per RDMA write
  intptr_t status = 0;
  int64_t timeout_ns = 0;
  // int64 [3] in device memory, or 0: the GPU verdict on the all-gathered call headers of a
  // sync-free call (code, rank, value; code 0 = agreed). A set code makes every kernel record
  // it in the status words and move nothing, on every rank alike (all hold the same rows).
  intptr_t verdict = 0;
  // uint64 [2 * num_channels * kTraceWords] in device memory, or 0 (no clock reads at all).
  intptr_t trace = 0;
};

struct DispatchArgs {
  Common common;
  int num_tokens = 0, experts_per_rank = 0, num_topk = 0, num_scales = 0;
  int64_t row_bytes = 0;
  intptr_t x = 0, x_scales = 0, topk_idx = 0, topk_weights = 0;
  bool idx_is_64 = true;
  intptr_t dst_row = 0;     // int32 [T, R]: final row of token t at rank r, -1 when not sent
  intptr_t lists = 0;       // int32 [N, T]: tokens of stream (c, n) at [n][range(c).begin ...)
  intptr_t list_count = 0;  // int32 [C, N]
  intptr_t recv_x = 0, recv_scales = 0, recv_topk_idx = 0, recv_topk_weights = 0, recv_src_idx = 0;
  intptr_t plan = 0;  // int32 [N, plan_tokens, L]: rows of forwarded tokens (combine needs them)
  int plan_tokens = 0;
  int64_t stage_offset = 0;  // NVLink staging in every local rank's buffer
  // Device int32 tables (counts stay on the GPU; no host copy of them is needed):
  intptr_t recv_rows = 0;    // [L] rows each local rank of this node receives (bounds check)
  intptr_t recv_prefix = 0;  // [R + 1] first output row from source s; [R] = rows received
  int out_rows = 0;          // rows of this rank's outputs (received rows, or num_worst_tokens)
  // L > 1: where this rank's outputs lie (kPlaceWordsOffset's words: kind, then the byte offsets
  // of recv_x, scales, ids, weights, sources in its arena), told to the node peers by the
  // kernel under sequence place_seq. Kind kPlaceArena: peers write their rows there, and
  // dispatch_finish copies nothing.
  int64_t place[kPlaceWords] = {};
  uint64_t place_seq = 0;
};

// Launches the sender/forwarder kernel (2 * num_channels blocks).
void dispatch(const DispatchArgs& a, intptr_t stream);
// L > 1: NVLink barrier of the node, then, unless the outputs lie in this rank's arena (where
// the peers wrote their rows), the rows local peers staged here are copied into the outputs
// (a.recv_prefix on the device says which rows came from which source).
void dispatch_finish(const DispatchArgs& a, uint64_t barrier_seq, intptr_t stream);

struct CombineArgs {
  Common common;
  int dtype = 0;  // 0 bf16, 1 fp16, 2 fp32
  int num_topk = 0, num_tokens = 0;
  int num_recv = 0;         // rows of x (received rows, or num_worst_tokens)
  intptr_t recv_count = 0;  // int32 [1] device: rows actually received (the rest is padding)
  int64_t row_bytes = 0;
  intptr_t x = 0, topk_weights = 0;  // this rank's combine input rows [num_recv] and weights
  // forwarder side
  intptr_t plan = 0;
  int plan_tokens = 0;
  intptr_t lists = 0;       // int32 [N, plan_tokens]: tokens of source (m, l) this node forwards
  intptr_t list_count = 0;  // int32 [C, N]
  intptr_t src_tokens = 0;  // int32 [N] device: tokens of source (m, my local), per node m
  // receiver side
  intptr_t dst_row = 0;     // int32 [T, R] from the dispatch
  intptr_t stream_cum = 0;  // int32 [T, N]: inclusive count of tokens to node n in t's channel
  intptr_t bias0 = 0, bias1 = 0;
  intptr_t out = 0, out_weights = 0;
  int64_t stage_offset = 0;
  // L > 1: where this rank's x and weights lie (kind, byte offsets of x and weights in its
  // arena), told to the node peers by the kernel under sequence place_seq; kind 0: staged by
  // combine_stage first.
  int64_t place[kPlaceWords] = {};
  uint64_t place_seq = 0;
};

// L > 1 and x outside this rank's arena: copies x and weights into its NVLink staging, where
// the node peers read them once the combine kernel (after it on the stream) says so.
void combine_stage(const CombineArgs& a, intptr_t stream);
void combine(const CombineArgs& a, intptr_t stream);
// L > 1: node barrier so no peer still reads this rank's staging when the next call reuses it.
void node_barrier(const Common& c, uint64_t barrier_seq, intptr_t stream);

// The index tables of a dispatch (backends/internode/tables.py has their torch form), from the
// all-gathered call headers and is_token_in_rank, in one launch. An output left 0 is skipped
// (a cached dispatch builds only lists and list_count).
struct DispatchTablesArgs {
  int rank = 0, num_ranks = 0, ranks_per_node = 1, num_channels = 1, num_tokens = 0;
  intptr_t rows = 0;                  // int64 [R, row_width]: the call headers
  int row_width = 0, counts_col = 0;  // rows[s][counts_col + r]: rows s sends to r; [s][width - 1]: s's tokens
  intptr_t in_rank = 0;               // bool [T, R]
  intptr_t dst_row = 0;               // int32 [T, R]
  intptr_t lists = 0;                 // int32 [N, T]
  intptr_t list_count = 0;            // int32 [C, N]
  intptr_t rank_prefix = 0;           // int32 [R, R]; with it recv_rows [L], recv_prefix [R + 1],
  intptr_t recv_rows = 0, recv_prefix = 0, recv_count = 0, src_tokens = 0;  // recv_count [1], src_tokens [N]
  intptr_t plan = 0;                  // int32, plan_words of them set to -1
  int64_t plan_words = 0;
  // A sync-free dispatch's outputs whose padding rows the same launch fills before its data
  // kernel (each optional, filled whole: the data kernel overwrites the received rows):
  // top-k ids with -1 (int64 when pad_ids64, else int32), weights with 0, source indices with -1.
  intptr_t pad_ids = 0, pad_weights = 0, pad_src = 0;
  int64_t pad_ids_words = 0, pad_weights_words = 0, pad_src_words = 0;
  bool pad_ids64 = true;
};
void dispatch_tables(const DispatchTablesArgs& a, intptr_t stream);

// The tables of a combine: the stream positions of this rank's tokens per node (cum [T, N]),
// and the streams of tokens it forwards back (lists [N, plan_tokens], list_count [C, N]) from
// the dispatch's plan [N, plan_tokens, L] and src_tokens [N].
struct CombineTablesArgs {
  int ranks_per_node = 1, num_nodes = 0, num_channels = 1, num_tokens = 0, plan_tokens = 0;
  intptr_t in_rank = 0, cum = 0, plan = 0, src_tokens = 0, lists = 0, list_count = 0;
};
void combine_tables(const CombineTablesArgs& a, intptr_t stream);

// The routing check of a dispatch's arguments (backends/base.py routing_check with topk_idx):
// out (int64 [3]) = min id, max id (0, -1 without ids) and the layout bits (agreement's
// LAYOUT_BITS) of the caller's layout against what topk_idx implies. R <= 32.
struct RoutingCheckArgs {
  intptr_t topk_idx = 0;  // int64 or int32 [T, K]
  bool idx64 = true;
  int num_tokens = 0, num_topk = 0, num_experts = 0, num_ranks = 0, ranks_per_node = 1;
  intptr_t per_rank = 0, per_rdma = 0, per_expert = 0;  // the caller's int32 counts (per_rdma may be 0)
  intptr_t in_rank = 0;                                 // the caller's bool [T, R]
  intptr_t scratch = 0;  // uint64 [routing_check_scratch_words(R, L, E)], device memory
  intptr_t out = 0;
};
int64_t routing_check_scratch_words(int num_ranks, int ranks_per_node, int num_experts);
void routing_check(const RoutingCheckArgs& a, intptr_t stream);

// The verdict on the all-gathered call headers of a sync-free call (agreement/verdict.py
// device_verdict): out (int64 [3]) = code, rank, value. Columns name the header fields.
constexpr int kMaxAgreed = 16;
struct VerdictArgs {
  intptr_t rows = 0;  // int64 [R, width]
  int num_ranks = 0, width = 0;
  int col_kind = 0, col_seq = 0, col_error = 0, col_magic = 0, col_buffer = 0, col_experts = 0, col_worst = 0;
  int agreed[kMaxAgreed] = {};
  int num_agreed = 0;
  int checks_col = 0, counts_col = 0;
  int64_t magic = 0;
  int kind_dispatch = 0;
  intptr_t out = 0;
  // Optional (expert_out != 0): this rank's received rows per local expert, rounded up to
  // `alignment`, summed from the per-expert blocks (int32 slots from `experts_col`) of the rows
  // into int32 [experts_per_rank]: a sync-free dispatch's counts without a pass over its outputs.
  intptr_t expert_out = 0;
  int experts_col = 0, rank = 0, experts_per_rank = 0, alignment = 1;
};
void call_verdict(const VerdictArgs& a, intptr_t stream);

// What the host reads of an exact call's all-gathered headers (header.py's torch form
// `_host_part_and_counts` is its definition), in one launch into mapped host memory: every row
// `[R, width]` without its per-expert block (columns experts_col..counts_col), then, when
// experts_per_rank > 0, `rank`'s received rows per local expert, rounded up to `alignment`; those
// counts also into expert_out (int32 [experts_per_rank] on the GPU) when it is given.
struct ReadArgs {
  intptr_t rows = 0;  // int64 [R, width] on the GPU
  int num_ranks = 0, width = 0, experts_col = 0, counts_col = 0;
  intptr_t host_out = 0;  // int64 [R * (width - (counts_col - experts_col)) + experts_per_rank], device address
  intptr_t expert_out = 0;
  int rank = 0, experts_per_rank = 0, alignment = 1;
};
void header_read(const ReadArgs& a, intptr_t stream);

// One rank's call-header row (backends/agreement/row.py encode_row is its definition), built on
// the GPU in one launch: the host words travel as kernel parameters (no staging copy), then the
// device parts: routing-check words, per-expert counts (int32 slots, zero past the given ones) and
// counts per rank, each zero when absent; the token count is the last word.
constexpr int kMaxRowWords = 32;
struct RowArgs {
  int64_t words[kMaxRowWords] = {};  // header fields, then the token count
  int num_fields = 0;                // words before the token count
  int num_ranks = 0, expert_slots = 0, num_checks = 0;
  intptr_t checks = 0;                // int64 [num_checks] or 0
  intptr_t counts = 0;                // [num_ranks] int32 or int64, or 0
  bool counts64 = false;
  intptr_t experts = 0;               // [num_experts] int32 or int64, or 0
  bool experts64 = false;
  int num_experts = 0;
  intptr_t out = 0;                   // int64 [num_fields + num_checks + expert_slots / 2 + num_ranks + 1]
};
void encode_row(const RowArgs& a, intptr_t stream);

// Loads every internode kernel on the current device now. Under lazy module loading (the
// CUDA 12.2+ and PyTorch default) a kernel's first launch loads it while holding the context
// lock until the GPU drains; if that happens while a dispatch/combine kernel waits for the
// proxies (e.g. dispatch_finish right after the first dispatch), the proxies' CUDA calls block
// behind the lock and nothing moves until the kernels time out. Call once per Buffer, idle.
void preload_kernels();

}  // namespace uccl_ep::internode
