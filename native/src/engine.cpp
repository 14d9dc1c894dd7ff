#include "tnt/engine.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "tnt/errors.hpp"

namespace tnt {
namespace {

std::string seconds(double s) {
  char buf[32];
  snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The communication thread: runs one nonblocking transport operation at a time to completion, so
// that the inter-node exchange progresses while the calling (Python) thread only waits on a flag.

class CommThread {
 public:
  CommThread() : th_([this] { loop(); }) {}
  ~CommThread() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_.store(true);
    }
    cv_.notify_one();
    th_.join();
  }

  // Starts `start()` on the thread; the returned handle completes with it.
  Pending* post(std::function<Pending*()> start) {
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = std::move(start);
      cancel_.store(false);
      state_.store(kPosted, std::memory_order_release);
    }
    cv_.notify_one();
    return new Handle(this);
  }
  void cancel() { cancel_.store(true, std::memory_order_release); }

 private:
  enum { kIdle, kPosted, kDone, kFailed };
  struct Handle : Pending {
    explicit Handle(CommThread* t) : t(t) {}
    CommThread* t;
    bool test() override {
      int s = t->state_.load(std::memory_order_acquire);
      if (s == kFailed) throw CollectiveError(t->error_);
      return s == kDone;
    }
  };

  void loop() {
    for (;;) {
      std::function<Pending*()> job;
      {
        // Spin briefly for the next job (rounds follow each other closely), then sleep.
        auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
        while (state_.load(std::memory_order_acquire) != kPosted && !stop_.load() &&
               std::chrono::steady_clock::now() < until)
          std::this_thread::yield();
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [this] { return stop_.load() || state_.load() == kPosted; });
        if (stop_.load()) return;
        job = std::move(job_);
      }
      try {
        std::unique_ptr<Pending> op(job());
        Backoff backoff;
        bool done = false;
        while (!(done = op->test())) {
          if (cancel_.load(std::memory_order_acquire)) break;
          backoff.pause();
        }
        if (!done) (void)op.release();  // abandoned: the request can never be freed safely
        state_.store(kDone, std::memory_order_release);
      } catch (const std::exception& e) {
        error_ = e.what();
        state_.store(kFailed, std::memory_order_release);
      }
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<int> state_{kIdle};
  std::atomic<bool> cancel_{false};
  std::atomic<bool> stop_{false};
  std::function<Pending*()> job_;
  std::string error_;
  std::thread th_;  // last: starts after the members above are constructed
};

namespace {

// The cross-node transport driven by the communication thread.
class ThreadedTransport : public Transport {
 public:
  ThreadedTransport(MpiTransport* inner, CommThread* thread) : inner_(inner), thread_(thread) {}
  int size() const override { return inner_->size(); }
  int rank() const override { return inner_->rank(); }
  Pending* start_allreduce(void* buf, size_t n, DType t, Op op) override {
    return thread_->post([=] { return inner_->start_allreduce(buf, n, t, op); });
  }
  void abandon() override {
    thread_->cancel();
    inner_->abandon();
  }
  std::string describe_peers() const override { return inner_->describe_peers(); }

 private:
  MpiTransport* inner_;
  CommThread* thread_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------

Engine::Engine(MPI_Comm world, const EngineOptions& opt, const InterruptCheck& interrupt)
    : opt_(opt) {
  try {
    bootstrap(world, interrupt);
  } catch (...) {
    broken_ = true;
    seg_.unlink();
    throw;
  }
}

Engine::~Engine() { close(); }

void Engine::wait_request(MPI_Request* req, const char* what, const InterruptCheck& interrupt) {
  auto end = std::chrono::steady_clock::now() +
             std::chrono::microseconds(static_cast<int64_t>(opt_.timeout_s * 1e6));
  Backoff backoff;
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(req, &done, MPI_STATUS_IGNORE), what);
    if (done) return;
    if (backoff.pause()) {
      if (std::chrono::steady_clock::now() > end) {
        broken_ = true;
        throw TimeoutError(std::string("engine bootstrap timed out after ") +
                           seconds(opt_.timeout_s) + " s in " + what +
                           ": not every rank joined the collective");
      }
      if (interrupt && interrupt()) {
        broken_ = true;
        throw Interrupted();
      }
    }
  }
}

void Engine::bootstrap(MPI_Comm world, const InterruptCheck& interrupt) {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  MPI_Request req;
  check_mpi(MPI_Comm_idup(world, &comm_, &req), "MPI_Comm_idup");
  wait_request(&req, "MPI_Comm_idup", interrupt);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);

  // Node membership: MPI's shared-memory split, or pseudo-nodes of k consecutive ranks.
  if (opt_.ranks_per_node > 0)
    check_mpi(MPI_Comm_split(comm_, rank_ / opt_.ranks_per_node, rank_, &node_), "MPI_Comm_split");
  else
    check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_),
              "MPI_Comm_split_type");
  MPI_Comm_rank(node_, &cfg_.local_rank);
  MPI_Comm_size(node_, &cfg_.local_size);
  cfg_.world_size = size_;
  cfg_.slot_bytes = opt_.slot_bytes;
  cfg_.world_ranks.resize(static_cast<size_t>(cfg_.local_size));
  check_mpi(MPI_Iallgather(&rank_, 1, MPI_INT, cfg_.world_ranks.data(), 1, MPI_INT, node_, &req),
            "MPI_Iallgather");
  wait_request(&req, "MPI_Iallgather (node ranks)", interrupt);

  // Every rank's local rank: number of nodes, and whether all nodes have the same size.
  std::vector<int> local_ranks(static_cast<size_t>(size_)), local_sizes(static_cast<size_t>(size_));
  int mine[2] = {cfg_.local_rank, cfg_.local_size};
  std::vector<int> all(2 * static_cast<size_t>(size_));
  check_mpi(MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm_, &req),
            "MPI_Iallgather");
  wait_request(&req, "MPI_Iallgather (topology)", interrupt);
  bool uniform = true;
  nnodes_ = 0;
  for (int r = 0; r < size_; ++r) {
    nnodes_ += all[2 * r] == 0;
    uniform = uniform && all[2 * r + 1] == cfg_.local_size;
  }
  // Ranks that outnumber the cores must not spin: the rank they wait for needs the core.
  set_spin_microseconds(cfg_.local_size > available_cpus() ? 0 : 50);
  // On uneven nodes only the node leader reduces (and talks to other nodes).
  cfg_.nparts = uniform ? cfg_.local_size : 1;

  MPI_Comm cross = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm_, cfg_.local_rank < cfg_.nparts ? cfg_.local_rank : MPI_UNDEFINED,
                           rank_, &cross),
            "MPI_Comm_split");
  if (cross != MPI_COMM_NULL) {
    int n = 0;
    MPI_Comm_size(cross, &n);
    std::vector<int> ranks(static_cast<size_t>(n));
    check_mpi(MPI_Iallgather(&rank_, 1, MPI_INT, ranks.data(), 1, MPI_INT, cross, &req),
              "MPI_Iallgather");
    wait_request(&req, "MPI_Iallgather (cross-node ranks)", interrupt);
    cross_mpi_ = std::make_unique<MpiTransport>(cross, std::move(ranks));
  }

  // The shared segment: local rank 0 creates it and broadcasts its name (or its error).
  const size_t bytes = segment_bytes(cfg_);
  const bool creator = cfg_.local_rank == 0;
  char name[512] = {};
  if (creator) {
    try {
      seg_.create(new_segment_name(), bytes);
      group_ = std::make_unique<NodeGroup>(cfg_, &seg_, true);  // initialises the header
      snprintf(name, sizeof name, "%s", seg_.name().c_str());
    } catch (const std::exception& e) {
      snprintf(name, sizeof name, "!%s", e.what());
    }
  }
  check_mpi(MPI_Ibcast(name, sizeof name, MPI_CHAR, 0, node_, &req), "MPI_Ibcast");
  wait_request(&req, "MPI_Ibcast (segment name)", interrupt);
  if (name[0] == '!')
    throw CollectiveError(std::string("local rank 0 could not create the shared segment: ") +
                          (name + 1));
  int ok = 1;
  std::string error;
  if (!creator) {
    try {
      seg_.open(name, bytes);
      group_ = std::make_unique<NodeGroup>(cfg_, &seg_, false);
      group_->attach();  // also checks that every local rank uses the same configuration
    } catch (const std::exception& e) {
      ok = 0;
      error = e.what();
    }
  }
  // Everyone has mapped it (or failed): the name can go, nothing is left in /dev/shm.
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, node_, &req), "MPI_Iallreduce");
  wait_request(&req, "MPI_Iallreduce (segment attach)", interrupt);
  seg_.unlink();
  if (!ok)
    throw CollectiveError("a local rank could not map the shared segment" +
                          (error.empty() ? std::string() : ": " + error));
  seg_name_ = name;
  if (creator) group_->attach();

  if (cross_mpi_ && cross_mpi_->size() > 1) {
    if (provided == MPI_THREAD_MULTIPLE) {
      thread_ = std::make_unique<CommThread>();
      cross_ = std::make_unique<ThreadedTransport>(cross_mpi_.get(), thread_.get());
    }
  }
  MPI_Comm wcomm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm_, &wcomm), "MPI_Comm_dup");
  std::vector<int> wranks(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) wranks[static_cast<size_t>(r)] = r;
  world_mpi_ = std::make_unique<MpiTransport>(wcomm, std::move(wranks));
  if (provided == MPI_THREAD_MULTIPLE && !thread_) thread_ = std::make_unique<CommThread>();
}

void Engine::allreduce(const std::vector<Piece>& pieces, DType t, Op op, int64_t bucket,
                       const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (closed_ || broken()) throw AbortedError("the engine was aborted or closed; rebuild it");
  size_t bytes = 0;
  for (const auto& p : pieces) bytes += p.bytes;
  Transport* cross = cross_ ? cross_.get() : cross_mpi_.get();
  group_->run(pieces, bytes / dtype_size(t), Call{Kind::allreduce, t, op, bucket}, cross,
              opt_.timeout_s, interrupt);
}

void Engine::barrier(const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (closed_ || broken()) throw AbortedError("the engine was aborted or closed; rebuild it");
  Transport* cross = cross_ ? cross_.get() : cross_mpi_.get();
  group_->run({}, 0, Call{Kind::barrier, DType::f32, Op::sum, -1}, cross, opt_.timeout_s,
              interrupt);
}

void Engine::broadcast(std::string& data, int root, const InterruptCheck& interrupt) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (closed_ || broken()) throw AbortedError("the engine was aborted or closed; rebuild it");
  if (root < 0 || root >= size_)
    throw std::invalid_argument("broadcast root " + std::to_string(root) + " is not a rank");
  // Agree on the root (and synchronise) first: a mismatch is an error, not a hang.
  Transport* cross = cross_ ? cross_.get() : cross_mpi_.get();
  group_->run({}, 0, Call{Kind::broadcast, DType::f32, Op::sum, root}, cross, opt_.timeout_s,
              interrupt);
  if (size_ == 1) return;
  auto run = [&](void* buf, size_t n) {
    MpiTransport* w = world_mpi_.get();
    std::function<Pending*()> start = [=] { return w->start_bcast(buf, n, root); };
    Pending* p = thread_ ? thread_->post(start) : start();
    struct Abandon : Transport {
      CommThread* t;
      MpiTransport* w;
      int size() const override { return 0; }
      int rank() const override { return 0; }
      Pending* start_allreduce(void*, size_t, DType, Op) override { return nullptr; }
      void abandon() override {
        if (t) t->cancel();
        w->abandon();
      }
      std::string describe_peers() const override { return ""; }
    } ab;
    ab.t = thread_.get();
    ab.w = w;
    group_->wait_pending(p, "broadcast", "rank " + std::to_string(root), opt_.timeout_s,
                         interrupt, &ab);
  };
  uint64_t n = data.size();
  run(&n, sizeof n);
  if (rank_ != root) data.assign(n, '\0');
  constexpr size_t kChunk = size_t{1} << 30;
  for (size_t off = 0; off < n; off += kChunk) run(&data[off], std::min(kChunk, n - off));
}

void Engine::close() {
  if (closed_) return;
  closed_ = true;
  if (group_) group_->close();
  thread_.reset();
  bool dead = broken();
  if (dead) {
    if (cross_mpi_) cross_mpi_->abandon();
    if (world_mpi_) world_mpi_->abandon();
  }
  cross_.reset();
  cross_mpi_.reset();
  world_mpi_.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!dead && !finalized) {
    if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  group_.reset();
  seg_.unlink();
  seg_.unmap();
}

}  // namespace tnt
