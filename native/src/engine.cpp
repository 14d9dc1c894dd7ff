#include "tnt/engine.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <tuple>

#include "tnt/errors.hpp"
#include "tnt/gaspi_transport.hpp"
#include "tnt/reduce.hpp"

namespace tnt {
namespace {

// The largest message that MPICH over UCX's TCP sends at once, before the call returns, so that
// the kernel carries it on while nobody polls (2 test hosts at 1 Gbit/s: messages of 30 KiB
// posted around 3 ms of computation left 71 us of 120 KB to move after it, of 31 KiB 822 us).
constexpr size_t kUnattendedBytes = size_t{30} << 10;

std::string seconds(double s) {
  char buf[32];
  snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Engine::Engine(MPI_Comm world, const EngineOptions& opt)
    : opt_(opt), world_(world), choice_(opt.path), posting_(opt.path) {}

Engine::~Engine() { close(); }

// What each rank tells every other at the bootstrap: local rank, node size, allreduce path, slot
// bytes (two ints).
constexpr int kTopologyInts = 5;

// Buffers of the nonblocking bootstrap operations (MPI may write them while it is suspended).
struct BootBuffers {
  MPI_Comm comm = MPI_COMM_NULL, machine = MPI_COMM_NULL, cross = MPI_COMM_NULL;
  MPI_Comm wcomm = MPI_COMM_NULL;
  int rank = 0;
  int mine[kTopologyInts] = {};
  std::vector<int> node_ranks, all, cross_ranks;
  std::vector<unsigned char> mask, masks;
  char name[512] = {};
  int ok = 1;
  std::string error;  // why this rank could not map the segment
  NoticeAddress notice_me;
  std::vector<NoticeAddress> notice_all;
};

void Engine::start(const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (ready_) return;
  if (closed_ || broken_) throw AbortedError("the engine's bootstrap failed or it was closed");
  if (!boot_) boot_ = std::make_unique<BootBuffers>();
  while (!ready_) {
    if (boot_req_ != MPI_REQUEST_NULL)  // may suspend
      wait_boot(&boot_req_, boot_what_, interrupt, true);
    try {
      bootstrap_step(interrupt);
    } catch (...) {
      broken_ = true;
      seg_.unlink();
      throw;
    }
  }
  boot_.reset();
}

void Engine::wait_boot(MPI_Request* req, const char* what, const InterruptCheck& interrupt,
                       bool resumable) {
  const auto begin = std::chrono::steady_clock::now();
  const auto end = begin + std::chrono::microseconds(static_cast<int64_t>(opt_.timeout_s * 1e6));
  const auto grace = std::chrono::duration<double>(kBootstrapInterruptGraceSeconds);
  Backoff backoff;
  for (;;) {
    int done = 0;
    try {
      check_mpi(MPI_Test(req, &done, MPI_STATUS_IGNORE), what);
    } catch (...) {
      broken_ = abandoned_ = true;
      throw;
    }
    if (done) return;
    if (!backoff.pause()) continue;
    const auto now = std::chrono::steady_clock::now();
    const bool interrupted = now - begin >= grace && interrupt && interrupt();
    if (!resumable && (now > end || interrupted)) abandoned_ = true;  // (its request stays)
    if (now > end)
      throw TimeoutError(std::string("engine bootstrap timed out after ") +
                         seconds(opt_.timeout_s) + " s in " + what + ": not every rank joined it" +
                         (resumable ? " (the next collective resumes it)"
                                    : " (this step cannot resume: the engine is rebuilt)"));
    if (interrupted) throw Interrupted();
  }
}

void Engine::bootstrap_step(const InterruptCheck& interrupt) {
  BootBuffers& b = *boot_;
  MPI_Request* req = &boot_req_;
  // GASPI's start and segments run inside one step, each wait bounded but not resumable (GPI-2
  // starts once per process: a start cut short cannot be continued).
  const MpiWait gaspi_wait = [&](MPI_Request* r, const char* what) {
    wait_boot(r, what, interrupt, false);
  };
  auto started = [&](int rc, const char* what) {
    boot_what_ = what;
    check_mpi(rc, what);
  };
  switch (boot_step_++) {
    case 0:
      started(MPI_Comm_idup(world_, &b.comm, req), "MPI_Comm_idup");
      return;

    case 1:  // Node membership: MPI's shared-memory split, or pseudo-nodes of k consecutive ranks.
      comm_ = b.comm;
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
      b.rank = rank_;
      if (opt_.transport == TransportKind::gaspi)  // every rank, whatever the topology
        gaspi_start(comm_, opt_.gaspi_port, opt_.timeout_s, gaspi_wait);
      if (opt_.ranks_per_node > 0)
        check_mpi(MPI_Comm_split(comm_, rank_ / opt_.ranks_per_node, rank_, &node_),
                  "MPI_Comm_split");
      else
        check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_),
                  "MPI_Comm_split_type");
      MPI_Comm_rank(node_, &cfg_.local_rank);
      MPI_Comm_size(node_, &cfg_.local_size);
      cfg_.world_size = size_;
      cfg_.slot_bytes = opt_.slot_bytes ? opt_.slot_bytes : kDefaultSlotBytes;
      b.node_ranks.resize(static_cast<size_t>(cfg_.local_size));
      started(MPI_Iallgather(&b.rank, 1, MPI_INT, b.node_ranks.data(), 1, MPI_INT, node_, req),
              "MPI_Iallgather (node ranks)");
      return;

    case 2:  // Every rank's local rank and node size, its allreduce path policy and slot size.
      cfg_.world_ranks = b.node_ranks;
      b.mine[0] = cfg_.local_rank;
      b.mine[1] = cfg_.local_size;
      b.mine[2] = static_cast<int>(opt_.path);
      b.mine[3] = static_cast<int>(cfg_.slot_bytes & 0x7fffffff);
      b.mine[4] = static_cast<int>(cfg_.slot_bytes >> 31);
      b.all.resize(kTopologyInts * static_cast<size_t>(size_));
      started(MPI_Iallgather(b.mine, kTopologyInts, MPI_INT, b.all.data(), kTopologyInts, MPI_INT,
                             comm_, req),
              "MPI_Iallgather (topology)");
      return;

    case 3: {  // The number of nodes, whether they are even, and the machine's cpu sets.
      bool uniform = true;
      nnodes_ = 0;
      for (int r = 0; r < size_; ++r) {
        const int* theirs = &b.all[kTopologyInts * static_cast<size_t>(r)];
        nnodes_ += theirs[0] == 0;
        uniform = uniform && theirs[1] == cfg_.local_size;
        // (ranks that chose differently would wait for each other)
        if (theirs[2] != b.mine[2])
          throw CollectiveError("ranks " + std::to_string(rank_) + " and " + std::to_string(r) +
                                " were given different allreduce paths (TNT_ALLREDUCE_PATH)");
        // (an exchange between nodes has room for a round's part of its own size only)
        if (theirs[3] != b.mine[3] || theirs[4] != b.mine[4])
          throw CollectiveError("ranks " + std::to_string(rank_) + " and " + std::to_string(r) +
                                " were given different shared-memory slot sizes "
                                "(TNT_SHM_SEGMENT_BYTES)");
      }
      cfg_.num_nodes = nnodes_;
      // On uneven nodes only the node leader reduces (and talks to other nodes).
      cfg_.nparts = uniform ? cfg_.local_size : 1;
      // Ranks that outnumber the cores they may run on (all ranks of the machine together,
      // whatever pseudo-nodes split them) must not spin: the rank they wait for needs the core.
      b.machine = node_;
      if (opt_.ranks_per_node > 0)
        check_mpi(
            MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &b.machine),
            "MPI_Comm_split_type");
      int machine_size = 1;
      MPI_Comm_size(b.machine, &machine_size);
      b.mask = cpu_mask();
      b.masks.resize(b.mask.size() * static_cast<size_t>(machine_size));
      const int n = static_cast<int>(b.mask.size());
      started(MPI_Iallgather(b.mask.data(), n, MPI_BYTE, b.masks.data(), n, MPI_BYTE, b.machine,
                             req),
              "MPI_Iallgather (cpu sets)");
      return;
    }

    case 4: {  // The spin policy; the communicator of the ranks with our local rank.
      int machine_size = 1;
      MPI_Comm_size(b.machine, &machine_size);
      if (b.machine != node_) MPI_Comm_free(&b.machine);
      if (opt_.spin_us >= 0)
        spin_us_ = opt_.spin_us;  // the user's choice
      else
        spin_us_ = machine_size > count_cpus(b.masks) ? 0 : kDefaultSpinMicroseconds;
      set_spin_microseconds(spin_us_);
      check_mpi(MPI_Comm_split(comm_,
                               cfg_.local_rank < cfg_.nparts ? cfg_.local_rank : MPI_UNDEFINED,
                               rank_, &b.cross),
                "MPI_Comm_split");
      if (b.cross == MPI_COMM_NULL) return;  // (no operation: the next step follows at once)
      int n = 0;
      MPI_Comm_size(b.cross, &n);
      b.cross_ranks.resize(static_cast<size_t>(n));
      started(MPI_Iallgather(&b.rank, 1, MPI_INT, b.cross_ranks.data(), 1, MPI_INT, b.cross, req),
              "MPI_Iallgather (cross-node ranks)");
      return;
    }

    case 5:  // The shared segment: local rank 0 creates it and broadcasts its name (or its error).
      if (b.cross != MPI_COMM_NULL) {
        // (which owns b.cross from here on; GASPI's set-up, the last step, still uses it)
        cross_mpi_ = std::make_unique<MpiTransport>(b.cross, b.cross_ranks, part_bytes(cfg_));
      }
      if (cfg_.local_rank == 0) {
        try {
          seg_.create(new_segment_name(), segment_bytes(cfg_));
          group_ = std::make_unique<NodeGroup>(cfg_, &seg_, true);  // initialises the header
          snprintf(b.name, sizeof b.name, "%s", seg_.name().c_str());
        } catch (const std::exception& e) {
          snprintf(b.name, sizeof b.name, "!%s", e.what());
        }
      }
      started(MPI_Ibcast(b.name, sizeof b.name, MPI_CHAR, 0, node_, req),
              "MPI_Ibcast (segment name)");
      return;

    case 6:  // Every rank maps it (or fails), and all ranks of every node learn whether all did.
      if (b.name[0] == '!') {
        b.ok = 0;
        b.error = std::string("local rank 0 could not create the shared segment: ") + (b.name + 1);
      } else if (cfg_.local_rank != 0) {
        try {
          seg_.open(b.name, segment_bytes(cfg_));
          group_ = std::make_unique<NodeGroup>(cfg_, &seg_, false);
          group_->attach();  // also checks that every local rank uses the same configuration
        } catch (const std::exception& e) {
          b.ok = 0;
          b.error = std::string("a local rank could not map the shared segment: ") + e.what();
        }
      }
      started(MPI_Iallreduce(MPI_IN_PLACE, &b.ok, 1, MPI_INT, MPI_MIN, comm_, req),
              "MPI_Iallreduce (segment attach)");
      return;

    case 7:  // Everyone has mapped it (or failed): the name can go, nothing is left in /dev/shm.
      seg_.unlink();
      if (!b.ok)
        throw CollectiveError(b.error.empty()
                                  ? std::string("another rank could not map the shared segment "
                                                "of its node (see its error)")
                                  : b.error);
      seg_name_ = b.name;
      if (cfg_.local_rank == 0) group_->attach();
      if (nnodes_ > 1) {  // aborts reach other nodes as datagrams (abort_notices.hpp)
        notices_ = std::make_unique<AbortNotices>();
        b.notice_me = notices_->address(rank_ == 0 ? random_token() : 0);
        b.notice_all.resize(static_cast<size_t>(size_));
        started(MPI_Iallgather(&b.notice_me, sizeof(NoticeAddress), MPI_BYTE, b.notice_all.data(),
                               sizeof(NoticeAddress), MPI_BYTE, comm_, req),
                "MPI_Iallgather (abort notice addresses)");
      }
      return;

    case 8:
      if (nnodes_ > 1) {
        std::vector<bool> remote(static_cast<size_t>(size_), true);
        for (int w : cfg_.world_ranks) remote[static_cast<size_t>(w)] = false;
        notices_->set_world(b.notice_all, rank_, std::move(remote));
        group_->set_remote_abort([this] { return notices_->poll(); },
                                 [this](const std::string& why) {
                                   notices_->announce("rank " + std::to_string(rank_) + ": " + why);
                                 });
      }
      started(MPI_Comm_idup(comm_, &b.wcomm, req), "MPI_Comm_idup (world)");
      return;

    default: {
      if (opt_.transport == TransportKind::gaspi && cross_mpi_ && cross_mpi_->size() > 1)
        cross_gaspi_ = make_gaspi_transport(b.cross, b.cross_ranks, part_bytes(cfg_),
                                            opt_.timeout_s, gaspi_wait);
      std::vector<int> wranks(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) wranks[static_cast<size_t>(r)] = r;
      world_mpi_ = std::make_unique<MpiCollectives>(b.wcomm, std::move(wranks));
      ready_ = true;
    }
  }
}

namespace {
// True when a piece's output overlaps its input without being it.
bool overlaps_partly(const Piece& p) {
  const auto in = reinterpret_cast<uintptr_t>(p.in), out = reinterpret_cast<uintptr_t>(p.out);
  return in != out && in < out + p.bytes && out < in + p.bytes;
}
}  // namespace

void Engine::allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                       const InterruptCheck& interrupt, bool caller_keeps_buffers) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (!usable()) throw AbortedError("the engine is not started, was aborted or closed; rebuild it");
  size_t bytes = 0;
  bool overlap = false;
  for (const auto& p : pieces) {
    bytes += p.bytes;
    overlap = overlap || overlaps_partly(p);
  }
  const size_t count = bytes / dtype_size(t);
  // Such an input would be read after the output overwrote it: reduce a copy of it instead (as
  // numpy's ufuncs do). An output that is its input reduces in place.
  std::vector<std::vector<char>> copies;
  std::vector<Piece> safe;
  if (overlap) {
    safe = pieces;
    for (auto& p : safe)
      if (overlaps_partly(p)) {
        copies.emplace_back(p.in, p.in + p.bytes);
        p.in = copies.back().data();
      }
  }
  const std::vector<Piece>& ps = overlap ? safe : pieces;
  const Call call{Kind::allreduce, t, op, bucket};
  if (size_ == 1 || count == 0 || count > static_cast<size_t>(INT_MAX) ||
      choice_.policy() == PathPolicy::engine) {
    group_->run(ps, count, call, cross(), opt_.timeout_s, interrupt,
                caller_keeps_buffers && !overlap);
    return;
  }
  const SiteKey key{static_cast<int64_t>(count), static_cast<int32_t>(t),
                    static_cast<int32_t>(op), bucket};
  bool timed = false;
  const Path path = choice_.next(key, &timed);
  const auto start = std::chrono::steady_clock::now();
  try {
    if (path == Path::mpi)
      allreduce_mpi(ps, count, call, interrupt, caller_keeps_buffers && !overlap);
    else
      group_->run(ps, count, call, cross(), opt_.timeout_s, interrupt,
                  caller_keeps_buffers && !overlap);
  } catch (const MismatchError&) {
    choice_.reset();  // the ranks' call counts may differ from here on
    throw;
  }
  if (!timed) return;
  double medians[2];
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!choice_.record(key, path, took, medians)) return;
  agree_on(medians, interrupt);
  choice_.decide(key, medians);
}

void Engine::agree_on(double medians[2], const InterruptCheck& interrupt) {
  std::unique_ptr<double[]> v(new double[2]{medians[0], medians[1]});
  try {
    group_->wait_pending(world_mpi_->start_allreduce(v.get(), v.get(), 2, DType::f64, Op::max),
                         "allreduce", world_mpi_->describe_peers(), opt_.timeout_s, interrupt,
                         world_mpi_.get(), true);
  } catch (...) {
    if (group_->abandoned()) (void)v.release();  // MPI may still write it
    throw;
  }
  medians[0] = v[0];
  medians[1] = v[1];
}

void Engine::allreduce_mpi(const std::vector<Piece>& pieces, size_t count, const Call& call,
                           const InterruptCheck& interrupt, bool on_pieces) {
  // On one node its ranks compare their calls through the segment while MPI's exchange starts
  // (their meeting first cost a 4 KB call 0.3-0.4 us of 6). Across nodes every rank's call is
  // checked by an allreduce of its fields (max of them and of their negations), which needs no
  // step of its own inside the node: small calls carry it in front of their data in one
  // message; larger ones start it with the data's allreduce so that both travel at once.
  uint64_t round = 0;
  if (nnodes_ == 1)
    round = group_->publish_call(call, count, opt_.timeout_s, interrupt);
  else
    group_->check_not_aborted("allreduce");
  const size_t es = dtype_size(call.dtype), bytes = count * es;
  const bool blob = nnodes_ > 1 && bytes <= one_message_bytes();
  const bool direct = !blob && on_pieces && pieces.size() == 1;
  // The engine's own memory: the check, and unless `direct` a copy of the pieces. (A given-up
  // operation may still use it: then it is leaked.)
  const size_t need = kCheckBytes + (direct ? 0 : bytes);
  if (!mpi_stage_) mpi_stage_ = new std::vector<char>();
  if (mpi_stage_->size() < need) mpi_stage_->resize(need);
  char* stage = mpi_stage_->data();
  const int64_t fields[6] = {static_cast<int64_t>(call.kind), static_cast<int64_t>(count),
                             static_cast<int64_t>(call.dtype), static_cast<int64_t>(call.op),
                             call.bucket, 0};
  int64_t* check = reinterpret_cast<int64_t*>(stage);
  fill_call_check(fields, check);
  const void* in = MPI_IN_PLACE;
  char* out = stage + kCheckBytes;
  if (direct) {
    out = pieces[0].out;
    if (pieces[0].in != out) in = pieces[0].in;
  } else {
    size_t at = 0;
    for (const Piece& p : pieces) {
      copy_bytes(out + at, p.in, p.bytes);
      at += p.bytes;
    }
  }
  const std::string peers = world_mpi_->describe_peers();
  auto wait = [&](Pending* p, double timeout_s) {
    group_->wait_pending(p, "allreduce", peers, timeout_s, interrupt, world_mpi_.get(), true);
  };
  int64_t other[5];
  if (blob) {
    wait(world_mpi_->start_blob_allreduce(stage, count, call.dtype), opt_.timeout_s);
    if (!call_check_result(fields, check, other)) {
      broken_ = true;  // (as below: every rank rebuilds, whatever MPI made of unequal blobs)
      throw MismatchError(ranks_disagree(fields, other));
    }
  } else {
    Pending* checked = nnodes_ > 1 ? world_mpi_->start_allreduce(check, check, kCheckValues,
                                                                 DType::i64, Op::max)
                                   : nullptr;
    const Op op = call.op == Op::average ? Op::sum : call.op;
    Pending* data = nullptr;
    std::string local;
    try {
      data = world_mpi_->start_allreduce(in, out, count, call.dtype, op);
      if (nnodes_ == 1) local = group_->compare_calls(round, data, opt_.timeout_s, interrupt);
    } catch (...) {
      broken_ = true;  // the node's ranks no longer meet in step (and MPI may still use `data`)
      if (data) {
        world_mpi_->abandon();
        abandoned_ = true;
      }
      throw;
    }
    if (checked) wait(checked, opt_.timeout_s);
    if (nnodes_ == 1 ? !local.empty() : !call_check_result(fields, check, other)) {
      // Some ranks made different calls: the data's allreduce may never complete. Every rank
      // sees the same fields, raises, and rebuilds its engine at the next collective.
      broken_ = true;
      try {
        wait(data, std::min(opt_.timeout_s, 1.0));
      } catch (const CollectiveError&) {
        abandoned_ = true;
      }
      throw MismatchError(nnodes_ == 1 ? local : ranks_disagree(fields, other));
    }
    wait(data, opt_.timeout_s);
  }
  if (nnodes_ > 1) group_->check_remote_abort("allreduce");  // (see NodeGroup::run)
  if (call.op == Op::average) divide(call.dtype, out, count, size_);
  if (!direct) {
    size_t at = 0;
    for (const Piece& p : pieces) {
      copy_bytes(p.out, out + at, p.bytes);
      at += p.bytes;
    }
  }
}

bool Engine::overlaps_exchanges() const {
  return usable() && nnodes_ > 1 && choice_.policy() != PathPolicy::engine;
}

int64_t Engine::start_allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                                const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (!usable()) throw AbortedError("the engine is not started, was aborted or closed; rebuild it");
  const auto begin = std::chrono::steady_clock::now();
  const size_t es = dtype_size(t);
  size_t bytes = 0;
  for (const auto& p : pieces) bytes += p.bytes;
  if (started_.empty()) batch_ = Batch{};
  Started s;
  s.ticket = next_ticket_++;
  s.call = Call{Kind::allreduce, t, op, bucket};
  s.count = bytes / es;
  if (overlaps_exchanges() && s.count > 0 && bytes <= one_message_bytes()) {
    if (!batch_.decided) {
      batch_.key = SiteKey{static_cast<int64_t>(s.count), static_cast<int32_t>(t),
                           static_cast<int32_t>(op), bucket};
      batch_.posting = posting_.next(batch_.key, &batch_.timed) == Path::mpi;
      batch_.decided = true;
    }
    s.posted = batch_.posting;
  }
  if (s.posted) {
    try {
      post(s, pieces, interrupt);
    } catch (...) {
      abandon_started(s);
      throw;
    }
  }
  batch_.exposed += std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  started_.push_back(std::move(s));
  return started_.back().ticket;
}

bool Engine::posts_swaps(size_t count, DType dtype) const {
  return nnodes_ == 2 && cfg_.nparts == cfg_.local_size &&
         (cfg_.local_size == 1 || count <= group_->round_elements(dtype_size(dtype)));
}

void Engine::post(Started& s, const std::vector<Piece>& pieces, const InterruptCheck& interrupt) {
  group_->check_not_aborted("allreduce");
  // The call check and the data, in messages that MPICH over UCX's TCP hands to the sockets at
  // once, so they travel while this rank computes. On two nodes of K ranks each, every rank swaps
  // [check | part] with the rank of its local rank on the other node, in messages of at most
  // kUnattendedBytes, the first received into room for any first message (ranks whose calls
  // differ in size still read each other's check), and reduces both parts at the finish: all of
  // it moves unattended, where an MPI_Iallreduce of a fragment sends half (its reduce-scatter) at
  // once and the rest (its allgather) only when polled. With K > 1 the node's ranks first sum the
  // call through the segment (they meet here) and each swaps the part of the sum it reduces in
  // the node group, so that each node sends the call's bytes once, as the engine's own path does;
  // the finish gathers the parts through the segment. Otherwise (more nodes, nodes of different
  // sizes, a call longer than a round) the check goes as an MPI_Iallreduce of MPI's own datatype
  // and op, then one per fragment of at most kFragmentBytes. (One message of check and data, as
  // MPI's path sends it, has a datatype and op of our own, and MPICH's MPI_Iallreduce sends such
  // a call before it returns.)
  const size_t es = dtype_size(s.call.dtype), bytes = s.count * es;
  const int nlocal = cfg_.local_size;
  s.swapped = posts_swaps(s.count, s.call.dtype);
  s.hi = s.count;
  if (s.swapped && nlocal > 1) std::tie(s.lo, s.hi) = part_of(s.count, nlocal, cfg_.local_rank);
  const size_t part = (s.hi - s.lo) * es;
  const size_t theirs = s.swapped ? std::max(kCheckBytes + part, kUnattendedBytes) : 0;
  s.stage = take_stage(kCheckBytes + bytes + theirs);
  // The stage: [check | the call's data], and where ranks swap, the peer's [check | part] after
  // it; the check goes right in front of this rank's part (over the end of the part before it,
  // which the node's gather takes from another rank).
  char* stage = s.stage->data();
  char* data = stage + kCheckBytes;
  std::exception_ptr node_mismatch;
  int64_t fields[6] = {static_cast<int64_t>(Kind::allreduce), static_cast<int64_t>(s.count),
                       static_cast<int64_t>(s.call.dtype), static_cast<int64_t>(s.call.op),
                       s.call.bucket, 0};
  if (s.swapped && nlocal > 1) {
    std::vector<Piece> into;
    size_t at = 0;
    for (const Piece& p : pieces) {
      into.push_back(Piece{p.in, data + at, p.bytes});
      at += p.bytes;
    }
    const Op op = s.call.op == Op::average ? Op::sum : s.call.op;
    try {
      group_->run(into, s.count, Call{Kind::allreduce, s.call.dtype, op, s.call.bucket}, nullptr,
                  opt_.timeout_s, interrupt, false, true);
    } catch (const MismatchError&) {
      // The swap still goes out, its check saying that this node disagrees, so that the other
      // node raises at its finish; this one raises once it is posted.
      node_mismatch = std::current_exception();
      fields[5] = 1;
    }
  } else {
    size_t at = 0;
    for (const Piece& p : pieces) {
      copy_bytes(data + at, p.in, p.bytes);
      at += p.bytes;
    }
  }
  std::copy(fields, fields + 6, s.fields);
  char* head = data + s.lo * es - kCheckBytes;
  int64_t* check = reinterpret_cast<int64_t*>(head);
  fill_call_check(fields, check);
  if (s.swapped) {
    const int peer = cross_mpi_->world_rank(1 - cross_mpi_->rank());
    char* received = data + bytes;
    for (size_t off = 0; off < kCheckBytes + part; off += kUnattendedBytes) {
      const size_t n = std::min(kUnattendedBytes, kCheckBytes + part - off);
      s.fragments.push_back(
          world_mpi_->start_message(false, received + off, off ? n : kUnattendedBytes, peer));
      s.fragments.push_back(world_mpi_->start_message(true, head + off, n, peer));
    }
    if (node_mismatch) std::rethrow_exception(node_mismatch);
    return;
  }
  s.fragments.push_back(world_mpi_->start_allreduce(check, check, kCheckValues, DType::i64, Op::max));
  const size_t fragment = kFragmentBytes / es * es;
  const Op op = s.call.op == Op::average ? Op::sum : s.call.op;
  for (size_t off = 0; off < bytes; off += fragment) {
    s.fragments.push_back(world_mpi_->start_allreduce(
        data + off, data + off, std::min(fragment, bytes - off) / es, s.call.dtype, op));
  }
}

void Engine::finish_allreduce(int64_t ticket, const std::vector<Piece>& pieces,
                              const InterruptCheck& interrupt) {
  Started s;
  {
    std::lock_guard<std::mutex> lock(call_mutex_);
    if (started_.empty() || started_.front().ticket != ticket)
      throw std::invalid_argument(
          "finish_allreduce: allreduces finish in the order of their starts, on the engine that "
          "started them");
    s = std::move(started_.front());
    started_.pop_front();
  }
  const auto begin = std::chrono::steady_clock::now();
  size_t bytes = 0;
  for (const auto& p : pieces) bytes += p.bytes;
  if (bytes != s.count * dtype_size(s.call.dtype)) {
    std::lock_guard<std::mutex> lock(call_mutex_);
    abandon_started(s);
    throw std::invalid_argument("finish_allreduce: the pieces differ in size from the start's");
  }
  if (s.posted)
    complete(s, pieces, interrupt);
  else
    allreduce(pieces, s.call.dtype, s.call.op, s.call.bucket, interrupt);
  std::lock_guard<std::mutex> lock(call_mutex_);
  batch_.exposed += std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  if (!started_.empty() || !batch_.timed) return;
  double medians[2];
  if (!posting_.record(batch_.key, batch_.posting ? Path::mpi : Path::engine, batch_.exposed,
                       medians))
    return;
  agree_on(medians, interrupt);
  posting_.decide(batch_.key, medians);
}

void Engine::complete(Started& s, const std::vector<Piece>& pieces,
                      const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  const std::string peers = world_mpi_->describe_peers();
  auto wait = [&](double timeout_s) {
    Pending* p = s.fragments.front();
    s.fragments.erase(s.fragments.begin());
    group_->wait_pending(p, "allreduce", peers, timeout_s, interrupt, world_mpi_.get(), true);
  };
  // The stage as post() left it.
  const size_t es = dtype_size(s.call.dtype);
  char* data = s.stage->data() + kCheckBytes;
  char* mine = data + s.lo * es;
  char* received = data + s.count * es;
  try {
    wait(opt_.timeout_s);
    int64_t* check = reinterpret_cast<int64_t*>(mine - kCheckBytes);
    if (s.swapped) {  // (the other rank's check: reduced here as MPI_Iallreduce reduces it)
      int64_t theirs[kCheckValues];
      std::memcpy(theirs, received, sizeof theirs);
      for (int i = 0; i < kCheckValues; ++i) check[i] = std::max(check[i], theirs[i]);
    }
    int64_t other[5];
    if (!call_check_result(s.fields, check, other)) {
      // (as in allreduce_mpi: every rank sees the same fields, raises and rebuilds)
      broken_ = true;
      try {
        while (!s.fragments.empty()) wait(std::min(opt_.timeout_s, 1.0));
      } catch (const CollectiveError&) {
      }
      throw MismatchError(other[0] < 0 ? nodes_disagree(s.fields, other)
                                       : ranks_disagree(s.fields, other));
    }
    while (!s.fragments.empty()) wait(opt_.timeout_s);
  } catch (...) {
    abandon_started(s);
    throw;
  }
  group_->check_remote_abort("allreduce");  // (see NodeGroup::run)
  if (s.swapped) {  // (the lower node's part first on both nodes: the same bits on each)
    const void* srcs[2] = {mine, received + kCheckBytes};
    if (cross_mpi_->rank() == 1) std::swap(srcs[0], srcs[1]);
    reduce(s.call.dtype, s.call.op, srcs, 2, mine, nullptr, s.hi - s.lo, size_);
  } else if (s.call.op == Op::average) {
    divide(s.call.dtype, data, s.count, size_);
  }
  std::vector<Piece> from;
  size_t at = 0;
  for (const Piece& p : pieces) {
    from.push_back(Piece{data + at, p.out, p.bytes});
    at += p.bytes;
  }
  if (s.swapped && cfg_.local_size > 1) {
    try {  // every part from the rank that reduced it
      group_->run(from, s.count, Call{Kind::gather, s.call.dtype, Op::sum, s.call.bucket}, nullptr,
                  opt_.timeout_s, interrupt, false, true);
    } catch (...) {
      abandon_started(s);
      throw;
    }
  } else {
    for (const Piece& p : from) copy_bytes(p.out, p.in, p.bytes);
  }
  keep_stage(s.stage);
}

std::vector<char>* Engine::take_stage(size_t bytes) {
  auto fit = spare_stages_.lower_bound(bytes);  // the smallest spare large enough
  if (fit != spare_stages_.end()) {
    std::vector<char>* stage = fit->second;
    spare_stages_.erase(fit);
    return stage;
  }
  if (!spare_stages_.empty()) {  // every spare is too small: the largest makes way
    auto largest = std::prev(spare_stages_.end());
    delete largest->second;
    spare_stages_.erase(largest);
  }
  return new std::vector<char>(bytes);
}

void Engine::abandon_started(const Started& failed) {
  // What MPI may still write into stays allocated: the engine is rebuilt before the next call.
  broken_ = true;
  bool in_flight = !failed.fragments.empty();
  for (Started& s : started_) in_flight = in_flight || !s.fragments.empty();
  if (in_flight) {
    abandoned_ = true;
    if (world_mpi_) world_mpi_->abandon();
  }
  if (!abandoned()) {  // (no wait was given up: MPI holds none of the stages)
    if (failed.stage) keep_stage(failed.stage);
    for (const Started& s : started_)
      if (s.stage) keep_stage(s.stage);
  }
  started_.clear();
}

void Engine::barrier(const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (!usable()) throw AbortedError("the engine is not started, was aborted or closed; rebuild it");
  group_->run({}, 0, Call{Kind::barrier, DType::f32, Op::sum, -1}, cross(), opt_.timeout_s,
              interrupt);
}

void Engine::broadcast(std::string& data, int root, const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (!usable()) throw AbortedError("the engine is not started, was aborted or closed; rebuild it");
  if (root < 0 || root >= size_)
    throw std::invalid_argument("broadcast root " + std::to_string(root) + " is not a rank");
  // Agree on the root (and synchronise) first: a mismatch is an error, not a hang.
  group_->run({}, 0, Call{Kind::broadcast, DType::f32, Op::sum, root}, cross(), opt_.timeout_s,
              interrupt);
  if (size_ == 1) return;
  // MPI writes into these buffers; after an abandoned wait it still might: then they leak.
  std::unique_ptr<uint64_t> size(new uint64_t(data.size()));
  std::unique_ptr<std::vector<char>> bytes(new std::vector<char>());
  auto run = [&](void* buf, size_t n) {
    MpiCollectives* w = world_mpi_.get();
    Pending* p = w->start_bcast(buf, n, root);
    group_->wait_pending(p, "broadcast", "rank " + std::to_string(root), opt_.timeout_s,
                         interrupt, w);
  };
  try {
    run(size.get(), sizeof(uint64_t));
    const size_t n = *size;
    if (rank_ == root)
      bytes->assign(data.begin(), data.end());
    else
      bytes->resize(n);
    constexpr size_t kChunk = size_t{1} << 30;
    for (size_t off = 0; off < n; off += kChunk) run(bytes->data() + off, std::min(kChunk, n - off));
    if (rank_ != root) data.assign(bytes->begin(), bytes->end());
  } catch (...) {
    if (group_->abandoned()) {
      (void)size.release();
      (void)bytes.release();
    }
    throw;
  }
}

void Engine::abort(const std::string& why) {
  if (usable()) group_->abort(why);
}

void Engine::close() {
  if (closed_) return;
  closed_ = true;
  if (boot_req_ != MPI_REQUEST_NULL) {  // a suspended bootstrap: MPI may still write its buffers
    abandoned_ = true;
    (void)boot_.release();
  }
  if (group_) group_->close();
  for (const Started& s : started_)  // (never finished: MPI may still write their stages)
    abandoned_ = abandoned_ || !s.fragments.empty();
  started_.clear();
  bool dead = broken() || abandoned_;
  if (dead) {
    if (cross_mpi_) cross_mpi_->abandon();
    if (cross_gaspi_) cross_gaspi_->abandon();
    if (world_mpi_) world_mpi_->abandon();
  }
  cross_gaspi_.reset();
  cross_mpi_.reset();
  world_mpi_.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!dead && !finalized) {
    if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  if (abandoned()) {
    // A given-up MPI operation may still write into the segment (or the group's buffers): keep
    // them mapped and allocated for the life of the process.
    (void)group_.release();
    seg_.forget();
  } else {
    delete mpi_stage_;
  }
  mpi_stage_ = nullptr;
  for (auto& spare : spare_stages_) delete spare.second;
  spare_stages_.clear();
  group_.reset();
  notices_.reset();
  seg_.unlink();
  seg_.unmap();
}

}  // namespace tnt
