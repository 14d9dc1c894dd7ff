#pragma once
// The engine of one process: MPI bootstrap (node discovery, cross-node communicator, shared
// segment) and the node group. The calling thread drives the inter-node transport itself.
#include <mpi.h>

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tnt/abort_notices.hpp"
#include "tnt/allreduce_path.hpp"
#include "tnt/call_record.hpp"
#include "tnt/gaspi_start.hpp"
#include "tnt/mpi_collectives.hpp"
#include "tnt/mpi_transport.hpp"
#include "tnt/node_group.hpp"
#include "tnt/path_choice.hpp"
#include "tnt/segment.hpp"
#include "tnt/timeline.hpp"

namespace tnt {

// The inter-node exchange: MPI, or GASPI (GPI-2, in builds that found it: gaspi_transport.hpp).
enum class TransportKind { mpi, gaspi };

struct EngineOptions {
  double timeout_s = 30.0;      // bounded wait of every collective and of the bootstrap
  int ranks_per_node = 0;       // >0: pseudo-nodes of k consecutive ranks (testing/topology knob)
  // Shared memory per local rank (two halves, one per round parity); 0: kDefaultSlotBytes.
  size_t slot_bytes = 0;
  // How long a wait spins before it sleeps; -1: kDefaultSpinMicroseconds where the machine's
  // ranks do not outnumber their cores, else 0 (the rank waited for needs the core).
  int spin_us = -1;
  // Allreduce through the engine's own path, MPI_Allreduce, or whichever measures faster per
  // call site (path_choice.hpp).
  PathPolicy path = PathPolicy::automatic;
  TransportKind transport = TransportKind::mpi;
  int gaspi_port = 0;  // first of GPI-2's ports on every host; 0: a range free everywhere
};

// A core that slept (a halted virtual CPU above all) wakes tens of microseconds late, and training
// ranks wait out each other's drift, a few hundred microseconds, at every step. Measured on 2
// cores, epochs alternating in one world: 2 ranks at batch 256 8.6-10.4 % faster than with 50 us,
// level at batch 1024 and 4096.
constexpr int kDefaultSpinMicroseconds = 2000;

// 1 MiB rounds keep what a round writes to the segment in cache until the peers read it, so
// large messages cost little more than reading the input and writing the output once. Measured
// with 2 ranks: 16/64 MB took 2.4/9.0 ms with 1-2 MiB slots, 3.1/11.6 ms with 16 MiB slots;
// 4 ranks on 2 cores were within noise of each other.
constexpr size_t kDefaultSlotBytes = size_t{2} << 20;

struct BootBuffers;

// Across nodes, MPI's path sends calls up to these sizes with their check in one message (see
// MpiCollectives::start_blob_allreduce); larger ones check with a small allreduce of their own
// beside the data's (a datatype of one whole blob would keep MPI from splitting large data).
// Measured (MPI's path, float32 sum, ours vs MPI_Allreduce, two runs each): 2 test hosts x 1
// rank, in one message against beside: 128 KB 1.20-1.22x against 0.83-0.85x, 256 KB 1.07-1.08x
// against 0.88-0.89x, 1 MB 1.00-1.03x against 0.97-0.98x, 4 MB 1.15-1.17x against 0.99-1.01x,
// 16 MB 0.91-0.92x against 0.97-0.98x. With 2 ranks on each host one message is the slower from
// 128 KB on (128 KB 207-209 us against 155, 1 MB 2096-2193 against 1115, the same two hosts).
// On 2 pseudo-nodes of one host (MPI through shared memory, a testing knob) one message costs more
// from 64 KB on (0.84x against 0.94x), and below it less (4 KB 5.2 against 7.6 us); pseudo-nodes
// of one rank take the larger limit all the same.
constexpr size_t kCheckedBlobBytes = size_t{64} << 10;
constexpr size_t kCheckedBlobBytesOneRankPerNode = size_t{1} << 20;

// A bootstrap step in which every rank takes part completes within milliseconds; an interrupt
// ends a step's wait only once it has lasted this long (a rank is missing). Otherwise an interrupt
// landing just as a step completes could let one rank suspend before it sees the completion while
// another goes on into the next step, where MPI's communicator splits block until the first
// rank resumes.
constexpr double kBootstrapInterruptGraceSeconds = 1.0;

class Engine {
 public:
  // Communicates nothing: start() bootstraps.
  Engine(MPI_Comm world, const EngineOptions& opt);
  ~Engine();

  // The bootstrap on a duplicate of `world` (a collective over `world`, each wait bounded by the
  // timeout). An interrupt or a timeout suspends it with its MPI operation in flight: calling
  // start() again resumes it there, so that every rank issues the same collectives on `world`
  // whichever of them were interrupted (a rank that gave up an MPI_Comm_idup and started another
  // would be matched with its peers' first). Other errors fail it for good (broken()).
  void start(const InterruptCheck& interrupt);
  bool ready() const { return ready_; }
  // Started, suspended, neither failed nor closed: only start() may follow.
  bool bootstrapping() const { return boot_step_ > 0 && !ready_ && !broken_ && !closed_; }

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return cfg_.local_rank; }
  int local_size() const { return cfg_.local_size; }
  int num_nodes() const { return nnodes_; }
  int nparts() const { return cfg_.nparts; }
  size_t slot_bytes() const { return cfg_.slot_bytes; }
  int spin_microseconds() const { return spin_us_; }
  const std::string& segment_name() const { return seg_name_; }
  TransportKind transport() const { return opt_.transport; }
  double timeout() const { return opt_.timeout_s; }
  void set_timeout(double seconds) { opt_.timeout_s = seconds; }
  double wait_seconds() const { return group_ ? group_->wait_seconds() : 0.0; }
  bool broken() const { return broken_ || (group_ && group_->broken()); }
  // Bootstrapped, not closed and not broken: collectives may run.
  bool usable() const { return ready_ && !closed_ && !broken(); }
  // A failed collective was given up while MPI may still use its buffers (see allreduce).
  bool abandoned() const { return abandoned_ || (group_ && group_->abandoned()); }
  const PathChoice& path_choice() const { return choice_; }
  // Per batch of start_allreduce calls: Path::mpi posted at the start, Path::engine whole at finish.
  const PathChoice& posting_choice() const { return posting_; }

  // A piece's output may be its input (in place) or lie apart from it; one that overlaps it
  // otherwise gets a copy of the input first. MPI_Allreduce, and the exchange between nodes of a
  // node of one rank, work on the pieces themselves only if `caller_keeps_buffers`: the caller
  // promises to keep them allocated for the life of the process once abandoned() (a given-up MPI
  // operation may still read and write them); else they work on copies in the engine's memory.
  void allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                 const InterruptCheck& interrupt, bool caller_keeps_buffers = false);
  // The same in two halves, so that the caller computes (the rest of backprop) while the data
  // travels: start_allreduce returns a ticket; finish_allreduce, called for every ticket in the
  // order of the starts with the same pieces (inputs unchanged since), writes the outputs.
  // Across nodes, a call that MPI's path sends in one message (one_message_bytes()) may be
  // posted by its start as messages that move without this rank polling (see PostedHalves);
  // otherwise its finish carries it out whole through allreduce(). Which of the two is chosen
  // for each batch of calls started together (see Batch) as PathChoice chooses paths, by the
  // time the caller spends in their starts and finishes: what a training step waits for.
  int64_t start_allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                          const InterruptCheck& interrupt);
  void finish_allreduce(int64_t ticket, const std::vector<Piece>& pieces,
                        const InterruptCheck& interrupt);
  // Whether start_allreduce may post: several nodes, and a path policy that allows MPI's.
  bool overlaps_exchanges() const;
  // The largest call (bytes) that MPI's path sends with its check in one message across nodes,
  // and that start_allreduce may post (the same on every rank: world-wide counts only).
  size_t one_message_bytes() const {
    return size_ == nnodes_ ? kCheckedBlobBytesOneRankPerNode : kCheckedBlobBytes;
  }
  void barrier(const InterruptCheck& interrupt);
  // `data` is read on the root and replaced on the others.
  void broadcast(std::string& data, int root, const InterruptCheck& interrupt);
  // The collectives this rank is in now (any thread may read it while they run).
  const CallRecord& calls() const { return record_; }
  // Marks this rank gone in the segment. Idempotent.
  void close();
  // Gives up the collectives on every rank (this rank's program failed between two of them):
  // the others' current or next collective raises AbortedError with `why`. Breaks the engine.
  void abort(const std::string& why);

 private:
  friend class OwnAlgorithms;
  friend class MpiAllreducePath;
  friend class PostedHalves;
  friend class WholeAtFinish;

  // The exchange between nodes: GASPI's ring where chosen, else MPI's messages (null on ranks
  // with none).
  Transport* cross() const {
    return cross_gaspi_ ? static_cast<Transport*>(cross_gaspi_.get()) : cross_mpi_.get();
  }
  // The bootstrap (engine_bootstrap.cpp). Runs its next step: what the last step's operation
  // delivered, then the next operation (boot_req_).
  void bootstrap_step(const InterruptCheck& interrupt);
  // The steps, in order; `gaspi_wait` bounds GASPI's start and set-up.
  void boot_duplicate_world(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_node_membership(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_topology(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_nodes_and_cpus(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_spin_and_cross(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_create_segment(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_map_segment(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_abort_notices(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_world_communicator(BootBuffers& b, const MpiWait& gaspi_wait);
  void boot_transports(BootBuffers& b, const MpiWait& gaspi_wait);
  // A step's operation was started (rc), `what` names it for a wait that times out.
  void boot_started(int rc, const char* what);
  // Waits for a bootstrap operation within the timeout. `resumable`: an interrupt or a timeout
  // suspends the bootstrap with `req` in flight; otherwise they fail it (`req` abandoned).
  void wait_boot(MPI_Request* req, const char* what, const InterruptCheck& interrupt,
                 bool resumable);
  // allreduce() without its timeline record nor a new number in the CallRecord (WholeAtFinish's
  // finish records its own, under its start's number); the path that carried it.
  timeline::Path run_allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                               const InterruptCheck& interrupt, bool caller_keeps_buffers = false);
  // Throws AbortedError unless collectives may run.
  void check_usable() const;
  // Agrees with every rank on a site's probe medians (engine, mpi): the slowest rank's.
  void agree_on(double medians[2], const InterruptCheck& interrupt);
  // The first path of `paths` (in priority order) enabled for `call`.
  static AllreducePath* path_for(const std::vector<AllreducePath*>& paths,
                                 const AllreduceCall& call);
  // After a failed start or finish (call_mutex_ held): breaks the engine and gives up every
  // started call, leaving what MPI may still write into allocated.
  void abandon_started(const AllreduceCall& failed);

  EngineOptions opt_;
  MPI_Comm world_;
  // The bootstrap: its next step, the operation in flight and what that operation reads and
  // writes (leaked if the engine is closed with it in flight).
  int boot_step_ = 0;
  MPI_Request boot_req_ = MPI_REQUEST_NULL;
  const char* boot_what_ = "";
  std::unique_ptr<BootBuffers> boot_;
  bool ready_ = false;
  NodeConfig cfg_;
  MPI_Comm comm_ = MPI_COMM_NULL, node_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, nnodes_ = 1, spin_us_ = 0;
  bool broken_ = false, closed_ = false;
  bool abandoned_ = false;  // an MPI operation was given up: its buffers must never be freed
  std::string seg_name_;
  Segment seg_;
  std::unique_ptr<NodeGroup> group_;
  std::unique_ptr<MpiTransport> cross_mpi_;
  // The exchange between nodes when it is not cross_mpi_ (GASPI's ring).
  std::unique_ptr<Transport> cross_gaspi_;
  std::unique_ptr<MpiCollectives> world_mpi_;
  std::unique_ptr<AbortNotices> notices_;  // to and from the ranks of other nodes

  // The allreduce paths (allreduce_path.hpp), and the priority lists that choose among them: of a
  // call carried out at once (allreduce), and of a call started (start_allreduce).
  OwnAlgorithms own_{*this};
  MpiAllreducePath mpi_allreduce_{*this};
  PostedHalves posted_{*this};
  WholeAtFinish whole_at_finish_{*this};
  const std::vector<AllreducePath*> whole_paths_{&mpi_allreduce_, &own_};
  const std::vector<AllreducePath*> started_paths_{&posted_, &whole_at_finish_};
  PathChoice choice_;

  // The calls started and not yet finished, in order.
  std::deque<AllreduceCall> started_;
  int64_t next_ticket_ = 1;
  // The calls started while others are (a training step's buckets) post all or none: how long
  // they keep the caller waiting is measured for the whole batch, since a posted call's wait
  // includes the transfer of those posted before it. Keyed by the batch's first call that may
  // be posted (Path::mpi: posted).
  struct Batch {
    bool decided = false, posting = false, timed = false;
    SiteKey key;
    double exposed = 0;  // seconds spent in its starts and finishes
  };
  Batch batch_;
  PathChoice posting_;
  std::mutex call_mutex_;  // one collective at a time, even if several threads call in
  CallRecord record_;
};

}  // namespace tnt
