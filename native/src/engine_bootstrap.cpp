// The engine's bootstrap: a state machine of nonblocking MPI steps (each may suspend on an
// interrupt or a timeout and resume where it stopped).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <mutex>
#include <string>

#include "tnt/engine.hpp"
#include "tnt/errors.hpp"
#include "tnt/gaspi_transport.hpp"

namespace tnt {
namespace {

std::string seconds(double s) {
  char buf[32];
  snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace

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

// (Here, where BootBuffers is complete.)
Engine::Engine(MPI_Comm world, const EngineOptions& opt)
    : opt_(opt), world_(world), choice_(opt.path), posting_(opt.path) {}

Engine::~Engine() { close(); }

void Engine::start(const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (ready_) return;
  InCall in(record_, "start-up", Call{}, 0, 0);
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

void Engine::boot_started(int rc, const char* what) {
  boot_what_ = what;
  check_mpi(rc, what);
}

void Engine::bootstrap_step(const InterruptCheck& interrupt) {
  // GASPI's start and segments run inside one step, each wait bounded but not resumable (GPI-2
  // starts once per process: a start cut short cannot be continued).
  const MpiWait gaspi_wait = [&](MPI_Request* r, const char* what) {
    wait_boot(r, what, interrupt, false);
  };
  using Step = void (Engine::*)(BootBuffers&, const MpiWait&);
  static constexpr Step kSteps[] = {
      &Engine::boot_duplicate_world, &Engine::boot_node_membership,
      &Engine::boot_topology,        &Engine::boot_nodes_and_cpus,
      &Engine::boot_spin_and_cross,  &Engine::boot_create_segment,
      &Engine::boot_map_segment,     &Engine::boot_abort_notices,
      &Engine::boot_world_communicator, &Engine::boot_transports};
  (this->*kSteps[boot_step_++])(*boot_, gaspi_wait);
}

// The world communicator duplicated: the bootstrap's own.
void Engine::boot_duplicate_world(BootBuffers& b, const MpiWait&) {
  boot_started(MPI_Comm_idup(world_, &b.comm, &boot_req_), "MPI_Comm_idup");
}

// Node membership: MPI's shared-memory split, or pseudo-nodes of k consecutive ranks.
void Engine::boot_node_membership(BootBuffers& b, const MpiWait& gaspi_wait) {
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
  boot_started(
      MPI_Iallgather(&b.rank, 1, MPI_INT, b.node_ranks.data(), 1, MPI_INT, node_, &boot_req_),
      "MPI_Iallgather (node ranks)");
}

// Every rank's local rank and node size, its allreduce path policy and slot size.
void Engine::boot_topology(BootBuffers& b, const MpiWait&) {
  cfg_.world_ranks = b.node_ranks;
  b.mine[0] = cfg_.local_rank;
  b.mine[1] = cfg_.local_size;
  b.mine[2] = static_cast<int>(opt_.path);
  b.mine[3] = static_cast<int>(cfg_.slot_bytes & 0x7fffffff);
  b.mine[4] = static_cast<int>(cfg_.slot_bytes >> 31);
  b.all.resize(kTopologyInts * static_cast<size_t>(size_));
  boot_started(MPI_Iallgather(b.mine, kTopologyInts, MPI_INT, b.all.data(), kTopologyInts,
                              MPI_INT, comm_, &boot_req_),
               "MPI_Iallgather (topology)");
}

// The number of nodes, whether they are even, and the machine's cpu sets.
void Engine::boot_nodes_and_cpus(BootBuffers& b, const MpiWait&) {
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
    check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &b.machine),
              "MPI_Comm_split_type");
  int machine_size = 1;
  MPI_Comm_size(b.machine, &machine_size);
  b.mask = cpu_mask();
  b.masks.resize(b.mask.size() * static_cast<size_t>(machine_size));
  const int n = static_cast<int>(b.mask.size());
  boot_started(MPI_Iallgather(b.mask.data(), n, MPI_BYTE, b.masks.data(), n, MPI_BYTE, b.machine,
                              &boot_req_),
               "MPI_Iallgather (cpu sets)");
}

// The spin policy; the communicator of the ranks with our local rank.
void Engine::boot_spin_and_cross(BootBuffers& b, const MpiWait&) {
  int machine_size = 1;
  MPI_Comm_size(b.machine, &machine_size);
  if (b.machine != node_) MPI_Comm_free(&b.machine);
  if (opt_.spin_us >= 0)
    spin_us_ = opt_.spin_us;  // the user's choice
  else
    spin_us_ = machine_size > count_cpus(b.masks) ? 0 : kDefaultSpinMicroseconds;
  set_spin_microseconds(spin_us_);
  check_mpi(MPI_Comm_split(comm_, cfg_.local_rank < cfg_.nparts ? cfg_.local_rank : MPI_UNDEFINED,
                           rank_, &b.cross),
            "MPI_Comm_split");
  if (b.cross == MPI_COMM_NULL) return;  // (no operation: the next step follows at once)
  int n = 0;
  MPI_Comm_size(b.cross, &n);
  b.cross_ranks.resize(static_cast<size_t>(n));
  boot_started(
      MPI_Iallgather(&b.rank, 1, MPI_INT, b.cross_ranks.data(), 1, MPI_INT, b.cross, &boot_req_),
      "MPI_Iallgather (cross-node ranks)");
}

// The shared segment: local rank 0 creates it and broadcasts its name (or its error).
void Engine::boot_create_segment(BootBuffers& b, const MpiWait&) {
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
  boot_started(MPI_Ibcast(b.name, sizeof b.name, MPI_CHAR, 0, node_, &boot_req_),
               "MPI_Ibcast (segment name)");
}

// Every rank maps it (or fails), and all ranks of every node learn whether all did.
void Engine::boot_map_segment(BootBuffers& b, const MpiWait&) {
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
  boot_started(MPI_Iallreduce(MPI_IN_PLACE, &b.ok, 1, MPI_INT, MPI_MIN, comm_, &boot_req_),
               "MPI_Iallreduce (segment attach)");
}

// Everyone has mapped it (or failed): the name can go, nothing is left in /dev/shm. Then the
// addresses of the abort notices.
void Engine::boot_abort_notices(BootBuffers& b, const MpiWait&) {
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
    boot_started(MPI_Iallgather(&b.notice_me, sizeof(NoticeAddress), MPI_BYTE,
                                b.notice_all.data(), sizeof(NoticeAddress), MPI_BYTE, comm_,
                                &boot_req_),
                 "MPI_Iallgather (abort notice addresses)");
  }
}

// The abort notices' hooks, and the world communicator of MPI's collectives.
void Engine::boot_world_communicator(BootBuffers& b, const MpiWait&) {
  if (nnodes_ > 1) {
    std::vector<bool> remote(static_cast<size_t>(size_), true);
    for (int w : cfg_.world_ranks) remote[static_cast<size_t>(w)] = false;
    notices_->set_world(b.notice_all, rank_, std::move(remote));
    group_->set_remote_abort([this] { return notices_->poll(); },
                             [this](const std::string& why) {
                               notices_->announce("rank " + std::to_string(rank_) + ": " + why);
                             });
  }
  boot_started(MPI_Comm_idup(comm_, &b.wcomm, &boot_req_), "MPI_Comm_idup (world)");
}

// The exchange between nodes over GASPI, if chosen, and MPI's collectives: the engine is ready.
void Engine::boot_transports(BootBuffers& b, const MpiWait& gaspi_wait) {
  if (opt_.transport == TransportKind::gaspi && cross_mpi_ && cross_mpi_->size() > 1)
    cross_gaspi_ = make_gaspi_transport(b.cross, b.cross_ranks, part_bytes(cfg_), opt_.timeout_s,
                                        gaspi_wait);
  std::vector<int> wranks(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) wranks[static_cast<size_t>(r)] = r;
  world_mpi_ = std::make_unique<MpiCollectives>(b.wcomm, std::move(wranks));
  ready_ = true;
}

}  // namespace tnt
