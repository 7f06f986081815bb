// Host API of the intranode (NVLink / xGMI) kernels: plain functions taking raw device
// pointers (as intptr_t), sizes and a stream handle, so the bindings need no GPU headers and
// `_C` never links libtorch. Python (backends/intranode/) allocates every tensor.
//
// Memory model. Every rank owns one registered buffer (`num_nvl_bytes`, cudaMalloc'd, IPC
// shared with the node's other ranks):
//   [0, kDataOffset)  control: barrier flags, the count matrix and per-expert counts that the
//                     notify step writes into every peer;
//   [kDataOffset, ..) staging: rows peers push to this rank, placed at their final row index
//                     (dispatch) or at (expert rank, position) order (combine), so a sender
//                     never waits for a receiver to free ring slots.
// Rows a rank sends to itself go straight into its output tensors. Peer rows go straight into
// the receiver's output tensors too when they lie in its receive arena (a second registered
// region, mapped by every peer once: zero-copy receive, see kRecvEntryOffset); otherwise they
// are staged and then copied locally (HBM, ~12x cheaper than the link) into the outputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace uccl_ep::kernels {

constexpr int kMaxRanks = 8;
constexpr int kMaxLocalExperts = 4096;
constexpr int kMaxTopk = 32;
// Control-region layout (bytes from the buffer start).
// Notify writes counts into peers BEFORE its barrier, while a peer may still be reading the
// previous dispatch's (its receivers read the source token counts; a peer sending it nothing
// never waits for it). So those words are double-buffered by the notify's sequence parity:
// consecutive dispatches get consecutive sequence numbers, and any call between them (a
// combine, a regrow) is itself a barrier after which the older slot is no longer read.
constexpr int kNotifySlots = 2;
constexpr size_t kFlagsOffset = 0;            // uint64 [kMaxRanks]
constexpr size_t kCountsOffset = 256;         // int32 [kNotifySlots][kMaxRanks][kMaxRanks]
constexpr size_t kTokensOffset = 768;         // int32 [kNotifySlots][kMaxRanks]: each source's T
constexpr size_t kExpertCountsOffset = 1024;  // int32 [kNotifySlots][kMaxRanks][kMaxLocalExperts]
// Dispatch progress: uint64 [kMaxRanks source][kMaxChunks], {seq:24 | first row:20 | rows:20}.
constexpr int kMaxChunks = 4096;
static_assert(kCountsOffset + 4 * kNotifySlots * kMaxRanks * kMaxRanks <= kTokensOffset, "control overlap");
static_assert(kTokensOffset + 4 * kNotifySlots * kMaxRanks <= kExpertCountsOffset, "control overlap");
constexpr size_t kChunkFlagsOffset = kExpertCountsOffset + 4ull * kNotifySlots * kMaxRanks * kMaxLocalExperts;
// Each source's input checks, written by notify like the counts: int64
// [kNotifySlots][kMaxRanks][kCheckWords] = {min id, max id ((-1, -1) when not checked), first
// rank d whose num_tokens_per_rank[d] differs from is_token_in_rank's column sum (-1: none),
// that num_tokens_per_rank[d], that column sum, 0}; in the spare 64 KiB.
constexpr int kCheckWords = 6;
constexpr size_t kIdBoundsOffset = kChunkFlagsOffset + 8ull * kMaxRanks * kMaxChunks;
constexpr size_t kDataOffset = kChunkFlagsOffset + 8ull * kMaxRanks * kMaxChunks + 64 * 1024;
// The call sequence lives on the device, not in kernel arguments, so a captured CUDA graph
// replays with fresh sequence numbers: uint64 last sequence used; at +8 a uint32 count of the
// combine blocks that finished (the last one advances the sequence and zeroes this count and
// the one at +16); at +12 a uint32 count of the dispatch sender blocks that finished (the last
// one signals the zero-copy destinations and resets it); at +16 a uint32 count of the tokens
// handed out to the combine's reducer warps; at +20 a uint32 count of the dispatch kernel's
// blocks that finished (the last one fills the outputs of a failed call and resets it); at +24
// a uint64 count of the notify blocks of a dispatch kernel that runs notify itself that
// finished (its data blocks wait for all of them; its last block resets it).
// notify: seq = last + 1 (stored at once, one block); dispatch: seq = last (its notify's);
// combine: last + 1, stored by its last block to finish.
constexpr size_t kSeqOffset = kIdBoundsOffset + 8ull * kCheckWords * kNotifySlots * kMaxRanks;
// Peer abort: a rank that gives up on a call writes a word at [its rank] into every peer's
// control region (never cleared: its Buffer is unusable from then on). A wait that finds the
// word of the peer it waits for stops at once, and a barrier that a peer passed before giving
// up (it signals before it waits) still fails on the one load of that word after arriving,
// both as kStatusPeerAbort, so a rank that reaches the call late raises instead of moving rows
// its peer never takes or sends. Word: {seq:32 | peer waited for:8 | site:8 | kind:8 | error
// class code:8} (abort_word). Kinds: the host rejected its arguments (the reason, text,
// NUL-padded, is written first) or gave up on the host (interrupted, failed, stuck stream:
// reason text too); a kernel wait of it timed out (no text: seq, site and peer say it all); its
// process exited (posted by the survivor itself, see kAbortPeerExited).
constexpr size_t kAbortOffset = kSeqOffset + 64;  // uint64 [kMaxRanks]
static_assert(kSeqOffset + 32 <= kAbortOffset && kAbortOffset < kDataOffset, "control overlap");
constexpr uint64_t kAbortRejected = 1;
constexpr uint64_t kAbortTimedOut = 2;
constexpr uint64_t kAbortHostGaveUp = 3;
// Posted by a survivor into its own region in the name of a peer whose process exited (reason
// text: which rank and pid); the kernels treat it like any other record.
constexpr uint64_t kAbortPeerExited = 4;
constexpr uint64_t abort_word(uint64_t kind, uint64_t code, uint64_t site, uint64_t peer, uint64_t seq) {
  return (seq & 0xFFFFFFFFull) << 32 | (peer & 0xFF) << 24 | (site & 0xFF) << 16 | (kind & 0xFF) << 8 | (code & 0xFF);
}
constexpr size_t kAbortReasonBytes = 1024;
constexpr size_t kAbortReasonOffset = kAbortOffset + 8ull * kMaxRanks;  // char [kMaxRanks][kAbortReasonBytes]
// Combine's call header (dtype, hidden, weights, biases packed by the caller), exchanged with
// its entry barrier: int64 [kMaxRanks].
constexpr size_t kCombineHeaderOffset = kAbortReasonOffset + kAbortReasonBytes * kMaxRanks;
// Cached dispatch's call header, exchanged with notify's barrier: int64 [kNotifySlots][kMaxRanks]
// (by sequence parity, like the counts: back-to-back dispatches follow each other directly).
constexpr size_t kCachedHeaderOffset = kCombineHeaderOffset + 8 * kMaxRanks;
static_assert(kCachedHeaderOffset + 8 * kNotifySlots * kMaxRanks <= kDataOffset, "control overlap");
// Zero-copy receive. A rank whose outputs of a dispatch lie in its receive arena (a second
// registered region every peer maps once) tells each peer where, at the start of its dispatch
// kernel: entry [slot by notify sequence parity][source rank] of kRecvEntryWords uint64 =
// {sequence (written last, release), mode (1 zero-copy, 0 staged), byte offsets in the arena of
// recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx (-1: none), 0}. Senders
// wait for a destination's entry, then write its rows at their final row (mode 1) or into its
// staging (mode 0). Double-buffered like the counts: a peer's next dispatch kernel can start
// while a slow sender still reads this one's entry.
constexpr int kRecvEntryWords = 8;
constexpr size_t kRecvEntryOffset = kCachedHeaderOffset + 8 * kNotifySlots * kMaxRanks;
// A sender's "all my rows have landed" for a zero-copy destination: uint64 [kMaxRanks source]
// holding the dispatch's sequence (monotonic, so no slots), stored with release by the source's
// last sender block; the destination's kernel waits for every source's before it ends.
constexpr size_t kRecvDoneOffset = kRecvEntryOffset + 8ull * kRecvEntryWords * kNotifySlots * kMaxRanks;
static_assert(kRecvEntryOffset % 64 == 0, "entry alignment");
// Combine in place. A rank whose combine input x (and its weights, when given) lies in its
// receive arena tells every peer where with combine's entry barrier: int64 [kNotifySlots by the
// combine's sequence parity][source rank][4] = {the combine's sequence, byte offset of x in the
// source's arena (-1: the source pushes its rows, as before), of its weights (-1: none), 0}.
// Peers then read its rows where they lie instead of waiting for them in their staging; the
// source pushes nothing. A slot of another sequence (never written) means "pushes".
constexpr size_t kCombinePlaceOffset = kRecvDoneOffset + 8 * kMaxRanks;
// A combine's "I have read what I needed from your x": uint64 [kMaxRanks reader] holding the
// combine's sequence (monotonic), stored with release by every rank's last block when its
// reduce is done; a rank that combines in place waits for every peer's before its kernel ends,
// so its x stays intact (stream order) until nobody reads it.
constexpr size_t kCombineDoneOffset = kCombinePlaceOffset + 32ull * kNotifySlots * kMaxRanks;
// Combine progress, at the end of the spare 64 KiB: uint64 [kMaxRanks expert rank][kCombineChunks],
// the combine's sequence once chunk c of the rows that expert rank returns here has landed. Both
// sides derive the chunk size from the same row count (the dispatch's prefix matrix).
constexpr int kCombineChunks = 512;
constexpr int kCombineMinChunkRows = 64;
constexpr size_t kCombineFlagsOffset = kDataOffset - 8ull * kMaxRanks * kCombineChunks;
static_assert(kCombineDoneOffset + 8 * kMaxRanks <= kCombineFlagsOffset, "control overlap");
// notify's scan slices (NotifyParams::scan_blocks in notify.cuh). The checked inputs (expert
// ids, is_token_in_rank flags) are cut into scan_blocks slices that notify's block 0 and the
// other claiming blocks (notify's scan blocks, or a dispatch kernel's data blocks) claim one by
// one; each slice's sums go into its part for block 0. At kScanPartsOffset: uint32 claim (the
// next slice), uint32 done (blocks that stopped claiming; the last of them zeroes both for the
// next launch on the stream), then at +64 the parts, uint64 [kMaxScanBlocks][8] = {ready (1;
// block 0 zeroes it once read), min id, max id, tokens sent per rank (int32 [kMaxRanks], four
// words), 0}.
constexpr int kMaxScanBlocks = 8;
constexpr size_t kScanPartsOffset = kCombineDoneOffset + 8 * kMaxRanks;
static_assert(kScanPartsOffset % 64 == 0 && kScanPartsOffset + 64 + 64 * kMaxScanBlocks <= kCombineFlagsOffset,
              "control overlap");
// Combine pushed by the copy engine (CombineArgs::ce_value): a rank whose combine rows go back
// by cudaMemcpyAsync on a side stream instead of by its SMs. The copies wait (a stream wait on
// the word) until its kernel has passed the entry barrier: that kernel stores ce_value at
// kCeGateOffset of its own region. After chunk c of the rows it returns to rank s, a stream
// write stores ce_value at [its rank][c] of s's kCeFlagsOffset (the default write is fenced
// after the copy); s's reducers wait for a value >= the one its place slot announced. Values
// come from one process-wide counter, so a word never holds a later call's value early.
constexpr int kCeChunks = 8;
constexpr int kCeMinChunkRows = 64;
constexpr size_t kCeFlagsOffset = (kScanPartsOffset + 64 + 64 * kMaxScanBlocks + 63) / 64 * 64;
constexpr size_t kCeGateOffset = kCeFlagsOffset + 8ull * kMaxRanks * kCeChunks;
static_assert(kCeGateOffset + 64 <= kCombineFlagsOffset, "control overlap");
// Rows per copy-engine chunk of the `rows` rows one rank returns to another (both sides).
constexpr int64_t ce_chunk_rows(int64_t rows) {
  const int64_t per = (rows + kCeChunks - 1) / kCeChunks;
  return per > kCeMinChunkRows ? per : kCeMinChunkRows;
}
// Status words in mapped host memory, set by the first wait that times out or, in sync-free
// mode (num_worst_tokens > 0), by the first bad input the kernels find. Word 0 is the code.
// The kernels read a device-memory flag set with them instead (StatusRef in common.cuh): any
// non-zero flag makes every later kernel of the Buffer skip its data movement.
constexpr int kStatusWords = 4;
// Word kStatusFlagWord of the host block (past the status words of either path: 4 here, 6 for
// the internode kernels; host side only) holds the device address of that flag
// (host_status_alloc allocates both; the internode status_alloc uses it too).
constexpr int kStatusFlagWord = 8;
// Then the readback of an exact dispatch's notify (int64 words): [ready, info[R*R + local
// experts] (as notify's out_info), every rank's checks[R * kCheckWords]] at fixed offsets.
// The host clears `ready` before the launch and spins on it (intranode_read_counts): notify
// writes the words into mapped host memory (posted writes) and then sets ready = 1, or -1 when
// its barrier failed. No copy kernel, no stream synchronize, and the host resumes while notify
// still scans the send positions.
constexpr int kReadbackWord = kStatusFlagWord + 1;
constexpr int kReadbackInfo = 1;
constexpr int kReadbackChecks = kReadbackInfo + kMaxRanks * kMaxRanks + kMaxLocalExperts;
constexpr int kHostBlockWords = kReadbackWord + kReadbackChecks + kMaxRanks * kCheckWords;
// {kStatusTimeout, stalled peer rank, barrier sequence, site code}
constexpr int64_t kStatusTimeout = 1;
// {code, rank, value, extra}: rank r's topk_idx holds expert id `value` outside [-1, E) (extra = E)
constexpr int64_t kStatusBadExpertId = 2;
// rank r's num_tokens_per_rank[value] disagrees with is_token_in_rank (extra = given << 32 | actual)
constexpr int64_t kStatusLayoutMismatch = 3;
// rank r receives `value` rows in a dispatch but num_worst_tokens = extra
constexpr int64_t kStatusDispatchOverflow = 4;
// rank r gets `value` rows back in a combine of a sync-free handle but staging holds extra rows
constexpr int64_t kStatusCombineOverflow = 5;
// {code, peer, barrier sequence, site}: peer posted an abort record (it rejected the call, gave
// up on it, or one of its waits timed out; the record in this rank's control region says which)
constexpr int64_t kStatusPeerAbort = 6;
// {code, peer, barrier sequence, site}: peer's cached dispatch / combine header differs
constexpr int64_t kStatusHeaderMismatch = 7;

// ---- memory / IPC -------------------------------------------------------------------------
// Writes this rank's abort record (see kAbortOffset) into every other rank's buffer: the reason
// first, then the word, in order on a private stream, and waits for both (error path only).
void post_abort(const std::vector<intptr_t>& buffers, int rank, uint64_t word, const std::string& reason);
// Writes rank `peer`'s abort record into this rank's own buffer, in the peer's name: a rank that
// learns on the host that `peer` can no longer post one (its process exited) stops its own waits
// for it.
void post_abort_as(intptr_t own_buffer, int peer, uint64_t word, const std::string& reason);
// Reads rank `peer`'s abort record from this rank's own buffer: (word, reason).
std::pair<uint64_t, std::string> read_abort(intptr_t own_buffer, int peer);
intptr_t device_alloc_zeroed(size_t bytes);
void device_free(intptr_t ptr);
// Synchronous device-to-device copy (a buffer regrow carries the control region over).
void device_copy(intptr_t dst, intptr_t src, size_t bytes);
std::string ipc_get_handle(intptr_t ptr);
intptr_t ipc_open_handle(const std::string& handle);
void ipc_close_handle(intptr_t ptr);
// Pinned, device-mapped host words plus their device flag (on the current device); returns
// the host pointer (also valid on the device: UVA).
intptr_t host_status_alloc();
void host_status_free(intptr_t ptr);
// Records a failure from the host as the kernels would (first one wins; words[0] is the
// non-zero code): the host words, then the device flag (synchronously), so every later kernel
// of the Buffer skips its data movement and poisons its outputs.
void host_status_record(intptr_t ptr, const std::vector<int64_t>& words);
// Waits (spinning, up to `timeout_ns`) for the readback of the notify launched with it:
// 1 = the words are there, -1 = notify's barrier failed (the status words say why), 0 = notify
// did not finish in time (the stream is stuck behind earlier work).
int host_readback_wait(intptr_t ptr, int64_t timeout_ns);
// When the status word is set (a wait of this call timed out, so its kernels skipped their data
// movement), fills each region [ptrs[i], ptrs[i] + bytes[i]) with the 8-byte `patterns[i]`
// (little-endian, repeated; regions start 8-byte aligned); otherwise does nothing. Launched on
// the call's stream after its last kernel, so outputs are never left uninitialised (the
// intranode dispatch and combine kernels do it themselves: DispatchArgs::poison).
void poison_if_failed(intptr_t status, const std::vector<intptr_t>& ptrs, const std::vector<int64_t>& bytes,
                      const std::vector<uint64_t>& patterns, intptr_t stream);

// Whether the current GPU has bulk copies (TMA, sm_90+), used when `use_tma` is set.
bool tma_supported();

// ---- stream ordering of the receive arena (bindings/recv_arena.cc) ------------------------
// Events without timing, created on `device` (the current device is restored). Any thread.
intptr_t event_create(int device);
void event_destroy(intptr_t event);
void event_record(intptr_t event, intptr_t stream);
// Whether the work the event's last record covers has finished (a never-recorded event has).
bool event_done(intptr_t event);
void stream_wait_event(intptr_t stream, intptr_t event);
// Copies `bytes` of device memory from `src` to `dst` (this device's, or a peer's as mapped here) on
// `stream`, asynchronously.
void copy_on_stream(intptr_t dst, intptr_t src, int64_t bytes, intptr_t stream);
// Stream memory operations (no kernel): `stream` waits until the uint64 at `addr` is >= `value`;
// or writes `value` there once the stream's earlier work is done (fenced after it).
void stream_wait_at_least(intptr_t stream, intptr_t addr, uint64_t value);
void stream_write_word(intptr_t stream, intptr_t addr, uint64_t value);
// A fresh value for CombineArgs::ce_value (process-wide, never 0, never repeated).
uint64_t next_ce_value();
// Whether `stream` is being captured into a CUDA graph (no event may be recorded on it then).
bool stream_capturing(intptr_t stream);
// device_free on `device` (the current device is restored).
void device_free_on(int device, intptr_t ptr);

// ---- layout -------------------------------------------------------------------------------
void get_dispatch_layout(intptr_t topk_idx, bool idx_is_64, int num_tokens, int num_topk,
                         int num_ranks, int num_experts, intptr_t num_tokens_per_rank,
                         intptr_t num_tokens_per_expert, intptr_t is_token_in_rank, intptr_t stream);

// ---- dispatch -----------------------------------------------------------------------------
// notify exchanges each rank's per-rank counts (and per-expert counts for the receiver's
// experts) with every peer, then writes `out_info` = [rank_prefix_matrix (R*R) | aligned per-
// local-expert counts (experts_per_rank)]. It doubles as the entry barrier of a dispatch (peers
// write into our staging only after it). When `send_pos` is non-zero it also scans
// is_token_in_rank [T, R] into send_pos [T, R]. The (min, max) of `topk_idx`
// ([num_tokens, num_topk], int64 or int32 by `idx_is_64`; 0 = no ids: (-1, -1)), scanned here
// before the barrier instead of by separate launches, and, when `send_pos` is set, the check of
// num_tokens_per_rank against is_token_in_rank (a mismatch would place rows past the outputs)
// travel to every rank with the counts; with `readback` (the host block's kReadbackWord, or 0)
// every rank's checks and out_info go to the host (see kReadbackWord), so all ranks see a bad
// input of any rank at the host read that sizes the outputs, and raise together before any
// row moves. `header` (the call's dtype, hidden, scales, top-k, experts, packed by the caller)
// travels with the checks (word 5); a cached dispatch (`send_pos` 0) compares it with the
// barrier instead (kStatusHeaderMismatch).
// Sync-free mode (`num_worst_tokens` > 0): notify itself judges every rank's checks and the
// received row counts (> num_worst_tokens is an overflow) and records the first failure in the
// status word (kStatusBadExpertId...), identically on every rank, so the dispatch kernel that
// follows skips its data movement everywhere and the host raises at its next call.
struct NotifyArgs {
  std::vector<intptr_t> buffers;  // registered buffer base of every rank (own included)
  int rank = 0, num_ranks = 0;
  intptr_t num_tokens_per_rank = 0;    // [R] int32
  intptr_t num_tokens_per_expert = 0;  // [R * experts_per_rank] int32, or 0
  int experts_per_rank = 0, expert_alignment = 1;
  intptr_t out_info = 0;  // [R*R + experts_per_rank] int32
  intptr_t status = 0;
  int64_t timeout_ns = 0;
  intptr_t is_token_in_rank = 0;  // [T, R] bool
  int num_tokens = 0;
  intptr_t send_pos = 0;  // [T, R] int32, or 0
  intptr_t topk_idx = 0;
  bool idx_is_64 = true;
  int num_topk = 0;
  intptr_t readback = 0;
  int num_worst_tokens = 0, num_experts = 0;
  int64_t header = 0;
  std::vector<int64_t> recv_entry;  // see kRecvEntryArgs
};
// notify as its own kernel.
void intranode_notify(const NotifyArgs& a, intptr_t stream);
// `recv_entry` of notify: this rank's receive entry words after the sequence ({mode, offsets of
// recv_x, scales, ids, weights, sources}, kRecvEntryOffset), written into every peer before the
// barrier, so the dispatch kernel's senders find it at once. Sync-free calls give it (their
// outputs exist before notify); empty: the dispatch kernel publishes it (DispatchArgs).
constexpr int kRecvEntryArgs = 6;
static_assert(1 + kRecvEntryArgs <= kRecvEntryWords, "receive entry words");

// A call's output regions, each filled with its 8-byte pattern (little-endian, repeated) when the
// call failed: by poison_if_failed, or by the last block of the intranode dispatch and combine
// kernels to finish, when the status is set by then (no kernel launch of its own).
constexpr int kMaxPoisonRegions = 8;
struct PoisonRegions {
  intptr_t ptr[kMaxPoisonRegions] = {};
  int64_t bytes[kMaxPoisonRegions] = {};
  uint64_t pattern[kMaxPoisonRegions] = {};
  int count = 0;
  // Adds [ptr, ptr + bytes) (nothing when bytes is 0); checked: non-null, 8-byte aligned.
  void add(intptr_t ptr, int64_t bytes, uint64_t pattern);
};

struct DispatchArgs {
  std::vector<intptr_t> buffers;  // registered buffer base of every rank (own included)
  int rank = 0, num_ranks = 0, num_tokens = 0, experts_per_rank = 0;
  intptr_t x = 0;                 // [T, row_bytes]
  int64_t row_bytes = 0;
  intptr_t x_scales = 0;          // [T, num_scales] float32 or 0
  int num_scales = 0;
  intptr_t topk_idx = 0;          // [T, K] int64 or int32, or 0
  bool idx_is_64 = true;
  intptr_t topk_weights = 0;      // [T, K] float32 or 0
  int num_topk = 0;
  intptr_t is_token_in_rank = 0;  // [T, R] bool
  intptr_t rank_prefix_matrix = 0;  // device [R, R] int32
  intptr_t send_pos = 0;          // [T, R] int32 from notify (or the handle when cached)
  bool cached = false;
  // Local outputs; recv_* rows are the final rows (staged peer rows are copied into them).
  intptr_t recv_x = 0, recv_scales = 0, recv_topk_idx = 0, recv_topk_weights = 0, recv_src_idx = 0;
  // Rows received (exact mode) or its bound num_worst_tokens (sync-free mode: the kernel reads
  // the real count and every source's first row from rank_prefix_matrix); rows of the outputs.
  int num_recv = 0, num_out_rows = 0;
  int own_rows = -1;              // rows this rank keeps for itself; -1 = unknown (sync-free)
  int64_t staging_rows = 0;       // capacity (rows) of every rank's staging this call
  int64_t buffer_bytes = 0;       // size of every rank's registered buffer
  int64_t send_rows = -1;         // rows this rank writes (all destinations); -1 = unknown (sync-free)
  int num_sms = 24;
  bool use_tma = false;           // bulk copies (TMA) for the rows when the GPU has them
  intptr_t status = 0;
  int64_t timeout_ns = 0;
  // Receive arena base of every rank as this rank maps it (own included; empty: no arenas).
  std::vector<intptr_t> arenas;
  // This rank's recv_* lie in its own arena: peers write them directly (no staging, no
  // receiver blocks); otherwise they stage this rank's rows as before.
  bool zero_copy = false;
  bool entry_published = false;   // notify already wrote this call's receive entry (recv_entry)
  // Launch-ahead (an exact dispatch launched before the host read its counts; outputs of
  // num_out_rows rows, num_recv = num_out_rows): the kernel first judges every rank's checks
  // and the count matrix of its notify (as sync-free notify does, with num_out_rows as the
  // bound, over `num_experts` ids) and, on any failure, skips the call on every rank alike
  // without recording a status; the host raises the input error from the readback, or runs the
  // call again with exact sizes when a rank receives more than num_out_rows rows.
  bool judge = false;
  int num_experts = 0;
  PoisonRegions poison;  // the outputs, filled when the call failed
  // notify folded into this launch (one launch less): its blocks come first in the grid, and
  // the data blocks wait for them (notify_done_blocks). Its out_info must be rank_prefix_matrix
  // and its send_pos this call's (none for a cached call). Null: notify ran before, on the stream.
  const NotifyArgs* notify = nullptr;
};
// Bytes of registered buffer (control region included) a dispatch with these sizes needs.
int64_t dispatch_staging_bytes(int64_t rows, int64_t row_bytes, int num_scales, int num_topk, int idx_size);
// One pipelined kernel: sender blocks write every row to each destination rank chunk by
// chunk: straight into its outputs when it receives zero-copy (own rows always), else into its
// staging, publishing each chunk's row range in its control region. On a staged rank receiver
// blocks copy each peer chunk from staging into the outputs as soon as it lands (overlapping
// the local copy with the NVLink transfer); on a zero-copy rank every block sends, and the
// kernel ends only after every peer said its rows landed. Then padding rows are filled.
void intranode_dispatch(const DispatchArgs& a, intptr_t stream);

// ---- combine ------------------------------------------------------------------------------
struct CombineArgs {
  std::vector<intptr_t> buffers;
  int rank = 0, num_ranks = 0;
  int dtype = 0;                   // 0 bf16, 1 fp16, 2 fp32
  int hidden = 0;
  intptr_t x = 0;                  // [num_recv(+padding), hidden] rows in dispatch's recv order
  intptr_t topk_weights = 0;       // [.., K] float32 or 0
  int num_topk = 0;
  int num_recv = 0;                // rows of x to return: the received count or its bound
  intptr_t rank_prefix_matrix = 0; // device [R, R] int32 from dispatch (every offset comes from it)
  intptr_t send_pos = 0;           // [T, R] int32 from dispatch
  int num_tokens = 0;
  intptr_t bias0 = 0, bias1 = 0;   // [T, hidden] of x's dtype or 0
  intptr_t out = 0, out_weights = 0;
  // Rows every rank's combine staging holds: exact when the host knows the matrix; in sync-free
  // mode num_worst_tokens, and push records kStatusCombineOverflow when a rank gets more back.
  int64_t staging_rows = 0;
  int64_t buffer_bytes = 0;
  int num_sms = 24;
  bool use_tma = false;
  intptr_t status = 0;
  int64_t timeout_ns = 0;
  int64_t header = 0;  // what every rank's combine must agree on (kCombineHeaderOffset)
  // Receive arena base of every rank as this rank maps it (empty: no arenas), and the byte
  // offsets in this rank's arena of x and of topk_weights when it combines in place (x_place
  // >= 0: peers read its rows there, it pushes none; -1: it pushes, see kCombinePlaceOffset).
  std::vector<intptr_t> arenas;
  int64_t x_place = -1, w_place = -1;
  PoisonRegions poison;  // out and out_weights, filled when the call failed
  // Push by the copy engine (kCeFlagsOffset; 0: no): this call's value, the side stream and an
  // event (the call's stream waits for the copies with it), and per peer the rows this rank
  // returns to it, where they start in x and where they go in its staging (row indices).
  uint64_t ce_value = 0;
  intptr_t ce_stream = 0, ce_event = 0;
  std::vector<int64_t> ce_rows, ce_begin, ce_dst;
};
// Bytes of registered buffer (control region included) a combine with these sizes needs.
int64_t combine_staging_bytes(int64_t rows, int64_t row_bytes, int num_topk);
// Blocks of a combine grid of `blocks` that push rows back before they reduce (the rest reduce
// from the start), from the rows each side moves (docs/performance.md, "splits"): a
// pushed row is read and written (2 row transfers); `reduce_rows` counts every returned row
// read plus one row written per token, weighted 1/2 (measured: ~0.9 of a push transfer's cost,
// less with more loads in flight). Rounded up: pushers that are done reduce too, so an
// over-share costs little, while an under-share makes the kernel wait for its pushes. At
// least one block per side that has work.
constexpr int combine_push_blocks(int64_t push_rows, int64_t reduce_rows, int blocks) {
  if (push_rows <= 0) return 0;
  if (reduce_rows <= 0) return blocks;
  const int64_t push = 4 * push_rows, reduce = reduce_rows;
  const int64_t share = (blocks * push + push + reduce - 1) / (push + reduce);
  return static_cast<int>(share < 1 ? 1 : share > blocks - 1 ? blocks - 1 : share);
}
// One pipelined kernel: an entry barrier, then pusher blocks send each received row back to
// its source rank's staging chunk by chunk, publishing each chunk in the source's control
// region (kCombineFlagsOffset), while reducer warps (and pushers once done) take tokens in
// order and sum each token's rows (own rows read in place) in rank order in fp32 as soon as
// the chunks holding them have landed. A rank whose x lies in its receive arena (x_place) is
// not pushed from: the others read its rows there (kCombinePlaceOffset, kCombineDoneOffset).
void intranode_combine(const CombineArgs& a, intptr_t stream);

}  // namespace uccl_ep::kernels
