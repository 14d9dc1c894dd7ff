// The GASPI transport: the exchange between nodes as a ring (or a pairwise swap) of one-sided
// gaspi_write_notify transfers between GASPI segments, among processes that gaspi_start made.
// Over 500 lines: the exchange and its transport share one set of slot and notification rules.
#include "tnt/gaspi_transport.hpp"

#include <stdexcept>

#include "tnt/errors.hpp"

#ifdef TNT_WITH_GASPI

#include <GASPI.h>
#include <GASPI_Ext.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "gaspi_runtime.hpp"
#include "tnt/reduce.hpp"
#include "tnt/wait.hpp"

namespace tnt {
namespace {

constexpr auto kPeerCheckPeriod = std::chrono::milliseconds(100);

// The exchange among P ranks (one per node). The engine keeps several exchanges in flight (the
// first round's call check and two pipelined rounds): each takes one of kSlots areas of the
// segment in turn, its own notification ids, and a notification value that names its operation.
// An area holds the data (the part to reduce, copied in) and the receive space.
//
// Two ranks swap their whole parts in one write each and reduce both (a pairwise exchange: one
// latency instead of two). More ranks run a ring, data cut into P blocks: reduce-scatter step
// s < P-1 writes block r-s into the right neighbour's receive space s and reduces the block the
// left one wrote into block r-1-s (rank r then holds block r+1 reduced); allgather step g writes
// block r+1-g to the same place in the right neighbour's data. Only the right neighbour is ever
// written to (the other rank, with two).
//
// A checked call's check travels with its data instead of in an exchange of its own before it:
// two ranks write it in front of their part; in a ring each reduce-scatter step carries, in front
// of its block, the max of the checks of the ranks it has heard from, so that after P-1 steps
// every rank holds the max of all. Ranks whose calls differ still take the same steps with
// blocks of their own sizes, which never exceed the receive space (sized for the largest part):
// every rank completes the exchange, and none uses its data.
//
// An area is written again only once its owner has released it: a rank that completes an
// operation acknowledges it to its writer (a notification named by the operation), and a writer's
// first write of operation m + kSlots waits for the acknowledgement of m. So areas are never
// overwritten however deep the engine pipelines, and nothing depends on it.

constexpr int kSlots = 4;
// A failed transfer, or a write to a process that is gone, may belong to a rank that completed
// the exchange and left: it counts as a loss only if the operation is still incomplete this long
// afterwards.
constexpr auto kLostGrace = std::chrono::seconds(1);

class GaspiTransport;

class Exchange : public Pending {
 public:
  Exchange(GaspiTransport& t, uint64_t op, int64_t* check, char* user, size_t n, DType dtype,
           Op reduce_op);
  ~Exchange() override;
  bool test() override;

 private:
  bool post();      // the current step's write; false while it must wait (queue, release)
  bool finish();    // local completion of our writes, then the result and the release
  bool blocked();   // runs the checks; returns false (test's answer while waiting)
  size_t block_offset(int b) const { return std::min(static_cast<size_t>(b) * c_, n_) * es_; }
  size_t block_bytes(int b) const { return block_offset(b + 1) - block_offset(b); }

  GaspiTransport& t_;
  uint64_t op_;
  int slot_;
  int64_t* check_;  // the caller's call check (null: unchecked), reduced here
  int64_t running_[kCheckValues] = {};  // ring: the max of the checks heard of so far
  bool agrees_ = true;                  // the reduced check agrees (known once it is reduced)
  char* user_;
  size_t n_, es_, c_;
  DType dtype_;
  Op op_kind_;
  gaspi_notification_t value_;
  int step_ = 0;
  bool posted_ = false, done_ = false;
};

class GaspiTransport : public Transport {
 public:
  GaspiTransport(MPI_Comm cross, std::vector<int> world_ranks, size_t max_bytes, double timeout_s,
                 const MpiWait& wait);
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  Pending* start_allreduce(const void* in, void* out, size_t n, DType t, Op op) override {
    return start(nullptr, in, out, n, t, op);
  }
  // The check travels with the data (see Exchange).
  Pending* start_checked_allreduce(int64_t* check, const void* in, void* out, size_t n, DType t,
                                   Op op) override {
    return start(check, in, out, n, t, op);
  }
  // Its segment is never freed or reused anyway: writes of a given-up operation may still land.
  void abandon() override { abandoned_ = true; }
  std::string describe_peers() const override { return ranks_but(world_ranks_, rank_); }

 private:
  friend class Exchange;
  Pending* start(int64_t* check, const void* in, void* out, size_t n, DType t, Op op);
  int mod(int i) const { return ((i % size_) + size_) % size_; }
  int steps() const { return size_ == 2 ? 1 : 2 * (size_ - 1); }
  static gaspi_notification_t value_of(uint64_t op) {
    return static_cast<gaspi_notification_t>(op % 65535 + 1);
  }
  // Notification ids: the steps of each area, then each area's release.
  gaspi_notification_id_t step_id(int slot, int step) const {
    return static_cast<gaspi_notification_id_t>(slot * steps() + step);
  }
  gaspi_notification_id_t release_id(int slot) const {
    return static_cast<gaspi_notification_id_t>(kSlots * steps() + slot);
  }
  size_t data_offset(int slot) const { return static_cast<size_t>(slot) * slot_stride_; }
  size_t probe_offset() const { return kSlots * slot_stride_; }  // where probes read into
  size_t recv_offset(int slot, int step) const {
    return data_offset(slot) + data_bytes_ + static_cast<size_t>(step) * recv_bytes_;
  }
  // Whether the right neighbour released `slot` after operation `op` (it completed it).
  bool released(int slot, uint64_t op);
  // Tells the left neighbour that we completed `op` in `slot`; false while the queue is full.
  bool release(int slot, uint64_t op);
  // Polls the transfers posted so far; notes a failure (see kLostGrace).
  void reap();
  void note_failure(gaspi_return_t rc);
  // The slow path of a wait (every kPeerCheckPeriod at most): peers of this machine alive, the
  // neighbours probed, and a loss noted long enough ago raised as RankLostError.
  void check_peers();
  // Reads a few bytes from each neighbour in turn, one read at a time on a queue of its own. GPI-2's
  // device thread answers a read, whatever the peer's program does: a read to a process that is
  // gone fails (its host closed the connection), and one that stays unanswered for probe_limit_
  // (half the collective timeout) means that the peer's host or its link is down.
  void probe();

  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  gaspi_rank_t left_ = 0, right_ = 0;
  gaspi_segment_id_t seg_ = 0, right_seg_ = 0, left_seg_ = 0;
  gaspi_queue_id_t queue_ = 0, probe_queue_ = 0;
  char* base_ = nullptr;
  // An area's data: [head | part] (head_: room for a call check), and its receive space: the
  // other rank's [head | part], or (ring) P-1 of [head | block].
  size_t head_ = 0, data_bytes_ = 0, recv_bytes_ = 0, slot_stride_ = 0;
  uint64_t ops_ = 0;
  bool busy_[kSlots] = {};
  uint64_t released_ops_[kSlots] = {};  // per area: operations released by the right neighbour
  bool abandoned_ = false;
  std::string lost_;  // why transfers failed, if they did
  std::chrono::steady_clock::time_point lost_at_{}, next_check_{};
  gaspi_rank_t probed_ = 0;  // the neighbour of the read in flight, if any
  bool probing_ = false;
  std::chrono::steady_clock::time_point probe_sent_{};
  std::chrono::duration<double> probe_limit_{};
};

// Setup outcome of one rank (exchanged over MPI: all ranks fail together, none waits).
struct SetupBuffers {
  int64_t mine[3] = {0, 0, 0};  // segment id, ok, bytes of an area
  std::vector<int64_t> all;
};

GaspiTransport::GaspiTransport(MPI_Comm cross, std::vector<int> world_ranks, size_t max_bytes,
                               double timeout_s, const MpiWait& wait)
    : world_ranks_(std::move(world_ranks)) {
  std::lock_guard<std::mutex> lock(gaspi_runtime_mutex);
  if (gaspi_runtime.state != GaspiRuntime::kStarted) throw CollectiveError("GASPI has not started");
  MPI_Comm_rank(cross, &rank_);
  MPI_Comm_size(cross, &size_);
  left_ = static_cast<gaspi_rank_t>(world_ranks_[mod(rank_ - 1)]);
  right_ = static_cast<gaspi_rank_t>(world_ranks_[mod(rank_ + 1)]);
  // Receive space: the whole part from the other rank, or (ring) P-1 blocks of at most
  // ceil(n / P) elements of at most 8 bytes: n * es / P + 8 bytes; each behind a head.
  head_ = (kCheckBytes + 63) / 64 * 64;
  data_bytes_ = head_ + (max_bytes + 63) / 64 * 64;
  recv_bytes_ = size_ == 2 ? data_bytes_ : head_ + (max_bytes / size_ + 8 + 63) / 64 * 64;
  slot_stride_ = data_bytes_ + static_cast<size_t>(steps() == 1 ? 1 : size_ - 1) * recv_bytes_;
  const gaspi_timeout_t ms = gaspi_ms(timeout_s);

  std::string error;
  gaspi_number_t segment_max = 0, queue_num = 1, notification_num = 0;
  gaspi_segment_max(&segment_max);
  gaspi_queue_num(&queue_num);
  gaspi_notification_num(&notification_num);
  // Two queues (data, probes) with nothing left on them from transports given up before (their
  // peers may be gone).
  std::vector<gaspi_queue_id_t> free_queues;
  for (int i = 0; i < static_cast<int>(queue_num) && free_queues.size() < 2; ++i) {
    const auto q = static_cast<gaspi_queue_id_t>((gaspi_runtime.next_queue + i) % queue_num);
    gaspi_number_t left = 1;
    (void)gaspi_wait(q, GASPI_TEST);
    if (gaspi_queue_size(q, &left) == GASPI_SUCCESS && left == 0) free_queues.push_back(q);
  }
  gaspi_return_t rc = GASPI_ERROR;
  if (release_id(kSlots) + 1 >= notification_num) {  // (GPI-2 reserves the last one)
    error = "a ring of " + std::to_string(size_) + " nodes needs more than the " +
            std::to_string(notification_num) + " GASPI notifications of a segment";
  } else if (free_queues.size() < 2) {
    error = "every GASPI queue still holds transfers of exchanges given up: restart the cluster";
  } else if (gaspi_runtime.next_segment >= static_cast<int>(segment_max)) {
    error = "all " + std::to_string(segment_max) + " GASPI segments of this process are used " +
            "(one per engine built): restart the cluster";
  } else {
    queue_ = free_queues[0];
    probe_queue_ = free_queues[1];
    gaspi_runtime.next_queue = probe_queue_ + 1;
    probe_limit_ = std::chrono::duration<double>(timeout_s / 2);
    seg_ = static_cast<gaspi_segment_id_t>(gaspi_runtime.next_segment++);
    void* ptr = nullptr;
    if ((rc = gaspi_segment_alloc(seg_, probe_offset() + 64, GASPI_MEM_INITIALIZED)) !=
        GASPI_SUCCESS)
      error = "gaspi_segment_alloc: " + gaspi_error(rc);
    else if ((rc = gaspi_segment_ptr(seg_, &ptr)) != GASPI_SUCCESS)
      error = "gaspi_segment_ptr: " + gaspi_error(rc);
    base_ = static_cast<char*>(ptr);
    // The left neighbour writes our data, the right one our releases: both know our segment.
    std::vector<gaspi_rank_t> peers{right_};
    if (left_ != right_) peers.push_back(left_);
    for (gaspi_rank_t peer : peers) {
      if (!error.empty()) break;
      if ((rc = gaspi_connect(peer, ms)) != GASPI_SUCCESS)
        error = "gaspi_connect to rank " + std::to_string(peer) + ": " + gaspi_error(rc);
      else if ((rc = gaspi_segment_register(seg_, peer, ms)) != GASPI_SUCCESS)
        error = "gaspi_segment_register with rank " + std::to_string(peer) + ": " +
                gaspi_error(rc);
    }
  }
  auto b = std::make_unique<SetupBuffers>();
  b->mine[0] = seg_;
  b->mine[1] = error.empty() ? 1 : 0;
  b->mine[2] = static_cast<int64_t>(slot_stride_);
  b->all.resize(3 * static_cast<size_t>(size_));
  MPI_Request req;
  MPI_Iallgather(b->mine, 3, MPI_INT64_T, b->all.data(), 3, MPI_INT64_T, cross, &req);
  try {
    wait(&req, "MPI_Iallgather (GASPI segments)");
  } catch (...) {
    (void)b.release();  // MPI may still write into it
    throw;
  }
  std::vector<int> failed;
  for (int i = 0; i < size_; ++i) {
    if (!b->all[3 * i + 1]) failed.push_back(world_ranks_[i]);
    if (b->all[3 * i + 2] != b->mine[2] && error.empty())
      error = "rank " + std::to_string(world_ranks_[i]) + " has another round size " +
              "(do all ranks use the same TNT_SHM_SEGMENT_BYTES?)";
  }
  if (!failed.empty() || !error.empty())
    throw CollectiveError("GASPI transport setup failed" +
                          (failed.empty() ? std::string() : " on rank(s) " + rank_list(failed)) +
                          (error.empty() ? "" : " (here: " + error + ")"));
  right_seg_ = static_cast<gaspi_segment_id_t>(b->all[3 * mod(rank_ + 1)]);
  probed_ = right_;  // (the first probe reads from the left neighbour)
  left_seg_ = static_cast<gaspi_segment_id_t>(b->all[3 * mod(rank_ - 1)]);
}

Pending* GaspiTransport::start(int64_t* check, const void* in, void* out, size_t n, DType t,
                               Op op) {
  if (abandoned_) throw CollectiveError("the GASPI transport gave up an operation; rebuild it");
  const size_t bytes = n * dtype_size(t);
  if (bytes > data_bytes_ - head_)
    throw CollectiveError("cross-node part of " + std::to_string(bytes) +
                          " bytes exceeds the GASPI segment (" +
                          std::to_string(data_bytes_ - head_) + ")");
  const int slot = static_cast<int>(ops_ % kSlots);
  if (busy_[slot])
    throw CollectiveError("more than " + std::to_string(kSlots) +
                          " GASPI exchanges in flight at once");
  busy_[slot] = true;
  if (check) std::memcpy(base_ + data_offset(slot), check, kCheckBytes);
  if (bytes) copy_bytes(base_ + data_offset(slot) + head_, in, bytes);
  return new Exchange(*this, ops_++, check, static_cast<char*>(out), n, t, op);
}

bool GaspiTransport::released(int slot, uint64_t op) {
  if (released_ops_[slot] > op / kSlots) return true;
  gaspi_notification_id_t got = 0;
  gaspi_return_t rc = gaspi_notify_waitsome(seg_, release_id(slot), 1, &got, GASPI_TEST);
  if (rc == GASPI_TIMEOUT) return false;
  gaspi_notification_t old = 0;
  if (rc == GASPI_SUCCESS) rc = gaspi_notify_reset(seg_, release_id(slot), &old);
  if (rc != GASPI_SUCCESS) throw CollectiveError("gaspi_notify_waitsome/reset: " + gaspi_error(rc));
  if (old != value_of(op))
    throw CollectiveError("GASPI release " + std::to_string(old) + " from rank " +
                          std::to_string(right_) + " belongs to another operation (expected " +
                          std::to_string(value_of(op)) + ")");
  ++released_ops_[slot];
  return true;
}

bool GaspiTransport::release(int slot, uint64_t op) {
  const gaspi_return_t rc =
      gaspi_notify(left_seg_, left_, release_id(slot), value_of(op), queue_, GASPI_TEST);
  if (rc == GASPI_QUEUE_FULL || rc == GASPI_TIMEOUT) {
    reap();
    return false;
  }
  if (rc != GASPI_SUCCESS)
    throw CollectiveError("gaspi_notify to rank " + std::to_string(left_) + ": " + gaspi_error(rc));
  return true;
}

void GaspiTransport::reap() {
  const gaspi_return_t rc = gaspi_wait(queue_, GASPI_TEST);
  if (rc != GASPI_SUCCESS && rc != GASPI_TIMEOUT) note_failure(rc);
}

void GaspiTransport::note_failure(gaspi_return_t rc) {
  if (!lost_.empty()) return;
  // GPI-2 marks the rank whose transfer failed in its state vector.
  std::vector<gaspi_state_t> states(gaspi_runtime.machines.size(), GASPI_STATE_HEALTHY);
  std::vector<int> failed;
  if (gaspi_state_vec_get(states.data()) == GASPI_SUCCESS)
    for (gaspi_rank_t peer : {left_, right_})
      if (states[peer] != GASPI_STATE_HEALTHY &&
          std::find(failed.begin(), failed.end(), peer) == failed.end())
        failed.push_back(peer);
  if (failed.empty()) failed.push_back(right_);
  lost_ = "the GASPI transfers to rank " + rank_list(failed) + " failed (" + gaspi_error(rc) +
          "): its process or its host is gone";
  lost_at_ = std::chrono::steady_clock::now();
}

void GaspiTransport::probe() {
  if (probing_) {
    const gaspi_return_t rc = gaspi_wait(probe_queue_, GASPI_TEST);
    if (rc == GASPI_TIMEOUT) {
      const auto waited = std::chrono::steady_clock::now() - probe_sent_;
      if (waited < probe_limit_) return;
      char secs[32];
      snprintf(secs, sizeof secs, "%.3g", std::chrono::duration<double>(waited).count());
      throw RankLostError("rank " + std::to_string(probed_) + " (host " +
                          gaspi_runtime.machines[probed_].host + ") has not answered GASPI for " +
                          secs + " s: its host or its link is down");
    }
    probing_ = false;
    if (rc != GASPI_SUCCESS) return note_failure(rc);
  }
  if (!lost_.empty()) return;
  probed_ = probed_ == left_ ? right_ : left_;
  const gaspi_segment_id_t remote = probed_ == left_ ? left_seg_ : right_seg_;
  if (gaspi_read(seg_, probe_offset(), probed_, remote, 0, 8, probe_queue_, GASPI_TEST) ==
      GASPI_SUCCESS) {
    probing_ = true;
    probe_sent_ = std::chrono::steady_clock::now();
  }
}

void GaspiTransport::check_peers() {
  const auto now = std::chrono::steady_clock::now();
  if (!lost_.empty() && now - lost_at_ > kLostGrace) throw RankLostError(lost_);
  if (now < next_check_) return;
  next_check_ = now + kPeerCheckPeriod;
  const GaspiMachine& me = gaspi_runtime.machines[world_ranks_[rank_]];
  for (int i = 0; i < size_; ++i) {
    const GaspiMachine& m = gaspi_runtime.machines[world_ranks_[i]];
    if (i == rank_ || strcmp(m.pids, me.pids) != 0 || process_alive(m.pid)) continue;
    throw RankLostError("rank " + std::to_string(world_ranks_[i]) + " (pid " +
                        std::to_string(m.pid) + ") died during the inter-node exchange");
  }
  probe();
  reap();
}

Exchange::Exchange(GaspiTransport& t, uint64_t op, int64_t* check, char* user, size_t n,
                   DType dtype, Op reduce_op)
    : t_(t),
      op_(op),
      slot_(static_cast<int>(op % kSlots)),
      check_(check),
      user_(user),
      n_(n),
      es_(dtype_size(dtype)),
      c_((n + static_cast<size_t>(t.size_) - 1) / static_cast<size_t>(t.size_)),
      dtype_(dtype),
      op_kind_(reduce_op),
      value_(GaspiTransport::value_of(op)) {
  if (check_) std::memcpy(running_, check_, kCheckBytes);
}

Exchange::~Exchange() {
  if (!done_) t_.abandoned_ = true;  // its area may still be written: never reused
}

bool Exchange::blocked() {
  t_.check_peers();
  return false;
}

bool Exchange::post() {
  const int P = t_.size_, r = t_.rank_, s = step_;
  if (s == 0 && op_ >= kSlots && !t_.released(slot_, op_ - kSlots)) return false;
  const gaspi_notification_id_t id = t_.step_id(slot_, s);
  gaspi_return_t rc = GASPI_SUCCESS;
  if (P == 2) {  // [head | part] where the call is checked, else the part
    const size_t skip = check_ ? 0 : t_.head_;
    rc = gaspi_write_notify(t_.seg_, t_.data_offset(slot_) + skip, t_.right_, t_.right_seg_,
                            t_.recv_offset(slot_, 0) + skip, t_.head_ - skip + n_ * es_, id,
                            value_, t_.queue_, GASPI_TEST);
  } else {
    const bool scatter = s < P - 1;
    const int block = scatter ? t_.mod(r - s) : t_.mod(r + 1 - (s - (P - 1)));
    const gaspi_offset_t data = t_.data_offset(slot_) + t_.head_ + block_offset(block);
    const gaspi_size_t bytes = block_bytes(block);
    if (!scatter) {  // in place in the neighbour's data
      rc = gaspi_write_notify(t_.seg_, data, t_.right_, t_.right_seg_, data, bytes, id, value_,
                              t_.queue_, GASPI_TEST);
    } else if (!check_) {  // behind the head of the receive space
      rc = gaspi_write_notify(t_.seg_, data, t_.right_, t_.right_seg_,
                              t_.recv_offset(slot_, s) + t_.head_, bytes, id, value_, t_.queue_,
                              GASPI_TEST);
    } else {  // [head | block]: the check so far (ours, then what the last step left), the block
      gaspi_segment_id_t segs[2] = {t_.seg_, t_.seg_}, remote[2] = {t_.right_seg_, t_.right_seg_};
      gaspi_offset_t from[2] = {s ? t_.recv_offset(slot_, s - 1) : t_.data_offset(slot_), data};
      gaspi_offset_t to[2] = {t_.recv_offset(slot_, s), t_.recv_offset(slot_, s) + t_.head_};
      gaspi_size_t sizes[2] = {t_.head_, bytes};
      rc = gaspi_write_list_notify(bytes ? 2 : 1, segs, from, t_.right_, remote, to, sizes,
                                   t_.right_seg_, id, value_, t_.queue_, GASPI_TEST);
    }
  }
  if (rc == GASPI_SUCCESS) return posted_ = true;
  if (rc == GASPI_QUEUE_FULL || rc == GASPI_TIMEOUT) {  // drain the queue, retry on the next test
    t_.reap();
    return false;
  }
  throw CollectiveError("gaspi_write_notify to rank " + std::to_string(t_.right_) + ": " +
                        gaspi_error(rc));
}

bool Exchange::finish() {
  // Our writes must have left the area before the result is taken from it and it is released.
  const gaspi_return_t rc = gaspi_wait(t_.queue_, GASPI_TEST);
  if (rc != GASPI_SUCCESS) {
    if (rc != GASPI_TIMEOUT) t_.note_failure(rc);
    return blocked();
  }
  if (!t_.release(slot_, op_)) return blocked();
  char* data = t_.base_ + t_.data_offset(slot_);
  if (t_.size_ == 2) {  // both parts, in the same order on both ranks
    const char* theirs = t_.base_ + t_.recv_offset(slot_, 0);
    bool agrees = true;
    if (check_) {  // (reduced as the check's own allreduce would: max)
      int64_t other[kCheckValues];
      std::memcpy(other, theirs, kCheckBytes);
      for (int i = 0; i < kCheckValues; ++i) check_[i] = std::max(check_[i], other[i]);
      agrees = check_agrees(check_);
    }
    const void* srcs[2] = {data + t_.head_, theirs + t_.head_};
    if (t_.rank_ == 1) std::swap(srcs[0], srcs[1]);
    if (agrees) reduce(dtype_, op_kind_, srcs, 2, user_, nullptr, n_, 1);
  } else if (agrees_) {
    copy_bytes(user_, data + t_.head_, n_ * es_);
  }
  t_.busy_[slot_] = false;
  done_ = true;
  return true;
}

bool Exchange::test() {
  if (done_) return true;
  const int P = t_.size_;
  for (;;) {
    if (step_ == t_.steps()) return finish();
    if (!posted_ && !post()) return blocked();
    const gaspi_notification_id_t id = t_.step_id(slot_, step_);
    gaspi_notification_id_t got = 0;
    gaspi_return_t rc = gaspi_notify_waitsome(t_.seg_, id, 1, &got, GASPI_TEST);
    if (rc == GASPI_TIMEOUT) return blocked();
    gaspi_notification_t old = 0;
    if (rc == GASPI_SUCCESS) rc = gaspi_notify_reset(t_.seg_, id, &old);
    if (rc != GASPI_SUCCESS)
      throw CollectiveError("gaspi_notify_waitsome/reset: " + gaspi_error(rc));
    if (old != value_)
      throw CollectiveError("GASPI notification " + std::to_string(id) + " from rank " +
                            std::to_string(t_.left_) + " belongs to another operation (" +
                            std::to_string(old) + ", expected " + std::to_string(value_) + ")");
    if (P > 2 && step_ < P - 1) {  // reduce the left neighbour's partial block into ours
      char* received = t_.base_ + t_.recv_offset(slot_, step_);
      if (check_) {  // its check so far into ours; sent on in front of the next block
        int64_t theirs[kCheckValues];
        std::memcpy(theirs, received, kCheckBytes);
        for (int i = 0; i < kCheckValues; ++i) running_[i] = std::max(running_[i], theirs[i]);
        std::memcpy(received, running_, kCheckBytes);
        if (step_ == P - 2) {  // (the max of every rank's)
          std::memcpy(check_, running_, kCheckBytes);
          agrees_ = check_agrees(check_);
        }
      }
      const int block = t_.mod(t_.rank_ - 1 - step_);
      char* mine = t_.base_ + t_.data_offset(slot_) + t_.head_ + block_offset(block);
      const void* srcs[2] = {mine, received + t_.head_};
      reduce(dtype_, op_kind_, srcs, 2, mine, nullptr, block_bytes(block) / es_, 1);
    }
    ++step_;
    posted_ = false;
  }
}

}  // namespace

std::unique_ptr<Transport> make_gaspi_transport(MPI_Comm cross, std::vector<int> world_ranks,
                                                size_t max_bytes, double timeout_s,
                                                const MpiWait& wait) {
  return std::make_unique<GaspiTransport>(cross, std::move(world_ranks), max_bytes, timeout_s,
                                          wait);
}

}  // namespace tnt

#else  // built without GPI-2

namespace tnt {

std::unique_ptr<Transport> make_gaspi_transport(MPI_Comm, std::vector<int>, size_t, double,
                                                const MpiWait&) {
  throw std::logic_error("this build has no GASPI transport");
}

}  // namespace tnt

#endif
