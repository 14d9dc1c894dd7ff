#pragma once
// Shared-memory collectives among the ranks of one node, with an optional cross-node step.
//
// Every rank owns a slot in the segment, split into two halves used by alternating rounds. A
// collective is cut into rounds of at most one half; each round is split into `nparts` parts and
// local rank j (< nparts) reduces part j:
//   1. wait until every peer has finished round R-2 (it is done reading our half R%2)
//   2. publish a header (kind, count, dtype, op, bucket) and pack the parts *other* ranks reduce
//      into our half; our own part is read straight from the user's input  -> flag `packed`
//   3. wait for every peer's `packed`; the first round compares all headers (mismatch -> error)
//   4. reduce our part (own input + the peers' packed copies) into the user's output and into our
//      half; with several nodes the part is first allreduced across nodes -> flag `reduced`
//   5. copy every other part from its owner's half into the user's output -> flag `gathered`;
//      the next round's step 2 goes along in alternating pieces (our half of round R+1 is free
//      once every peer has reduced round R, and so gathered round R-1)
// Arrays in shared blocks (tnt.empty, shared_arrays.hpp) skip their staging copies: a rank whose
// input is shared packs nothing (the owners read it in place), and with two ranks on one node whose
// outputs are both shared, each owner stores its part into both outputs and nobody gathers.
// All flags are per-rank monotonically increasing round numbers, so no flag is ever reset.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tnt/call_check.hpp"
#include "tnt/dtype.hpp"
#include "tnt/segment.hpp"
#include "tnt/transport.hpp"
#include "tnt/wait.hpp"

namespace tnt {

struct Header;  // one rank's description of its call (in the segment)

// How much longer than the collective timeout a wait on other nodes lasts (see wait_pending).
constexpr double kRemoteWaitGraceSeconds = 1.0;
// How long after such a wait ends its rank's abort may take to reach the local ranks waiting on it.
constexpr int kAbortArrivalSeconds = 1;

// One tensor of a fused collective: `bytes` read from `in`, the result written to `out`.
struct Piece {
  const char* in;
  char* out;
  size_t bytes;
};

// One copy of a round: `bytes` from `src` to `dst`.
struct Span {
  char* dst;
  const char* src;
  size_t bytes;
};

struct NodeConfig {
  int local_rank = 0;
  int local_size = 1;
  int nparts = 1;                 // local ranks that reduce a part (local_size, or 1 on uneven nodes)
  std::vector<int> world_ranks;   // world rank of each local rank
  int world_size = 1;
  int num_nodes = 1;
  size_t slot_bytes = 0;          // per rank, both halves
};

// Elements [lo, hi) of `len` that part j of `nparts` covers in a round: a multiple of 16 but
// the last, so that parts stay 64-byte aligned.
std::pair<size_t, size_t> part_of(size_t len, int nparts, int j);

// Size of the segment a node group with this configuration needs.
size_t segment_bytes(const NodeConfig& cfg);
// The most bytes of one part of a round: what one exchange between nodes carries at most.
size_t part_bytes(const NodeConfig& cfg);

class NodeGroup {
 public:
  // `seg` must be mapped; the creator initialises the header before the others attach.
  NodeGroup(NodeConfig cfg, Segment* seg, bool creator);
  ~NodeGroup();
  NodeGroup(const NodeGroup&) = delete;
  NodeGroup& operator=(const NodeGroup&) = delete;

  // Registers this process (pid) in the segment; call once every rank has mapped it.
  void attach();
  // Runs one collective over `pieces` (count elements of call.dtype in total). `cross` is the
  // inter-node exchange of this rank's part (null on a single node, or if this rank owns none).
  // With `caller_keeps_buffers` (the pieces stay allocated for the life of the process once the
  // group is abandoned()), a node of one rank exchanges a part straight between the pieces.
  // With `this_node_only` it runs among this node's ranks alone, whatever the number of nodes
  // (`cross` unused; an average divides by the world's size all the same).
  void run(const std::vector<Piece>& pieces, size_t count, const Call& call, Transport* cross,
           double timeout_s, const InterruptCheck& interrupt, bool caller_keeps_buffers = false,
           bool this_node_only = false);
  // The most elements of `element_bytes` that one round holds (a call of more takes several).
  size_t round_elements(size_t element_bytes) const;
  // Waits (with the same checks as a collective) until `pending` completes; deletes it. With
  // `world_collective` (MPI's own collective over every rank, such as MPI_Iallreduce on the
  // world), every local peer's death or departure also ends the wait, and the wait polls MPI
  // without sleeping for as long as a blocking MPI call would spin: MPI moves the data of its
  // collectives only while it is polled.
  void wait_pending(Pending* pending, const char* what, const std::string& peers, double timeout_s,
                    const InterruptCheck& interrupt, Abandonable* to_abandon,
                    bool world_collective = false);
  // The check of a collective that MPI carries out instead of the segment, in two halves so that
  // MPI's exchange starts without the node's ranks meeting first. publish_call posts this rank's
  // call, marked as going to MPI, and returns its round; compare_calls waits for the other local
  // ranks' calls (testing `pending`, the exchange MPI started, meanwhile) and returns a
  // description of the calls if they differ (the same on every local rank), else an empty
  // string. A local rank whose collective meets a differing call so marked raises and leaves its
  // group broken: the MPI exchange started beside it may never complete, so every rank rebuilds.
  uint64_t publish_call(const Call& call, size_t count, double timeout_s,
                        const InterruptCheck& interrupt);
  std::string compare_calls(uint64_t round, Pending* pending, double timeout_s,
                            const InterruptCheck& interrupt);

  // Tells the peers that this rank left a collective abnormally (first caller wins); with
  // `propagate`, ranks on other nodes are told too (through the notify hook).
  void abort(const std::string& why, bool propagate = true);
  // Hooks to ranks on other nodes: `poll` returns the message of an abort announced elsewhere
  // (empty if none), `notify` announces ours. Unset on a single node.
  void set_remote_abort(std::function<std::string()> poll,
                        std::function<void(const std::string&)> notify) {
    poll_remote_ = std::move(poll);
    notify_remote_ = std::move(notify);
  }
  // Throws AbortedError if this group or a peer (here or on another node) gave up.
  void check_not_aborted(const char* what);
  // Throws AbortedError if another node announced that it gave up (polled now; check_not_aborted
  // polls at most once a millisecond).
  void check_remote_abort(const char* what);
  // Marks this rank as gone (peers waiting for it raise instead of timing out).
  void close();
  bool broken() const { return broken_; }
  // A cross-node operation was given up: MPI may still write into the segment and our buffers.
  bool abandoned() const { return abandoned_; }
  // Seconds spent waiting for local peers so far (a diagnostic for benchmarks).
  double wait_seconds() const { return wait_seconds_; }

 private:
  struct Deadline;
  class Collective;  // one run() in rounds (node_group_run.cpp)
  char* half(int local, uint64_t round) const;
  // Waits until local rank `local` reached stage `which` of round `value`, testing the exchanges
  // in flight (and `progress`, if given) meanwhile.
  void wait_counter(int local, int which, uint64_t value, const Deadline& d,
                    Pending* progress = nullptr);
  // Whether local rank `local` waits on an exchange with other nodes that has not yet timed out.
  bool awaits_other_nodes(int local, std::chrono::steady_clock::time_point now) const;
  void checks(const Deadline& d, int awaited, const std::function<bool()>& arrived);
  // Throws RankLostError (and aborts) if local rank `local` died or left, unless `arrived` says
  // it reached the awaited stage first.
  void check_alive(const Deadline& d, int local, const std::function<bool()>& arrived);
  // Compares this node's call with the other nodes' (part owners only); false if they differ,
  // then `other` describes a call made elsewhere (kind -1: some node's ranks disagree).
  bool cross_check(const Header& h, bool node_disagrees, Transport* cross,
                   const Deadline& d, int64_t other[5]);
  void fill_cross_check(const Header& h, bool node_disagrees);
  bool cross_check_result(const Header& h, bool node_disagrees, int64_t other[5]) const;
  [[noreturn]] void fail_timeout(const Deadline& d, int which, uint64_t value);
  // Empty when every local rank makes the same call, else a description of the calls.
  std::string check_headers(uint64_t round);
  // Whether a local rank carries round `round`'s call out through MPI (see publish_call).
  bool any_via_mpi(uint64_t round) const;
  void finish_round(uint64_t round);
  // Maps the peers' shared inputs and outputs announced in round R's headers (null if none).
  void map_shared_arrays(uint64_t round, const Deadline& d);
  char* peer_array(int local, int64_t fd, int64_t block_bytes, int64_t offset, const Deadline& d);

  NodeConfig cfg_;
  Segment* seg_;
  struct SegHeader* hdr_ = nullptr;
  struct RankCtl* ctl_ = nullptr;
  char* data_ = nullptr;
  size_t half_bytes_ = 0;
  uint64_t round_ = 0;
  double wait_seconds_ = 0;
  bool broken_ = false;
  bool abandoned_ = false;
  std::function<std::string()> poll_remote_;
  std::chrono::steady_clock::time_point last_remote_poll_{};
  std::function<void(const std::string&)> notify_remote_;
  int64_t cross_hdr_[12] = {};  // header exchange buffer (lives as long as the group)
  Pending* inflight_[2] = {};   // the exchange of our part of the round of each parity
  char* exchanged_[2] = {};     // where that exchange leaves its result
  bool direct_[2] = {};         // there is the caller's output (else our half of the segment)
  std::vector<const void*> srcs_;
  std::vector<Span> packs_, gathers_;  // a round's copies (kept: no allocation per call)
  std::map<std::tuple<int, int64_t, int64_t>, char*> peer_blocks_;  // (local, fd, bytes)
  std::vector<const char*> peer_in_;  // each local rank's shared input, or null
  char* peer_out_ = nullptr;          // the other rank's shared output, when it gets our part
};

}  // namespace tnt
