#include "tnt/node_group.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>

#include "tnt/errors.hpp"
#include "tnt/reduce.hpp"
#include "tnt/shared_arrays.hpp"

namespace tnt {

// ---------------------------------------------------------------------------------------------
// Segment layout: SegHeader | RankCtl[local_size] | data (2 halves per local rank).
// Everything shared is either written before a release-store of a counter and read after the
// matching acquire-load, or is itself atomic.

namespace {

constexpr uint64_t kMagic = 0x746e742d73686d31ull;  // "tnt-shm1"
enum Which { kPacked = 0, kReduced = 1, kGathered = 2 };
enum State : int32_t { kEmpty = 0, kAttached = 1, kClosed = 2 };

struct alignas(64) Counter {
  std::atomic<uint64_t> v{0};
};

}  // namespace

struct Header {  // one rank's description of its call, per round parity
  int64_t kind, count, dtype, op, bucket;
  int64_t status;    // set by a part owner: 0 ok, 1 the call differs across nodes
  int64_t other[5];  // then: a call made on another node (kind -1: a node disagrees)
  SharedLoc in, out;  // where the input and output lie if they are shared arrays (fd -1: not)
  int64_t via_mpi;    // 1: the rank carries the call out through MPI (see publish_call)
};

struct alignas(64) RankCtl {
  Counter counters[3];  // packed, reduced, gathered: last round that reached the stage
  alignas(64) Header hdr[2];
  alignas(64) std::atomic<int32_t> state{kEmpty};
  int32_t pid = 0;
  int32_t world_rank = -1;
  // While the rank waits on an exchange with other nodes: when that wait ends (steady clock, ns).
  std::atomic<int64_t> awaits_nodes_until{0};
  char abort_msg[256] = {};
};

struct alignas(64) SegHeader {
  uint64_t magic = 0;
  uint32_t local_size = 0, nparts = 0;
  uint64_t half_bytes = 0;
  std::atomic<int32_t> abort_local{-1};  // local rank that aborted first, -1 if none
};

namespace {

constexpr size_t kStreamBytes = size_t{4} << 20;

// Copies two lists of spans in alternating pieces of 1 kB: a gather, whose loads come from the
// cache and whose stores go to memory, with the next round's packing, whose loads come from
// memory and whose stores stay in the cache. Apart, each keeps only one direction of the memory
// busy; together they overlap (2 ranks, builds alternating: 16 MB 3.1-3.3 -> 2.8-3.0 ms, 64 MB
// 11.6-12.7 -> 10.2-10.5 ms; in a C model of the pipeline, the finer the pieces the better,
// down to 1 kB).
void copy_together(const std::vector<Span>& a, bool stream_a, const std::vector<Span>& b) {
  size_t ia = 0, oa = 0, ib = 0, ob = 0;
  auto step = [](const std::vector<Span>& spans, size_t& i, size_t& o, bool stream) {
    if (i == spans.size()) return;
    const Span& s = spans[i];
    const size_t n = std::min(size_t{1024}, s.bytes - o);
    copy_bytes(s.dst + o, s.src + o, n, stream);
    o += n;
    if (o == s.bytes) ++i, o = 0;
  };
  while (ia < a.size() || ib < b.size()) {
    step(a, ia, oa, stream_a);
    step(b, ib, ob, false);
  }
}

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

size_t ctl_offset() { return align_up(sizeof(SegHeader), 64); }
size_t data_offset(int local_size) {
  return align_up(ctl_offset() + sizeof(RankCtl) * static_cast<size_t>(local_size), 4096);
}
size_t half_bytes_of(const NodeConfig& cfg) {
  // Each half holds one round: at least 16 elements of 8 bytes per part.
  size_t min_half = 16 * 8 * static_cast<size_t>(cfg.nparts);
  return align_up(std::max(cfg.slot_bytes / 2, min_half), 64);
}

std::string describe_call(const Header& h) {
  char buf[160];
  auto kind = static_cast<Kind>(h.kind);
  if (h.kind < 0 || h.kind > 3 || !valid_dtype(static_cast<int32_t>(h.dtype)) ||
      !valid_op(static_cast<int32_t>(h.op)))
    return "a different call";
  if (kind == Kind::barrier) return "barrier";
  if (kind == Kind::broadcast) {
    snprintf(buf, sizeof buf, "broadcast from root %lld", static_cast<long long>(h.bucket));
    return buf;
  }
  snprintf(buf, sizeof buf, "%s of %lld x %s (op %s%s",
           kind == Kind::gather ? "gather of an allreduce" : "allreduce",
           static_cast<long long>(h.count), dtype_name(static_cast<DType>(h.dtype)),
           op_name(static_cast<Op>(h.op)), h.bucket >= 0 ? ", bucket " : "");
  std::string s = buf;
  if (h.bucket >= 0) s += std::to_string(h.bucket);
  return s + (h.via_mpi ? ", through MPI)" : ")");
}

// (Ranks take the same path at the same call; one that did not would otherwise meet the others'
// rounds without its data.)
bool same_call(const Header& a, const Header& b) {
  return a.kind == b.kind && a.count == b.count && a.dtype == b.dtype && a.op == b.op &&
         a.bucket == b.bucket && a.via_mpi == b.via_mpi;
}

const char* kind_name(Kind k) {
  return k == Kind::barrier ? "barrier" : k == Kind::broadcast ? "broadcast" : "allreduce";
}

}  // namespace

void fill_call_check(const int64_t fields[6], int64_t v[12]) {
  for (int i = 0; i < 6; ++i) v[i] = fields[i], v[6 + i] = -fields[i];
}

bool call_check_result(const int64_t fields[6], const int64_t v[12], int64_t other[5]) {
  bool same = true;
  for (int i = 0; i < 6; ++i) same = same && v[i] == -v[6 + i];
  if (!same) {  // one of max and min is another call
    int64_t lo[5];
    for (int i = 0; i < 5; ++i) lo[i] = -v[6 + i];
    const bool max_is_mine = std::equal(v, v + 5, fields);
    std::copy(max_is_mine ? lo : v, (max_is_mine ? lo : v) + 5, other);
    if (max_is_mine && std::equal(lo, lo + 5, fields))
      other[0] = -1;  // the same call everywhere, but some node's ranks disagree among themselves
  }
  return same;
}

std::string ranks_disagree(const int64_t mine[5], const int64_t other[5]) {
  Header a{mine[0], mine[1], mine[2], mine[3], mine[4], 0, {}, {}, {}, 0};
  Header b{other[0], other[1], other[2], other[3], other[4], 0, {}, {}, {}, 0};
  return "ranks called collectives with different arguments: this rank: " + describe_call(a) +
         "; another rank: " + describe_call(b);
}

std::string nodes_disagree(const int64_t mine[5], const int64_t other[5]) {
  Header a{mine[0], mine[1], mine[2], mine[3], mine[4], 0, {}, {}, {}, 0};
  Header b{other[0], other[1], other[2], other[3], other[4], 0, {}, {}, {}, 0};
  return "ranks on different nodes called collectives with different arguments: this node: " +
         describe_call(a) + "; another node: " +
         (other[0] < 0 ? std::string("its ranks disagree among themselves") : describe_call(b));
}

size_t segment_bytes(const NodeConfig& cfg) {
  return data_offset(cfg.local_size) + 2 * half_bytes_of(cfg) * static_cast<size_t>(cfg.local_size);
}

size_t part_bytes(const NodeConfig& cfg) {
  return half_bytes_of(cfg) / static_cast<size_t>(cfg.nparts);
}

std::pair<size_t, size_t> part_of(size_t len, int nparts, int j) {
  const size_t P = static_cast<size_t>(nparts), q = ((len + P - 1) / P + 15) / 16 * 16;
  return {std::min(static_cast<size_t>(j) * q, len), std::min(static_cast<size_t>(j + 1) * q, len)};
}

struct NodeGroup::Deadline {
  std::chrono::steady_clock::time_point end;
  double timeout_s;
  const InterruptCheck* interrupt;
  const char* what;
};

NodeGroup::NodeGroup(NodeConfig cfg, Segment* seg, bool creator) : cfg_(std::move(cfg)), seg_(seg) {
  char* base = seg_->data();
  hdr_ = reinterpret_cast<SegHeader*>(base);
  ctl_ = reinterpret_cast<RankCtl*>(base + ctl_offset());
  data_ = base + data_offset(cfg_.local_size);
  half_bytes_ = half_bytes_of(cfg_);
  if (creator) {
    new (hdr_) SegHeader();
    for (int i = 0; i < cfg_.local_size; ++i) new (&ctl_[i]) RankCtl();
    hdr_->local_size = static_cast<uint32_t>(cfg_.local_size);
    hdr_->nparts = static_cast<uint32_t>(cfg_.nparts);
    hdr_->half_bytes = half_bytes_;
    std::atomic_thread_fence(std::memory_order_release);
    hdr_->magic = kMagic;
  }
  srcs_.resize(static_cast<size_t>(cfg_.local_size) + 1);
  peer_in_.resize(static_cast<size_t>(cfg_.local_size));
}

NodeGroup::~NodeGroup() {
  for (const auto& [key, base] : peer_blocks_)
    unmap_peer_block(base, static_cast<size_t>(std::get<2>(key)));
}

void NodeGroup::attach() {
  std::atomic_thread_fence(std::memory_order_acquire);
  if (hdr_->magic != kMagic || hdr_->local_size != static_cast<uint32_t>(cfg_.local_size) ||
      hdr_->half_bytes != half_bytes_)
    throw CollectiveError("shared-memory segment " + seg_->name() +
                          " does not match this rank's configuration "
                          "(do all ranks use the same TNT_SHM_SEGMENT_BYTES?)");
  RankCtl& me = ctl_[cfg_.local_rank];
  me.pid = static_cast<int32_t>(getpid());
  me.world_rank = cfg_.world_ranks[cfg_.local_rank];
  me.state.store(kAttached, std::memory_order_release);
}

size_t NodeGroup::round_elements(size_t element_bytes) const {
  const size_t unit = 16 * static_cast<size_t>(cfg_.nparts);
  return std::max(unit, (half_bytes_ / element_bytes) / unit * unit);
}

char* NodeGroup::half(int local, uint64_t round) const {
  return data_ + (static_cast<size_t>(local) * 2 + (round & 1)) * half_bytes_;
}

void NodeGroup::abort(const std::string& why, bool propagate) {
  if (broken_ && !propagate) return;
  const bool first = !broken_;
  broken_ = true;
  RankCtl& me = ctl_[cfg_.local_rank];
  snprintf(me.abort_msg, sizeof me.abort_msg, "%s", why.c_str());
  int32_t expected = -1;  // (the message itself names the aborting rank where it matters)
  hdr_->abort_local.compare_exchange_strong(expected, cfg_.local_rank);
  if (first && propagate && notify_remote_) notify_remote_(why);
}

void NodeGroup::close() {
  if (hdr_) ctl_[cfg_.local_rank].state.store(kClosed, std::memory_order_release);
}

// The slow path of every wait: abort flag, liveness of the awaited rank, deadline, interrupt.
void NodeGroup::check_remote_abort(const char* what) {
  if (!poll_remote_) return;
  last_remote_poll_ = std::chrono::steady_clock::now();
  std::string msg = poll_remote_();
  if (msg.empty()) return;
  abort(msg, false);  // our node's ranks learn it from the segment
  throw AbortedError(std::string(what) + " aborted on another node: " + msg);
}

void NodeGroup::checks(const Deadline& d, int awaited, const std::function<bool()>& arrived) {
  int a = hdr_->abort_local.load(std::memory_order_acquire);
  if (a >= 0 && a != cfg_.local_rank) {
    broken_ = true;
    throw AbortedError(std::string(d.what) + " aborted by rank " +
                       std::to_string(ctl_[a].world_rank) + ": " + ctl_[a].abort_msg);
  }
  check_remote_abort(d.what);
  if (awaited >= 0) check_alive(d, awaited, arrived);
  if (std::chrono::steady_clock::now() > d.end) return;  // the caller reports the timeout
  if (d.interrupt && *d.interrupt && (*d.interrupt)()) {
    abort(std::string("rank ") + std::to_string(cfg_.world_ranks[cfg_.local_rank]) +
          " was interrupted during " + d.what);
    throw Interrupted();
  }
}

void NodeGroup::check_alive(const Deadline& d, int local, const std::function<bool()>& arrived) {
  RankCtl& peer = ctl_[local];
  const bool closed = peer.state.load(std::memory_order_acquire) == kClosed;
  const bool dead = !closed && !process_alive(peer.pid);
  // It may have reached the awaited stage just before leaving: then nothing is lost.
  if (!(closed || dead) || (arrived && arrived())) return;
  std::string who = "rank " + std::to_string(cfg_.world_ranks[local]) + " (pid " +
                    std::to_string(peer.pid) + ")";
  if (closed) {
    abort(who + " left during " + d.what);
    throw RankLostError(who + " left (shut down its engine) during " + d.what);
  }
  abort(who + " died during " + d.what);
  throw RankLostError(who + " died during " + d.what);
}

void NodeGroup::fail_timeout(const Deadline& d, int which, uint64_t value) {
  std::string missing;
  for (int j = 0; j < cfg_.local_size; ++j) {
    if (j == cfg_.local_rank) continue;
    if (ctl_[j].counters[which].v.load(std::memory_order_acquire) < value) {
      if (!missing.empty()) missing += ", ";
      missing += std::to_string(cfg_.world_ranks[j]);
    }
  }
  char secs[32];
  snprintf(secs, sizeof secs, "%g", d.timeout_s);
  std::string msg = std::string(d.what) + " timed out after " + secs + " s: rank(s) " +
                    (missing.empty() ? "?" : missing) + " did not arrive";
  abort(msg);
  throw TimeoutError(msg);
}

// A local rank that waits on other nodes has not failed to arrive: its own wait names those nodes
// when it ends (a little after ours), and its abort then ends ours with that message.
bool NodeGroup::awaits_other_nodes(int local, std::chrono::steady_clock::time_point now) const {
  const int64_t until = ctl_[local].awaits_nodes_until.load(std::memory_order_acquire);
  return until != 0 && now.time_since_epoch() < std::chrono::nanoseconds(until) +
                                                     std::chrono::seconds(kAbortArrivalSeconds);
}

void NodeGroup::wait_counter(int local, int which, uint64_t value, const Deadline& d,
                             Pending* progress) {
  std::atomic<uint64_t>& c = ctl_[local].counters[which].v;
  if (c.load(std::memory_order_acquire) >= value) return;
  Backoff backoff;
  const auto start = std::chrono::steady_clock::now();
  while (c.load(std::memory_order_acquire) < value) {
    // The exchanges in flight progress only while someone calls into the transport.
    for (Pending* pending : inflight_)
      if (pending) pending->test();
    if (progress) progress->test();
    if (backoff.pause()) {
      checks(d, local, [&] { return c.load(std::memory_order_acquire) >= value; });
      if (c.load(std::memory_order_acquire) >= value) break;
      const auto now = std::chrono::steady_clock::now();
      if (now > d.end && !awaits_other_nodes(local, now)) fail_timeout(d, which, value);
    }
  }
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void NodeGroup::wait_pending(Pending* pending, const char* what, const std::string& peers,
                             double timeout_s, const InterruptCheck& interrupt,
                             Abandonable* to_abandon, bool world_collective) {
  std::unique_ptr<Pending> own(pending);
  // A rank that never arrives is named by its own node's ranks, whose waits on it end first: a
  // wait on other nodes ends a little after the timeout, once their notice had time to come.
  const double grace = cfg_.num_nodes > 1 ? kRemoteWaitGraceSeconds : 0.0;
  Deadline d{std::chrono::steady_clock::now() +
                 std::chrono::microseconds(static_cast<int64_t>((timeout_s + grace) * 1e6)),
             timeout_s, &interrupt, what};
  // (steady_clock is CLOCK_MONOTONIC, the same in every process of the host)
  ctl_[cfg_.local_rank].awaits_nodes_until.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(d.end.time_since_epoch()).count(),
      std::memory_order_release);
  struct Clear {
    std::atomic<int64_t>& until;
    ~Clear() { until.store(0, std::memory_order_release); }
  } clear{ctl_[cfg_.local_rank].awaits_nodes_until};
  Backoff backoff(world_collective);
  // A peer that left or died may have done its part of the exchange first (MPI then completes
  // ours soon): it is only reported if the exchange is still incomplete a grace period later.
  std::chrono::steady_clock::time_point lost_at{};
  auto in_grace = [&] {
    const auto now = std::chrono::steady_clock::now();
    if (lost_at == std::chrono::steady_clock::time_point{}) lost_at = now;
    return now - lost_at < std::chrono::seconds(1);
  };
  try {
    while (!pending->test()) {
      if (backoff.pause()) {
        checks(d, -1, nullptr);
        if (world_collective)
          for (int j = 0; j < cfg_.local_size; ++j)
            if (j != cfg_.local_rank) check_alive(d, j, in_grace);
        if (std::chrono::steady_clock::now() > d.end) {
          char secs[32];
          snprintf(secs, sizeof secs, "%g", timeout_s);
          std::string msg = std::string(what) + " timed out after " + secs +
                            " s: the exchange with rank(s) " + peers + " did not complete";
          abort(msg);
          throw TimeoutError(msg);
        }
      }
    }
  } catch (...) {
    if (!broken_) {  // the exchange itself failed (no check did): this node's ranks must not wait
      try {         // for us (the transport's peers on other nodes found out themselves)
        throw;
      } catch (const std::exception& e) {
        abort(e.what(), false);
      } catch (...) {
        abort("the inter-node exchange failed", false);
      }
    }
    broken_ = true;
    if (to_abandon) {
      to_abandon->abandon();
      abandoned_ = true;
    }
    throw;
  }
}

void NodeGroup::finish_round(uint64_t round) {
  RankCtl& me = ctl_[cfg_.local_rank];
  for (auto& c : me.counters) c.v.store(round, std::memory_order_release);
}

char* NodeGroup::peer_array(int local, int64_t fd, int64_t block_bytes, int64_t offset,
                            const Deadline& d) {
  if (fd < 0) return nullptr;
  const auto key = std::make_tuple(local, fd, block_bytes);
  auto it = peer_blocks_.find(key);
  if (it == peer_blocks_.end()) {
    try {
      it = peer_blocks_
               .emplace(key, map_peer_block(ctl_[local].pid, fd, static_cast<size_t>(block_bytes)))
               .first;
    } catch (const std::exception& e) {
      const std::string msg = std::string(d.what) + ": cannot map the shared array of rank " +
                              std::to_string(cfg_.world_ranks[local]) + " (" + e.what() + ")";
      abort(msg);
      throw CollectiveError(msg);
    }
  }
  return it->second + offset;
}

void NodeGroup::map_shared_arrays(uint64_t round, const Deadline& d) {
  const int b = static_cast<int>(round & 1), me = cfg_.local_rank, p = cfg_.local_size;
  for (int j = 0; j < p; ++j) {
    const SharedLoc& in = ctl_[j].hdr[b].in;
    peer_in_[j] = j == me ? nullptr : peer_array(j, in.fd, in.block_bytes, in.offset, d);
  }
  peer_out_ = nullptr;
  // Two ranks: an owner's part has one reader, and its second store can go to that reader's
  // output instead of the segment. (More ranks gather from the segment: each part, stored once
  // there, has several readers.)
  const int other = 1 - me;
  if (p == 2 && cfg_.nparts == 2 && ctl_[me].hdr[b].out.fd >= 0) {
    const SharedLoc& out = ctl_[other].hdr[b].out;
    peer_out_ = peer_array(other, out.fd, out.block_bytes, out.offset, d);
  }
}

std::string NodeGroup::check_headers(uint64_t round) {
  const int b = static_cast<int>(round & 1);
  const Header& mine = ctl_[cfg_.local_rank].hdr[b];
  bool same = true;
  for (int j = 0; j < cfg_.local_size; ++j) same = same && same_call(ctl_[j].hdr[b], mine);
  if (same) return {};
  std::string msg = std::string("ranks called collectives with different arguments: ");
  for (int j = 0; j < cfg_.local_size; ++j) {
    if (j) msg += "; ";
    msg += "rank " + std::to_string(cfg_.world_ranks[j]) + ": " + describe_call(ctl_[j].hdr[b]);
  }
  return msg;
}

void NodeGroup::fill_cross_check(const Header& h, bool node_disagrees) {
  const int64_t fields[6] = {h.kind, h.count, h.dtype, h.op, h.bucket, node_disagrees ? 1 : 0};
  fill_call_check(fields, cross_hdr_);
}

bool NodeGroup::cross_check_result(const Header& h, bool node_disagrees, int64_t other[5]) const {
  const int64_t fields[6] = {h.kind, h.count, h.dtype, h.op, h.bucket, node_disagrees ? 1 : 0};
  return call_check_result(fields, cross_hdr_, other);
}

bool NodeGroup::cross_check(const Header& h, bool node_disagrees, Transport* cross,
                            const Deadline& d, int64_t other[5]) {
  fill_cross_check(h, node_disagrees);
  wait_pending(cross->start_checked_allreduce(cross_hdr_, nullptr, nullptr, 0, DType::f32, Op::sum),
               d.what, cross->describe_peers(), d.timeout_s, *d.interrupt, cross);
  return cross_check_result(h, node_disagrees, other);
}

void NodeGroup::check_not_aborted(const char* what) {
  if (broken_) throw AbortedError("the engine was aborted; it must be rebuilt");
  int a = hdr_->abort_local.load(std::memory_order_acquire);
  if (a >= 0) {
    broken_ = true;
    throw AbortedError(std::string(what) + " aborted by rank " +
                       std::to_string(ctl_[a].world_rank) + ": " + ctl_[a].abort_msg);
  }
  // Polling other nodes is a system call: back-to-back calls poll once a millisecond (a wait
  // polls every few milliseconds anyway).
  if (std::chrono::steady_clock::now() - last_remote_poll_ >= std::chrono::milliseconds(1))
    check_remote_abort(what);
}

uint64_t NodeGroup::publish_call(const Call& call, size_t count, double timeout_s,
                                 const InterruptCheck& interrupt) {
  const char* what = kind_name(call.kind);
  check_not_aborted(what);
  const int me = cfg_.local_rank, p = cfg_.local_size;
  const Deadline d{std::chrono::steady_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)),
                   timeout_s, &interrupt, what};
  try {
    const uint64_t R = ++round_;
    if (R > 2)  // every peer is done with the header of this parity
      for (int j = 0; j < p; ++j)
        if (j != me) wait_counter(j, kGathered, R - 2, d);
    RankCtl& mine = ctl_[me];
    mine.hdr[R & 1] = Header{static_cast<int64_t>(call.kind), static_cast<int64_t>(count),
                             static_cast<int64_t>(call.dtype), static_cast<int64_t>(call.op),
                             call.bucket, 0, {}, {}, {}, 1};
    mine.counters[kPacked].v.store(R, std::memory_order_release);
    return R;
  } catch (...) {
    broken_ = true;
    throw;
  }
}

std::string NodeGroup::compare_calls(uint64_t round, Pending* pending, double timeout_s,
                                     const InterruptCheck& interrupt) {
  const int me = cfg_.local_rank, p = cfg_.local_size;
  const Deadline d{std::chrono::steady_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)),
                   timeout_s, &interrupt, "allreduce"};
  try {
    for (int j = 0; j < p; ++j)
      if (j != me) wait_counter(j, kPacked, round, d, pending);
    std::string mismatch = check_headers(round);
    finish_round(round);
    return mismatch;
  } catch (...) {
    broken_ = true;
    throw;
  }
}

bool NodeGroup::any_via_mpi(uint64_t round) const {
  for (int j = 0; j < cfg_.local_size; ++j)
    if (ctl_[j].hdr[round & 1].via_mpi) return true;
  return false;
}

void NodeGroup::run(const std::vector<Piece>& pieces, size_t count, const Call& call,
                    Transport* cross, double timeout_s, const InterruptCheck& interrupt,
                    bool caller_keeps_buffers, bool this_node_only) {
  const char* what = kind_name(call.kind);
  check_not_aborted(what);
  const Deadline d{std::chrono::steady_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)),
                   timeout_s, &interrupt, what};
  const int me = cfg_.local_rank, p = cfg_.local_size, P = cfg_.nparts;
  const size_t es = dtype_size(call.dtype);
  // Elements per round: a multiple of 16 per part so that parts stay 64-byte aligned.
  const size_t cap = round_elements(es);
  const size_t nrounds = count == 0 ? 1 : (count + cap - 1) / cap;
  const long world = cfg_.world_size;
  // (the same on every rank of the node, including those that own no part and so have no `cross`)
  const bool multi_node = cfg_.num_nodes > 1 && !this_node_only;
  // A gather takes each part from its owner's input alone (see Kind::gather).
  const bool gather = call.kind == Kind::gather;
  // Large outputs go around the cache, which then keeps the segment's halves.
  const bool stream = count * es >= kStreamBytes;

  // Walks the pieces covering elements [lo, hi) of the whole collective.
  size_t cursor = 0, cursor_start = 0;  // piece index and its first element, moves forward
  auto walk = [&](size_t lo, size_t hi, auto&& fn) {
    if (lo >= hi) return;
    size_t i = 0, start = 0;
    if (lo >= cursor_start) {
      i = cursor;
      start = cursor_start;
    }
    for (; i < pieces.size() && lo < hi; ++i) {
      const size_t n = pieces[i].bytes / es;
      if (lo < start + n) {
        const size_t a = lo - start, m = std::min(hi, start + n) - lo;
        fn(pieces[i].in + a * es, pieces[i].out + a * es, m, lo);
        lo += m;
        if (lo >= hi) {
          cursor = i;
          cursor_start = start;
        }
      }
      start += n;
    }
  };

  // Elements [lo, hi) of part j in round k.
  auto part_bounds = [&](size_t k, int j) {
    const size_t off = k * cap;
    const auto [lo, hi] = part_of(std::min(cap, count - std::min(count, off)), P, j);
    return std::make_pair(off + lo, off + hi);
  };
  Header header{static_cast<int64_t>(call.kind), static_cast<int64_t>(count),
                static_cast<int64_t>(call.dtype), static_cast<int64_t>(call.op),
                call.bucket, 0, {}, {}, {}, 0};
  if (p > 1 && call.kind == Kind::allreduce && pieces.size() == 1 && count > 0) {
    const size_t bytes = count * es;
    header.in = shared_find(pieces[0].in, bytes).value_or(SharedLoc{});
    if (!multi_node) header.out = shared_find(pieces[0].out, bytes).value_or(SharedLoc{});
  }

  const uint64_t first_round = round_ + 1;
  // The copies that pack round k's parts which other ranks reduce into our half of that round.
  auto pack_spans = [&](size_t k, std::vector<Span>& spans) {
    spans.clear();
    if (p == 1 || gather || header.in.fd >= 0) return;  // a shared input is read where it is
    char* dst = half(me, first_round + k);
    const size_t off = k * cap;
    for (int j = 0; j < P; ++j) {
      if (j == me) continue;
      const auto [lo, hi] = part_bounds(k, j);
      walk(lo, hi, [&](const char* in, char*, size_t n, size_t at) {
        spans.push_back(Span{dst + (at - off) * es, in, n * es});
      });
    }
  };
  std::fill(peer_in_.begin(), peer_in_.end(), nullptr);
  peer_out_ = nullptr;
  // Across nodes the rounds overlap: round k's parts travel between nodes (stage B waits for
  // them) while round k+1 is packed and reduced here (stage A), so that large collectives take
  // about the longer of the two, not their sum. Two rounds at most are in flight: a round's
  // half is reused two rounds later. On one node each round runs A then B, and B packs the next
  // round while it gathers.
  bool differs_across_nodes = false;    // (only round 0 compares the calls)
  int64_t other[5] = {-1, 0, 0, 0, 0};  // a call made on another node, if it differs
  bool packed_ahead = false;            // this round's parts were packed during the last gather

  // The end of step 4 across nodes: our part's exchange of round k completes (round 0's says
  // whether the call is the same on every node) and its result goes to the output.
  auto finish_exchange = [&](size_t k) {
    const int b = static_cast<int>((first_round + k) & 1);
    Pending* pending = inflight_[b];
    if (!pending) return;  // (finished already, or none started)
    inflight_[b] = nullptr;
    wait_pending(pending, what, cross->describe_peers(), d.timeout_s, interrupt, cross);
    RankCtl& mine = ctl_[me];
    if (k == 0) {
      differs_across_nodes = !cross_check_result(mine.hdr[b], false, other);
      std::copy(other, other + 5, mine.hdr[b].other);  // for our node's gatherers
      if (differs_across_nodes) return;
    }
    const size_t lo = part_bounds(k, me).first, hi = part_bounds(k, me).second;
    if (call.op == Op::average) divide(call.dtype, exchanged_[b], hi - lo, world);
    if (direct_[b]) return;
    walk(lo, hi, [&](const char*, char* out, size_t n, size_t at) {
      copy_bytes(out, exchanged_[b] + (at - lo) * es, n * es, stream);
    });
  };

  // Stage A: steps 1-4 up to the start of the exchange of our reduced part with other nodes.
  auto stage_a = [&](size_t k) {
    const uint64_t R = first_round + k;
    round_ = R;
    const int b = static_cast<int>(R & 1);
    const size_t off = k * cap;
    RankCtl& mine = ctl_[me];
    char* my_half = half(me, R);

    // 1. every peer is done with the round that last used this half
    if (R > 2)
      for (int j = 0; j < p; ++j)
        if (j != me) wait_counter(j, kGathered, R - 2, d);

    // 2. header, then pack the parts that other ranks reduce
    if (!packed_ahead) {
      mine.hdr[b] = header;
      pack_spans(k, packs_);
      for (const Span& s : packs_) copy_bytes(s.dst, s.src, s.bytes);
    }
    packed_ahead = false;
    mine.counters[kPacked].v.store(R, std::memory_order_release);

    // 3. everyone has packed; the first round checks that all ranks make the same call
    for (int j = 0; j < p; ++j)
      if (j != me) wait_counter(j, kPacked, R, d);
    const std::string mismatch = k == 0 ? check_headers(R) : std::string();

    // 4. reduce our own part (across nodes: start its exchange)
    if (k == 0 && mismatch.empty()) map_shared_arrays(R, d);
    if (!mismatch.empty()) {
      // Every rank of this node raises; the part owners still take part in the cross-node
      // check (saying that their node disagrees) so that the other nodes raise too.
      if (me < P && multi_node) cross_check(mine.hdr[b], true, cross, d, other);
      finish_round(R);  // keep every rank's round numbers in step: the group stays usable,
      if (any_via_mpi(R)) broken_ = true;  // unless a rank's MPI exchange went out unmatched
      throw MismatchError(mismatch);
    }
    if (me >= P || differs_across_nodes) return;  // (the gather of round 0 then raises)
    const size_t lo = part_bounds(k, me).first, hi = part_bounds(k, me).second;
    const Op local_op = multi_node && call.op == Op::average ? Op::sum : call.op;
    // A node of one rank whose part lies in one piece exchanges it from the caller's input
    // straight into its output (where a given-up exchange may go on reading and writing them).
    const char* direct_in = nullptr;
    char* direct_out = nullptr;
    if (multi_node && p == 1 && caller_keeps_buffers)
      walk(lo, hi, [&](const char* in, char* out, size_t n, size_t) {
        if (n == hi - lo) direct_in = in, direct_out = out;
      });
    if (!direct_out)
      walk(lo, hi, [&](const char* in, char* out, size_t n, size_t at) {
        const size_t rel = (at - off) * es;
        int ns = 0;
        srcs_[ns++] = in;
        for (int j = 0; j < p && !gather; ++j)
          if (j != me) srcs_[ns++] = peer_in_[j] ? peer_in_[j] + at * es : half(j, R) + rel;
        if (multi_node)
          reduce(call.dtype, local_op, srcs_.data(), ns, my_half + rel, nullptr, n, 1);
        else if (peer_out_)
          reduce(call.dtype, call.op, srcs_.data(), ns, out, peer_out_ + at * es, n, world, stream,
                 stream);
        else
          reduce(call.dtype, call.op, srcs_.data(), ns, out, p > 1 ? my_half + rel : nullptr, n,
                 world, stream);
      });
    if (!multi_node) return;
    // Round 0's exchange carries the check of the call. Later rounds cross only once it agreed:
    // ranks whose calls differ must not send each other rounds that the others never receive.
    if (k == 1) finish_exchange(0);
    if (differs_across_nodes) return;
    const char* src = direct_in ? direct_in : my_half + (lo - off) * es;
    exchanged_[b] = direct_out ? direct_out : my_half + (lo - off) * es;
    direct_[b] = direct_out != nullptr;
    if (k == 0) {
      fill_cross_check(mine.hdr[b], false);
      inflight_[b] = cross->start_checked_allreduce(cross_hdr_, src, exchanged_[b], hi - lo,
                                                    call.dtype, local_op);
    } else if (hi > lo) {
      inflight_[b] = cross->start_allreduce(src, exchanged_[b], hi - lo, call.dtype, local_op);
    }
  };

  // Stage B: the end of step 4 (our part's exchange completes) and step 5.
  auto stage_b = [&](size_t k) {
    const uint64_t R = first_round + k;
    const int b = static_cast<int>(R & 1);
    const size_t off = k * cap;
    RankCtl& mine = ctl_[me];
    if (me < P) {
      if (multi_node) finish_exchange(k);
      mine.hdr[b].status = differs_across_nodes ? 1 : 0;
    }
    if (peer_out_) stream_fence();  // the other rank may return once it sees `reduced`
    mine.counters[kReduced].v.store(R, std::memory_order_release);

    // 5. gather the other parts from their owners' halves
    for (int j = 0; j < P; ++j) {
      if (j == me) continue;
      wait_counter(j, kReduced, R, d);
      if (ctl_[j].hdr[b].status != 0) {
        // prefer a description of the other node's call over "its ranks disagree"
        const int64_t* theirs = ctl_[j].hdr[b].other;
        if (!differs_across_nodes || (other[0] < 0 && theirs[0] >= 0))
          std::copy(theirs, theirs + 5, other);
        differs_across_nodes = true;
      }
    }
    if (!differs_across_nodes) {
      gathers_.clear();
      for (int j = 0; j < P && !peer_out_; ++j) {  // (else the other owner stored it here)
        if (j == me) continue;
        const char* src = half(j, R);
        walk(part_bounds(k, j).first, part_bounds(k, j).second,
             [&](const char*, char* out, size_t n, size_t at) {
               gathers_.push_back(Span{out, src + (at - off) * es, n * es});
             });
      }
      // On one node the next round's packing goes along: our half of it is free, since every
      // peer has reduced this round and so gathered the last.
      packs_.clear();
      if (!multi_node && k + 1 < nrounds) {
        mine.hdr[(R + 1) & 1] = header;
        pack_spans(k + 1, packs_);
        packed_ahead = true;
      }
      copy_together(gathers_, stream, packs_);
    }
    mine.counters[kGathered].v.store(R, std::memory_order_release);
    if (differs_across_nodes) {
      stream_fence();
      finish_round(round_);  // (round 1 may be packed already): every local rank stays in step
      const Header& h = mine.hdr[b];
      const int64_t fields[5] = {h.kind, h.count, h.dtype, h.op, h.bucket};
      throw MismatchError(nodes_disagree(fields, other));
    }
  };

  try {
    for (size_t k = 0; k < nrounds; ++k) {
      stage_a(k);
      if (!multi_node)
        stage_b(k);
      else if (k > 0)
        stage_b(k - 1);
    }
    if (multi_node) {
      stage_b(nrounds - 1);
      // A rank that gave up this collective sent its part first and its notice after it: where
      // the notice is in, the collective fails here too (MPI may have taken in the part, and
      // completed ours with it, before it took in the notice).
      check_remote_abort(what);
    }
    stream_fence();
  } catch (const MismatchError&) {
    throw;
  } catch (...) {
    broken_ = true;
    for (Pending*& pending : inflight_)
      if (pending) {  // given up: MPI may still write the segment, which then stays mapped
        (void)pending;
        pending = nullptr;
        cross->abandon();
        abandoned_ = true;
      }
    if (header.out.fd >= 0) shared_retire(pieces[0].out);  // the other rank may still write it
    throw;
  }
}

}  // namespace tnt
