#pragma once
// The node group's shared segment, as every node_group*.cpp reads it:
//   SegHeader | RankCtl[local_size] | data (2 halves per local rank).
// Everything shared is either written before a release-store of a counter and read after the
// matching acquire-load, or is itself atomic.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "tnt/node_group.hpp"
#include "tnt/shared_arrays.hpp"

namespace tnt {

constexpr uint64_t kMagic = 0x746e742d73686d31ull;  // "tnt-shm1"
enum Which { kPacked = 0, kReduced = 1, kGathered = 2 };
enum State : int32_t { kEmpty = 0, kAttached = 1, kClosed = 2 };

struct alignas(64) Counter {
  std::atomic<uint64_t> v{0};
};

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

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
inline size_t ctl_offset() { return align_up(sizeof(SegHeader), 64); }
inline size_t data_offset(int local_size) {
  return align_up(ctl_offset() + sizeof(RankCtl) * static_cast<size_t>(local_size), 4096);
}
inline size_t half_bytes_of(const NodeConfig& cfg) {
  // Each half holds one round: at least 16 elements of 8 bytes per part.
  size_t min_half = 16 * 8 * static_cast<size_t>(cfg.nparts);
  return align_up(std::max(cfg.slot_bytes / 2, min_half), 64);
}

// A header for `count` elements of `call`; `via_mpi`: the rank carries it out through MPI.
inline Header header_of(const Call& call, size_t count, bool via_mpi) {
  return Header{static_cast<int64_t>(call.kind), static_cast<int64_t>(count),
                static_cast<int64_t>(call.dtype), static_cast<int64_t>(call.op),
                call.bucket, 0, {}, {}, {}, via_mpi ? 1 : 0};
}

inline const char* kind_name(Kind k) {
  return k == Kind::barrier ? "barrier" : k == Kind::broadcast ? "broadcast" : "allreduce";
}

// When a collective's waits give up, and what they report.
struct NodeGroup::Deadline {
  std::chrono::steady_clock::time_point end;
  double timeout_s;
  const InterruptCheck* interrupt;
  const char* what;

  // Ends `timeout_s` (plus `grace`) from now.
  static Deadline after(double timeout_s, const InterruptCheck& interrupt, const char* what,
                        double grace = 0.0) {
    const auto wait = std::chrono::microseconds(static_cast<int64_t>((timeout_s + grace) * 1e6));
    return Deadline{std::chrono::steady_clock::now() + wait, timeout_s, &interrupt, what};
  }
};

}  // namespace tnt
